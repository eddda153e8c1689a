"""One LoRA training step of issue 46's flagship work on fake tensors: foundryx (the shipped
large-model recipe, yamls/finetune/llama-8b-lora-fp8.yaml, over a bf16, FP8 or NF4 frozen
base, optionally half offloaded) and its peer (plain transformers + peft, as
benchmarks/peer_lora.py trains it), built and run under ``FakeTensorMode``: no weight is
allocated and no kernel runs, but every op is dispatched, so the instruments of
benchmarks/flagship_estimate.py (memory by category) and benchmarks/op_census.py (FLOPs,
bytes, kernels) see the real step.

The fake tensors are CPU tensors (a CPU-only torch cannot put a fake tensor on CUDA: the
autograd engine initialises the CUDA device for it), run as the GPU runs them:

- bf16 autocast (``torch.autocast("cpu", bfloat16)``; its op lists match CUDA's for the ops
  these models use: linear and matmul in bf16, norms and the loss upcast by the model code);
- attention as the GPU's flash kernels do it (FlashAttention-2 / cuDNN: the output and a
  float32 log-sum-exp kept for backward, a float32 dq accumulator in backward), in place of
  PyTorch's CPU SDPA, which serves grouped kv heads by its math path (the whole score matrix);
- foundryx's run config as on one GPU (no FSDP2 on one process, activation checkpointing on
  every block, compile off as the measured runs had it, the fused RMS norm, SwiGLU and RoPE
  operators on, and an NF4 base decoded by its fused operator, as ``fused_ops: auto`` has them
  on a GPU); ``device: cpu`` only so that nothing is pinned.

A step is the trainer's: zero the gradients, forward and loss under autocast, backward with
the forward's outputs still referenced where the trainer holds them (Composer keeps
``state.outputs`` through backward; the peer's loop keeps only ``.loss``, as
benchmarks/peer_lora.py does), the optimizer step. Two steps run; the second is the one measured
(the optimizer's state exists from the first, as in the measured steps 2..5).

The optimizer may step fake CUDA tensors instead (``gpu_optimizer``: the op census's choice):
an optimizer picks its kernels by its parameters' device (torch's AdamW and foundryx's
``decoupled_adamw`` run a Python loop of per-parameter ops on a CPU and multi-tensor kernels on
a GPU), and no autograd runs in its step, so a fake CUDA twin of each parameter it holds is
enough for it to take the GPU's path (:func:`optimizer_on_gpu`).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "yamls/finetune/llama-8b-lora-fp8.yaml"
SIDES = ("peer", "bf16", "fp8", "nf4", "fp8-offload0.5")
# the FP8 base with its GEMMs on FP8 tensor cores (row-wise torch._scaled_mm), as an H100 runs
# it; traced where this torch has a CPU _scaled_mm (2.15: .venv-modern), not the emulation
TENSOR_CORE_SIDES = ("fp8-tc",)
# any foundryx side + PEFT_LAYER: PEFT's own lora.Linear forward (peft_config.one_pass: false),
# the adapter path as it ran before issue 51
PEFT_LAYER = "-peft"
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}


class NotTraceable(Exception):
    """A side the fake step cannot run (which module stopped it, and why)."""


@dataclass
class FakeStep:
    """A side built on fake tensors: its model, optimizer and batch, and how to run a step."""

    side: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict
    forward_loss: Callable[[dict], tuple[object, torch.Tensor]]
    frozen_linear: set[int] = field(default_factory=set)  # ids of the frozen base's weights
    vocab: int = 0
    offloaded: list = field(default_factory=list)  # foundryx's Offloaded sources
    activation_offload: object = None  # foundryx's ActivationOffload (checkpoints in host memory)
    # (model parameter, the optimizer's fake CUDA twin of it): see optimizer_on_gpu
    gpu_twins: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Attention as a GPU flash kernel holds it
# ---------------------------------------------------------------------------------------
class _FlashLikeAttention(torch.autograd.Function):
    """FlashAttention-2's memory: forward keeps q, k, v, the output and a float32 log-sum-exp
    per query; backward allocates a float32 dq accumulator and the three gradients. Each call
    is recorded in ATTENTION_CALLS with its FLOPs."""

    @staticmethod
    def forward(ctx, q, k, v, causal):  # noqa: ANN001, ANN205
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.flops = attention_flops(q.shape, k.shape, causal)
        recompute = torch._C._current_graph_task_id() != -1
        ATTENTION_CALLS.append(("recompute" if recompute else "forward", ctx.flops))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # noqa: F841
        ATTENTION_CALLS.append(("backward", int(2.5 * ctx.flops)))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def attention_flops(q_shape: torch.Size, k_shape: torch.Size, causal: bool) -> int:
    """A flash forward's FLOPs: 4·b·h·s_q·s_k·d (QK^T and PV), half of it when causal."""
    b, h, s, d = q_shape
    return 4 * b * h * s * k_shape[2] * d // (2 if causal else 1)


