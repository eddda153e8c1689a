"""A context-parallel rank's training step on paper: peak device memory by category of rank 0 of
``--cp`` ranks running yamls/finetune/llama-3.1-8b-lora-long-cp.yaml (issue 52, part 2).

    python -m benchmarks.cp_estimate [--seq 4194304] [--cp 8] [--shape yamls/shapes/llama-3.1-8b]
        [--set KEY=VALUE ...] [--json FILE]

The real step (benchmarks/fake_step.py: fake tensors, bf16 autocast, attention as a flash kernel
holds it) of the recipe as shipped, built as one rank of ``--cp`` sees it: torch's fake process
group (``FakeStore``: every collective returns at once, on buffers of the real sizes) gives the
world of ``--cp`` ranks, so FSDP2 shards the weights over all of them (shard x cp) and gathers
one unit at a time, the batch is the whole ``--seq`` sequence split at the model's entry, and
Ulysses' all-to-alls hand each attention the whole sequence of the rank's ``heads / cp`` heads
(foundryx/parallel/cp.py). The step is measured by benchmarks/step_memory.py's tracker; the
second step is the one reported. A checkpointed block's input offloaded to host memory
(``activation_checkpointing.cpu_offload``) is a CPU tensor like every other here: the
``activations kept`` category is what the offload moves off the GPU, given on its own line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.instruments import fake_step
from benchmarks.instruments.step_memory import CATEGORIES, CategoryTracker, GiB

RECIPE = fake_step.ROOT / "yamls/finetune/llama-3.1-8b-lora-long-cp.yaml"


@contextlib.contextmanager
def fake_world(ranks: int):
    """This process as rank 0 of ``ranks`` over torch's fake process group."""
    import torch.distributed as tdist
    import torch.distributed._tools.fake_collectives  # noqa: F401  (c10d ops on fake tensors)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "RANK": "0",
           "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    import importlib

    from foundryx.parallel import cp, dist

    parallelize = importlib.import_module("foundryx.parallel.parallelize")  # the module

    gather = dist.all_gather_object  # pickles through a byte tensor: no fake kernel for that
    dist.all_gather_object = lambda obj: [obj] * ranks  # every rank of a fake world alike
    mesh = parallelize.build_cp_mesh

    def real_mesh(*args):  # the mesh's rank tensors are real (a fake one has no values)
        with fake_step.unfaked():
            return mesh(*args)

    parallelize.build_cp_mesh = real_mesh
    # one document a sequence (the text loader's, positions 0..s-1): no document mask, which
    # a fake tensor cannot decide (its positions have no values)
    docs = cp.document_mask
    cp.document_mask = lambda positions: None
    try:
        yield
    finally:
        dist.all_gather_object = gather
        parallelize.build_cp_mesh = mesh
        cp.document_mask = docs
        tdist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build(shape: Path, seq: int, cp: int, overrides: list[str]) -> fake_step.FakeStep:
    """The recipe's step as rank 0 of ``cp`` builds it (model on meta, weights fake)."""
    from foundryx import builders, registry
    from foundryx.config import load_config
    from foundryx.loading.dtypes import keep_dtype
    from foundryx.models.peft.frozen_base import LowPrecisionLinear

    fake_step.register_loader(registry)
    # the run checks but the loader's (the batch is made here: no loader to replicate)
    loaded = load_config(RECIPE, [
        f"variables.model_path={Path(shape).resolve()}", f"variables.max_seq_len={seq}",
        f"parallelism.cp={cp}", "model.pretrained=false", "model.init_device=meta",
        "device=cpu", "compile.enabled=false", "cpu_matmul=blas",
        "train_loader.name=fake_step", "eval_loader=null", "save_folder=null",
        "global_train_batch_size=1", "device_train_microbatch_size=1", *overrides],
        world_size=cp, checks=())
    cfg = loaded.cfg
    with fake_step.unfaked():
        model = builders.build_model(cfg, tokenizer=None)
        keep_dtype(model, lambda places: torch.bfloat16, cfg.parallelism, cfg.precision)
    with fake_step.ScalarsRead():  # FSDP2's gloo probe reads a value: 1 (no correction)
        model = builders.build_parallelism(cfg, model)
    fake_step.fill_frozen(model)
    opt = builders.build_optimizer(cfg, model)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    frozen = {id(m.weight) for m in layers if m.weight is not None}
    vocab = fake_step.shape_config(shape)["vocab_size"]

    def forward_loss(b: dict) -> tuple[object, torch.Tensor]:
        out = model(b)
        return out, model.loss(out, b)

    return fake_step.FakeStep(f"cp{cp}", model, opt, fake_step.random_batch(vocab, 1, seq),
                              forward_loss, frozen, vocab)


