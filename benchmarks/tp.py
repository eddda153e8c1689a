"""Tensor parallelism on CPU with gloo, 4 processes: per-rank peak memory and tokens/s for the
same global batch as (shard 4), (shard 2 x tp 2) and (tp 4), for MPT and a Hugging Face Llama,
with the planner's prediction beside each; and the activation memory per rank with sequence
parallel at tp 1 and tp 2 at a sequence length where activations dominate.

    nice .venv/bin/python -m benchmarks.tp [--models mpt llama] [--layouts 1 2 4] [--steps 4]
        [--seq 256] [--act-seq 2048] [--world 4] [--out results.jsonl]

Each configuration is a run config (YAML) that both sides read, with ``parallelism: {tp: T}``
(the FSDP shard degree is the rest: 4 / T): the worker builds it as ``foundryx train`` does
(``builders.build_model``, ``build_parallelism``: TP, then FSDP2; ``build_optimizer``), each
configuration in fresh processes (``torchrun``, 4 ranks); the planner plans the same file for
a CPU device (``make_plan(..., gpus=4, gpu="cpu")``). A TP group shares its batch: rank r
reads the batch of data-parallel rank r // T, and every layout takes 8 sequences per step.

Measured per rank (the largest rank's is reported):
- ``process peak``: the whole process's VmHWM at the end (imports, build, loading, steps);
- ``step peak``: the rise of VmHWM over the RSS before the model was built (after a build on
  the meta device has loaded the code, as plan_accuracy.py does), the peak reset after build
  and the optimizer (``/proc/self/clear_refs``), glibc serving blocks >= 64 KiB with mmap:
  what the planner's per-device total estimates;
- ``activations``: the bytes of the tensors autograd saves in one forward pass after the
  timed steps (each storage once, a DTensor by its local shard, parameters aside), all of
  them (the loss's included;
  the planner's ``activations`` term has the loss's elsewhere) and the transformer blocks'
  alone (the planner's per-block activations x blocks): the ≥ 40% fall from tp 1 to tp 2 is
  the blocks';
- ``tokens/s``: global tokens of the timed steps (the first step untimed) / their time.

``--world 2`` runs every configuration on 2 processes instead of 4 (layouts 1 and 2 only; the
activation comparison is the same tp 1 against tp 2): a quick look, and the script's test.

This needs the TP runtime (``parallelism.tp``, issue 24); on a torch or a branch without it the
worker stops with the config error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.plan_accuracy import rss_mb

ROOT = Path(__file__).resolve().parents[1]

WORLD = 4  # processes, unless --world
GLOBAL_BATCH = 8  # sequences per step, every layout
MODELS = {
    "mpt": {"name": "mpt_causal_lm", "d_model": 256, "n_heads": 8, "n_layers": 4,
            "expansion_ratio": 4, "vocab_size": 8192, "no_bias": True, "norm_type": "rmsnorm",
            "attn_config": {"attn_impl": "torch", "rope": True},
            "ffn_config": {"ffn_type": "swiglu"}},
    "llama": {"name": "hf_causal_lm", "pretrained": False, "config": {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 8192, "tie_word_embeddings": False}},
}
MB = 2**20


def model_section(name: str, seq: int) -> dict:
    m = json.loads(json.dumps(MODELS[name]))
    if name == "mpt":
        m["max_seq_len"] = seq
    else:
        m["config"]["max_position_embeddings"] = seq
    return m


def write_config(folder: Path, model: str, tp: int, seq: int, batch: int,
                 world: int = WORLD) -> Path:
    import yaml

    per_dp = batch // (world // tp)
    cfg = {
        "max_seq_len": seq, "seed": 0, "model": model_section(model, seq),
        "tokenizer": {"name": "hf", "path": "not/needed"},
        "train_loader": {"name": "text", "dataset": {"local": "not/needed", "split": "train",
                                                     "max_seq_len": seq}},
        "max_duration": "10ba", "global_train_batch_size": batch,
        "device_train_microbatch_size": per_dp,  # one microbatch per step, every layout
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-4},
        "precision": "fp32", "device": "cpu", "compile": False, "cpu_matmul": "blas",
        "parallelism": {"sharding_strategy": "FULL_SHARD", "tp": tp},
    }
    path = folder / f"{model}-tp{tp}-s{seq}-b{batch}-w{world}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def saved_bytes(model, batch, n_layers: int) -> tuple[int, int]:
    """Bytes autograd saves in one forward pass and the loss, each storage once: (all, the
    transformer blocks' alone)."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    in_block: dict[int, int] = {}
    inside = [0]

    def pack(t):
        s = local(t).untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
            if inside[0]:
                in_block[s.data_ptr()] = s.nbytes()
        return t

    blocks = next(m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers)
    handles = []
    for b in blocks:
        handles.append(b.register_forward_pre_hook(lambda *_: inside.__setitem__(0, 1)))
        handles.append(b.register_forward_hook(lambda *_: inside.__setitem__(0, 0)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(batch), batch)
    for h in handles:
        h.remove()
    del loss
    return sum(saved.values()), sum(in_block.values())


def worker(config: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from foundryx import builders
    from foundryx.config.load import load_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    loaded = load_config(config, world_size=world, component_sections=("model", "optimizer"))
    cfg = loaded.cfg
    tp = int((loaded.resolved.get("parallelism") or {}).get("tp", 1))
    with torch.device("meta"):  # loads the code the build needs (registries), as
        builders.build_optimizer(cfg, builders.build_model(cfg, None))  # plan_accuracy.py
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before = rss_mb("VmRSS")
    torch.manual_seed(0)
    model = builders.build_parallelism(cfg, builders.build_model(cfg, None))
    opt = builders.build_optimizer(cfg, model)
    mb, seq = cfg.device_train_microbatch_size, cfg.max_seq_len
    vocab = cfg.model.get("vocab_size") or cfg.model["config"]["vocab_size"]
    gen = torch.Generator().manual_seed(rank // tp)  # a TP group shares its batch
    ids = torch.randint(0, vocab, (mb, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    n_layers = cfg.model.get("n_layers") or cfg.model["config"]["num_hidden_layers"]
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    dist.barrier()
    step_peak, process_peak = rss_mb("VmHWM") - before, rss_mb("VmHWM")
    # after the peak is read: this forward pass with no backward leaves memory resident (57
    # MiB on MPT shard 4, not traced further), which, measured before the steps (as until
    # 2026-11-26), sat under every step peak
    acts, block_acts = saved_bytes(model, batch, n_layers)
    result = {"step_peak_mb": round(step_peak, 1), "process_peak_mb": round(process_peak, 1),
              "activations_mb": round(acts / MB, 2), "block_activations_mb":
              round(block_acts / MB, 2), "loss": round(loss.item(), 4),
              "step_s": times}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, result)
    # no destroy_process_group: under tp (torch 2.7, gloo) rank 0 deadlocked in the process
    # group's destructor (the GIL against a gloo worker thread) after every rank had finished,
    # which is what lost the Llama tp rows of 2026-11-25; the process exit tears it down
    if rank == 0:
        timed = [max(r["step_s"][i] for r in everyone) for i in range(1, steps)] or [0.0]
        out = {k: max(r[k] for r in everyone) for k in ("step_peak_mb", "process_peak_mb",
                                                         "activations_mb",
                                                         "block_activations_mb")}
        out["per_rank_process_peak_mb"] = [r["process_peak_mb"] for r in everyone]
        out["tokens_per_s"] = round(cfg.global_train_batch_size * seq * len(timed) / sum(timed), 1)
        out["loss"] = everyone[0]["loss"]
        print("RESULT " + json.dumps(out), flush=True)


def measure(config: Path, steps: int, world: int = WORLD) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "FOUNDRYX_COMPILE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", "-m", "benchmarks.tp", "--worker", str(config), "--steps",
           str(steps)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{config.name} on {world} processes failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def planned(config: Path, world: int = WORLD) -> dict:
    from foundryx.plan.memory import block_activations
    from foundryx.plan.planner import make_plan

    p = make_plan(config, gpus=world, gpu="cpu")
    blocks = p.census.shape.n_layers * block_activations(p.census.shape, p.setup)
    return {"per_device_mb": round(p.per_device_bytes / MB, 1),
            "activations_mb": round(p.terms["activations"] / MB, 2),
            "block_activations_mb": round(blocks / MB, 2),
            "tp_comm_mb": round(p.comm.tp_payload / MB, 1) if p.comm else 0.0,
            "fsdp_gather_mb": round(p.comm.fsdp_gather / MB, 1) if p.comm else 0.0}


def err(est: float, got: float) -> str:
    return f"{(est - got) / got:+.1%}" if got else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--layouts", type=int, nargs="*", default=[1, 2, 4],
                    help="TP degrees of the same-global-batch comparison (none: skip it)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--act-seq", type=int, default=2048,
                    help="sequence length of the activation comparison (tp 1 vs 2); 0: skip")
    ap.add_argument("--world", type=int, choices=[2, 4], default=WORLD,
                    help="processes per configuration (2: layouts 1 and 2 only)")
    ap.add_argument("--out", default=None, help="append each result as a JSON line here")
    args = ap.parse_args()
    world = args.world
    if any(world % tp for tp in args.layouts):
        ap.error(f"--layouts {' '.join(map(str, args.layouts))}: each must divide --world {world}")
    if args.worker:
        return worker(args.worker, args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for tp in args.layouts:
                path = write_config(Path(tmp), model, tp, args.seq, GLOBAL_BATCH, world)
                row = {"model": model, "tp": tp, "shard": world // tp, "seq": args.seq,
                       "measured": measure(path, args.steps, world),
                       "planned": planned(path, world)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
        acts = []
        if args.act_seq:
            for model in args.models:
                for tp in (1, 2):  # one sequence per TP group: the same microbatch per rank
                    path = write_config(Path(tmp), model, tp, args.act_seq, world // tp, world)
                    row = {"model": model, "tp": tp, "seq": args.act_seq, "activations": True,
                           "measured": measure(path, 2, world), "planned": planned(path, world)}
                    acts.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
    print("\n| model | layout | process peak, max rank (MiB) | step peak (MiB) | planner (MiB) "
          "| error | tokens/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        m, p = r["measured"], r["planned"]
        layout = f"shard {r['shard']}" + (f" x tp {r['tp']}" if r["tp"] > 1 else "")
        print(f"| {r['model']} | {layout} | {m['process_peak_mb']:.0f} | {m['step_peak_mb']:.1f} "
              f"| {p['per_device_mb']:.1f} | {err(p['per_device_mb'], m['step_peak_mb'])} "
              f"| {m['tokens_per_s']:.0f} |")
    if acts:
        print("\n| model | seq | tp | blocks' activations per rank (MiB) | planner (MiB) | error "
              "| all saved, loss included (MiB) | planner's activations term (MiB) |"
              "\n|---|---|---|---|---|---|---|---|")
        for r in acts:
            m, p = r["measured"], r["planned"]
            print(f"| {r['model']} | {r['seq']} | {r['tp']} | {m['block_activations_mb']:.1f} | "
                  f"{p['block_activations_mb']:.1f} | "
                  f"{err(p['block_activations_mb'], m['block_activations_mb'])} | "
                  f"{m['activations_mb']:.1f} | {p['activations_mb']:.1f} |")
        for model in args.models:
            one, two = (next(r["measured"]["block_activations_mb"] for r in acts
                             if r["model"] == model and r["tp"] == t) for t in (1, 2))
            fall = 1 - two / one
            print(f"{model}: activations per rank fall {fall:.0%} from tp 1 to tp 2 "
                  f"({'at least' if fall >= 0.4 else 'LESS THAN'} 40%)")


if __name__ == "__main__":
    main()