ATTENTION_CALLS: list[tuple[str, int]] = []  # (forward | recompute | backward, FLOPs)


def flash_like_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,  # noqa: ANN001, ANN201
                    scale=None, enable_gqa=False, **_):
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    q, k, v = (t.to(dtype) for t in (query, key, value))
    # every side is a causal LM: a training step's attention (as many queries as keys) is
    # causal whatever mask the model passes (a fake tensor holds no values to read it from),
    # and the flash kernel a user runs computes only the unmasked half
    causal = bool(is_causal or attn_mask is None or q.shape[-2] == k.shape[-2])
    return _FlashLikeAttention.apply(q, k, v, causal)


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """F.scaled_dot_product_attention served as a flash kernel (see the module doc); the
    chunks of a model's NF4 decoding and fused loss are the model's options
    (:func:`gpu_chunks`, which the builders here apply)."""
    real = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = flash_like_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def gpu_chunks(model: nn.Module) -> None:
    """``model``'s NF4 weights and fused loss in the chunks a GPU takes them in, though its
    tensors are CPU tensors: each frozen layer's ``nf4_chunk`` and the loss's ``LossChunks``
    (options of the model; foundryx's defaults size them by the tensors' device)."""
    from foundryx.models.layers.loss import DEFAULT_CHUNKS, LossChunks
    from foundryx.models.peft.frozen_base import NF4_CHUNK_BLOCKS, LowPrecisionLinear

    as_gpu = LossChunks(gpu=DEFAULT_CHUNKS.gpu, cpu=DEFAULT_CHUNKS.gpu)
    for m in model.modules():
        if isinstance(m, LowPrecisionLinear):
            m.nf4_chunk = NF4_CHUNK_BLOCKS["gpu"]
        if hasattr(m, "loss_chunks"):  # foundryx's MPT
            m.loss_chunks = as_gpu
        if hasattr(m, "foundryx_loss_chunks"):  # a Hugging Face model's decoder loss
            m.foundryx_loss_chunks = as_gpu