@contextlib.contextmanager
def fsdp_storage_seen(tracker: CategoryTracker):
    """FSDP2 frees a unit's gathered weights by resizing their storage to 0 and allocates them
    again by resizing it back (``free_storage`` / ``alloc_storage``), which the tracker's
    weak references do not see: told here, as ``FSDP2 all-gather``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    free, alloc = _fsdp_param.free_storage, _fsdp_param.alloc_storage

    def freed(tensor: torch.Tensor) -> None:
        tracker._free(id(tensor.untyped_storage()))
        free(tensor)

    def allocated(tensor: torch.Tensor) -> None:
        alloc(tensor)
        tracker._free(id(tensor.untyped_storage()))
        tracker.add(tensor, "FSDP2 all-gather")

    _fsdp_param.free_storage, _fsdp_param.alloc_storage = freed, allocated
    try:
        yield
    finally:
        _fsdp_param.free_storage, _fsdp_param.alloc_storage = free, alloc


def estimate(shape: Path, seq: int, cp: int, overrides: list[str]) -> dict:
    start = time.perf_counter()
    with fake_world(cp), fake_step.fake_mode(), fake_step.gpu_kernels():
        step = build(shape, seq, cp, overrides)
        trainable = [p for p in step.model.parameters() if p.requires_grad]
        tracker = CategoryTracker(step.vocab, trainable)
        tracker.register_model(step.model, step.frozen_linear)
        tracker.add(step.batch["input_ids"], "other")

        def phase(name: str) -> contextlib.AbstractContextManager:
            return tracker.in_phase(name)

        with tracker, tracker.watching_modules(), fake_step.ScalarsRead(), \
                fsdp_storage_seen(tracker):
            fake_step.run_step(step, phase)
            tracker.peak, tracker.at_peak = tracker.total, dict(tracker.totals)
            fake_step.run_step(step, phase)
        row = tracker.report()
    row["seconds"] = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Path, default=Path("yamls/shapes/llama-3.1-8b"))
    p.add_argument("--seq", type=int, default=4_194_304, help="tokens of the whole sequence")
    p.add_argument("--cp", type=int, default=8)
    fake_step.add_recipe_overrides(p)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not (a.shape / "config.json").is_file():
        print(f"cp_estimate: --shape {a.shape}: no config.json there", file=sys.stderr)
        return 2
    try:
        row = estimate(a.shape, a.seq, a.cp, a.overrides)
    except fake_step.NotTraceable as e:
        print(f"cp_estimate: {e}", file=sys.stderr)
        return 2
    cats = row["categories"]
    kept = cats.get("activations kept", 0.0)
    print(f"rank 0 of cp {a.cp}, {a.seq:,} tokens ({a.seq // a.cp:,} a rank): peak "
          f"{row['peak_gib']:.2f} GiB on fake tensors ({row['seconds']:.0f} s)")
    print("| " + " | ".join(c.split()[0] for c in CATEGORIES) + " |")
    print("|" + "---|" * len(CATEGORIES))
    print("| " + " | ".join(f"{cats.get(c, 0):.2f}" for c in CATEGORIES) + " |")
    print(f"activations kept (to host memory with activation_checkpointing.cpu_offload): "
          f"{kept:.2f} GiB; the rest on the GPU: {row['peak_gib'] - kept:.2f} GiB")
    if a.json:
        a.json.write_text(json.dumps({**row, "seq": a.seq, "cp": a.cp,
                                      "gib": GiB}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