# ---------------------------------------------------------------------------------------
# The sides
# ---------------------------------------------------------------------------------------
def shape_config(shape: Path) -> dict:
    cfg = json.loads((Path(shape) / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise NotTraceable(f"{shape}/config.json: model_type {cfg.get('model_type')!r}; the "
                           "flagship estimate traces Llama-shaped models")
    return cfg


def random_batch(vocab: int, batch: int, seq: int) -> dict:
    """A batch as foundryx's text loader makes it: ids, labels and an all-ones attention mask
    (transformers reads the mask to skip building one: without it, or from position ids alone,
    it builds a ``b x s x s`` boolean mask, 256 GiB at 512K tokens)."""
    ids = torch.zeros(batch, seq, dtype=torch.long)  # values do not matter on fake tensors
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def build_peer(shape: Path, batch: int, seq: int, fused: bool = False) -> FakeStep:
    """Plain transformers + peft as a user writes it (benchmarks/peer_lora.py): the model in
    bf16, gradient checkpointing (non-reentrant), LoRA on all linear layers, AdamW (``fused``
    as peer_lora.py makes it on a GPU, and Hugging Face's Trainer by default on torch 2.8+)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in shape_config(shape).items()
                                     if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "sdpa"
    # built on meta, then given fake storage (peft 0.21 on torch 2.15 cannot swap a fake
    # parameter for its cast: the fake mode holds weak references to it)
    with unfaked(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(target_modules="all-linear", **LORA))
    model.to_empty(device="cpu")
    frozen = {id(m.weight) for name, m in model.named_modules()
              if name.endswith("base_layer") and isinstance(m, nn.Linear)}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4,
                            fused=fused or None)

    def forward_loss(b: dict) -> tuple[object, torch.Tensor]:
        return None, model(**b).loss  # as peer_lora.py: the outputs (logits) not held

    return FakeStep("peer", model, opt, random_batch(config.vocab_size, batch, seq),
                    forward_loss, frozen, config.vocab_size)


def foundryx_overrides(shape: Path, side: str, batch: int, seq: int) -> list[str]:
    peft_layer = side.endswith(PEFT_LAYER)
    base, _, offload = side.removesuffix(PEFT_LAYER).removesuffix("-tc").partition("-offload")
    return [f"variables.model_path={Path(shape).resolve()}", f"variables.max_seq_len={seq}",
            f"model.peft_config.one_pass={str(not peft_layer).lower()}",
            "model.pretrained=false", "model.init_device=meta",
            f"model.frozen_base.dtype={base}",
            f"model.frozen_base.offload_fraction={float(offload or 0)}",
            "device=cpu", "compile.enabled=false", "cpu_matmul=blas",
            # fused_ops: auto is on on a GPU; the fake tensors are CPU tensors (see above)
            "fused_ops.rms_norm=true", "fused_ops.swiglu=true", "fused_ops.rope=true",
            *(["fused_ops.nf4_dequantize=true"] if base == "nf4" else []),
            "train_loader.name=fake_step", "eval_loader=null", "save_folder=null",
            f"device_train_microbatch_size={batch}", f"global_train_batch_size={batch}"]


def build_foundryx(shape: Path, side: str, batch: int, seq: int,
                   overrides: list[str] | tuple[str, ...] = (),
                   recipe: Path | None = None) -> FakeStep:
    """foundryx's recipe (``recipe``, default the flagship's) as the flagship benchmark runs it
    on one GPU (see the module doc)."""
    from foundryx import builders, registry
    from foundryx.loading.dtypes import keep_dtype
    from foundryx.models.peft.frozen_base import LowPrecisionLinear
    from foundryx.train import load_run_config

    register_loader(registry)
    overrides = [*foundryx_overrides(shape, side, batch, seq), *fp8_tensor_cores(side),
                 *overrides]
    loaded = load_run_config(recipe or RECIPE, overrides, world_size=1)
    cfg = loaded.cfg
    with unfaked():  # built on meta, as the recipe builds it (torchmetrics cannot deepcopy fakes)
        model = builders.build_model(cfg, tokenizer=None)
        # the loader's dtype rule for a bf16 checkpoint (the shapes' torch_dtype): frozen-only
        # units keep bf16 (foundryx.loading.dtypes)
        keep_dtype(model, lambda places: torch.bfloat16, cfg.parallelism, cfg.precision)
    model = builders.build_parallelism(cfg, model)  # materialised here: fake tensors
    fill_frozen(model)
    gpu_chunks(model)
    opt = builders.build_optimizer(cfg, model)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    frozen = {id(m.weight) for m in layers if m.weight is not None}
    vocab = shape_config(shape)["vocab_size"]

    def forward_loss(b: dict) -> tuple[object, torch.Tensor]:
        out = model(b)
        return out, model.loss(out, b)

    saves = {getattr(m, "_foundryx_activation_offload", None) for m in model.modules()} - {None}
    return FakeStep(side, model, opt, random_batch(vocab, batch, seq), forward_loss, frozen,
                    vocab, [m.offload for m in layers if m.offload is not None],
                    next(iter(saves), None))


def fill_frozen(model: nn.Module) -> None:
    """Give the frozen base's weights left on meta (a pretrained run's loader fills them; NF4
    and offloaded weights are not materialised with the parameters) fake storage of their
    format, quantized from a fake dense weight as the loader quantizes."""
    from foundryx.models.peft.frozen_base import LowPrecisionLinear, to_storage

    for m in model.modules():
        if not isinstance(m, LowPrecisionLinear):
            continue
        shape = (m.out_features, m.in_features)
        if m.offload is not None and _on_meta(m.offload.host):
            m.offload.host = to_storage(torch.empty(shape), m.storage, m.name)
        elif m.weight is not None and _on_meta(m.weight):
            m.weight = nn.Parameter(to_storage(torch.empty(shape), m.storage, m.name),
                                    requires_grad=False)


def _on_meta(t: torch.Tensor) -> bool:
    from benchmarks.instruments.step_memory import inner_tensors

    return t.device.type == "meta" or any(x.device.type == "meta" for x in inner_tensors(t)) \
        or any(getattr(t, n).device.type == "meta" for n in ("nf4",) if hasattr(t, n))


def register_loader(registry) -> None:  # noqa: ANN001
    """The run configs name loader ``fake_step``: the step's batch is made here, not loaded."""
    if "fake_step" not in registry.dataloaders:
        registry.dataloaders.register("fake_step", lambda *a, **k: None)


def build_mpt(recipe: Path, batch: int, seq: int) -> FakeStep:
    """A pretraining recipe's MPT (yamls/mpt-1b.yaml) as the GPU runs it on one process:
    its own precision, attention and checkpointing, compile off (issue 47's census)."""
    from foundryx import builders, registry
    from foundryx.train import load_run_config

    register_loader(registry)
    loaded = load_run_config(recipe, [
        f"max_seq_len={seq}", "model.init_device=meta", "device=cpu", "compile.enabled=false",
        "cpu_matmul=blas", "train_loader.name=fake_step", "eval_loader=null", "save_folder=null",
        "icl_tasks=null", f"device_train_microbatch_size={batch}",
        f"global_train_batch_size={batch}"], world_size=1)
    cfg = loaded.cfg
    with unfaked():
        model = builders.build_model(cfg, tokenizer=None)
    model = builders.build_parallelism(cfg, model)
    gpu_chunks(model)
    opt = builders.build_optimizer(cfg, model)
    vocab = model.model.config.vocab_size

    def forward_loss(b: dict) -> tuple[object, torch.Tensor]:
        out = model(b)
        return out, model.loss(out, b)

    return FakeStep("mpt", model, opt, random_batch(vocab, batch, seq), forward_loss, set(), vocab)


def fp8_tensor_cores(side: str) -> list[str]:
    """For ``fp8-tc``: the overrides that run the frozen FP8 layers' GEMMs as
    ``torch._scaled_mm`` and quantize their rows with ``torch.ops.foundryx.fp8_quantize_rows``
    (what foundryx.models.peft.fp8_gemm chooses on an H100: one Triton kernel), forced here on
    the fake CPU tensors; NotTraceable where this torch has no CPU ``_scaled_mm``."""
    from foundryx.models.peft import fp8_gemm

    if side.removesuffix(PEFT_LAYER) not in TENSOR_CORE_SIDES:
        return []
    with unfaked():  # a fake tensor's _scaled_mm always "runs": ask the real CPU
        fp8_gemm._scaled_mm_runs_on.cache_clear()
        runs = fp8_gemm._scaled_mm_runs_on("cpu")
    if not runs:
        raise NotTraceable(f"{side}: this torch ({torch.__version__}) has no CPU _scaled_mm to "
                           "trace the FP8 GEMMs with (torch 2.15 has: .venv-modern)")
    return ["model.frozen_base.fp8_gemm=tensor_cores", "model.frozen_base.fp8_rows=kernel"]


def build(side: str, shape: Path, batch: int, seq: int,
          overrides: list[str] | tuple[str, ...] = (), recipe: Path | None = None,
          gpu_optimizer: bool = False) -> FakeStep:
    """``side`` on ``shape`` (a Llama config folder; for ``mpt``, a pretraining recipe);
    ``overrides``: ``key=value`` on foundryx's recipe (its sides only); ``recipe``: that
    recipe (default: the flagship's, yamls/finetune/llama-8b-lora-fp8.yaml); ``gpu_optimizer``:
    the optimizer steps fake CUDA tensors (:func:`optimizer_on_gpu`), the peer's fused."""
    step = _build(side, shape, batch, seq, overrides, recipe, gpu_optimizer)
    if gpu_optimizer:
        optimizer_on_gpu(step)
    return step


def optimizer_on_gpu(step: FakeStep) -> None:
    """The step's optimizer over fake CUDA twins of the parameters it holds (before its first
    step), so that it takes the path a GPU's tensors take: torch's AdamW and foundryx's
    ``decoupled_adamw`` choose for-loop, foreach or fused kernels by the parameters' device,
    and keep a foreach step count on the host. The model's own tensors stay CPU tensors (see
    the module doc); :func:`run_step` hands each twin its parameter's gradient shape."""
    for group in step.optimizer.param_groups:
        twins = [nn.Parameter(torch.empty_like(p, device="cuda"), requires_grad=p.requires_grad)
                 for p in group["params"]]
        step.gpu_twins += list(zip(group["params"], twins))
        group["params"] = twins


def _build(side: str, shape: Path, batch: int, seq: int, overrides: list[str] | tuple[str, ...],
           recipe: Path | None, gpu_optimizer: bool) -> FakeStep:
    core = side.removesuffix(PEFT_LAYER)
    if side != "mpt" and (core not in SIDES + TENSOR_CORE_SIDES or side == "peer" + PEFT_LAYER):
        raise NotTraceable(f"side {side!r}: one of {', '.join(SIDES + TENSOR_CORE_SIDES)} "
                           f"(foundryx's with {PEFT_LAYER}: PEFT's own LoRA layer), or mpt")
    if side != "mpt":
        shape_config(shape)  # a Llama shape, or NotTraceable
    try:
        if side == "mpt":
            return build_mpt(shape, batch, seq)
        if side == "peer":
            return build_peer(shape, batch, seq, fused=gpu_optimizer)
        return build_foundryx(shape, side, batch, seq, overrides, recipe)
    except NotTraceable:
        raise
    except Exception as e:  # noqa: BLE001 - said with where it stopped
        raise NotTraceable(f"{side}: building the model on fake tensors stopped at "
                           f"{where(e)}: {type(e).__name__}: {said(e)}") from e


def said(e: BaseException) -> str:
    """An exception's message on one line (a ConfigError's problems joined), at most 400
    characters."""
    return " ".join(str(e).split())[:400]


def where(e: BaseException) -> str:
    """The innermost frame of ``e``'s traceback inside transformers, peft, torchao or
    foundryx: the module that stopped a trace."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    for f in reversed(frames):
        if any(k in f.filename for k in ("foundryx", "transformers", "peft", "torchao")):
            return f"{Path(f.filename).name}:{f.lineno} ({f.name})"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def add_recipe_overrides(parser) -> None:  # noqa: ANN001
    """``--recipe RECIPE`` (foundryx's sides run that recipe; default the flagship's) and
    ``--set KEY=VALUE`` (repeatable): overrides of foundryx's recipe for its sides (e.g.
    ``activation_checkpointing.mode=selective``); the peer runs as it is."""
    parser.add_argument("--recipe", type=Path, default=None,
                        help=f"foundryx's recipe (default {RECIPE.relative_to(ROOT)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        dest="overrides", help="an override of foundryx's recipe (its sides)")


def each_side(prog: str, shape: Path | None, sides: str,
              fn: Callable[[str], dict]) -> dict[str, dict] | None:
    """``{side: fn(side)}`` for the comma-separated ``sides``; None after saying on stderr why
    not (``shape``, when given, has no config.json; a side cannot be traced): exit code 2."""
    if shape is not None and not (Path(shape) / "config.json").is_file():
        print(f"{prog}: --shape {shape}: no config.json there", file=sys.stderr)
        return None
    out = {}
    for side in sides.split(","):
        try:
            out[side] = fn(side)
        except NotTraceable as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return None
    return out


def run_step(step: FakeStep, on_phase: Callable[[str], contextlib.AbstractContextManager]) -> None:
    """One trainer step; ``on_phase(name)`` wraps each phase (forward, backward, optimizer)."""
    step.optimizer.zero_grad(set_to_none=True)
    for p, _ in step.gpu_twins:
        p.grad = None
    # the forward reads one value: transformers' "is every token attended?" (1: yes, as the
    # text loader's all-ones mask answers)
    with on_phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16), ScalarsRead():
        outputs, loss = step.forward_loss(step.batch)
    with on_phase("backward"):
        loss.backward()
    for p, twin in step.gpu_twins:
        twin.grad = None if p.grad is None else torch.empty_like(p.grad, device=twin.device)
    with on_phase("optimizer"), ScalarsRead():
        step.optimizer.step()
    del outputs, loss


class ScalarsRead(TorchDispatchMode):
    """A fake tensor has no value: an optimizer that reads one (Composer's DecoupledAdamW reads
    its step count with ``.item()``) reads 1, and so does transformers' check that the
    attention mask is all ones. Values never change what a step allocates."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def unfaked() -> Iterator[None]:
    """Leave the fake mode for a while (building on the meta device needs no fake tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


if __name__ == "__main__":
    sys.exit("a library of benchmarks/flagship_estimate.py and benchmarks/op_census.py")
