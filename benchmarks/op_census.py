"""An op census of one training step on fake tensors, with its time on paper (issues 46, 47).

    python -m benchmarks.op_census --shape yamls/shapes/llama-3.1-8b [--sides peer,bf16] [--json F]
    python -m benchmarks.op_census --mpt yamls/mpt-1b.yaml --batch 8 --seq 2048   # issue 47

For each side (benchmarks/fake_step.py's: ``peer``, ``bf16``, ``fp8``, ``nf4``,
``fp8-offload0.5``) the measured (second) step is dispatched op by op:

- GEMM FLOPs, 2·M·N·K of each matmul from its operands (torch's ``FlopCounterMode`` beside
  it, ``flop_counter``, which does not count in-place GEMMs such as the one-pass adapter's
  ``addmm_``), plus attention's as a
  flash kernel does them (forward 4·b·h·s²·d, halved: every side is a causal LM and the
  kernel skips the masked half; backward 2.5x that);
- every other op that launches a kernel: bytes read (its tensor inputs) and written (its
  outputs); views and metadata ops launch none and are left out;
- the kernel count (one per op that launches one; in the optimizer's step, traced on fake CUDA
  tensors as a GPU runs it, each multi-tensor op (``_foreach_*``, ``_fused_adamw_``) as the
  launches torch's multi-tensor apply makes of its tensor lists on an H100, and the host's ops,
  such as a foreach AdamW's step counts, none: :func:`gpu_launches`);
- the time on paper at an H100's dense peaks and memory bandwidth (989 TFLOP/s bf16, 1,979
  FP8 for ``_scaled_mm``, 3.35 TB/s): each call at the larger of its own FLOP time and its
  own byte time (a GEMM's FLOPs from its two operands: ``_scaled_mm``'s scales are not its
  contraction), summed; the forward and backward, and the optimizer, in their own columns;
  and the launch floor at 4 µs a kernel (eager PyTorch, no CUDA graphs), a column of its own,
  not in the time on paper. The H100 ran the flagship's steps at 0.80-0.86 of the sum as
  counted before issue 51 (per place and op rather than per call; attention counted whole).
- the other bytes by kind (casts and copies, dropout, norms, RoPE, activation, residual
  adds, the adapter path, loss, optimizer, the rest): ``kind_of``.

Each op is charged to where it ran: the innermost module (its dotted name, block numbers
as N) in a forward, the autograd node in backward, ``optimizer`` in the step. Each side's
optimizer steps fake CUDA tensors (benchmarks/instruments/fake_step.py, ``optimizer_on_gpu``),
so it takes the kernels a GPU's tensors get: the peer's torch AdamW ``fused=True`` (as
benchmarks/peer_lora.py and Hugging Face's Trainer on torch 2.8+ make it), foundryx's
``decoupled_adamw`` its ``implementation: auto`` choice (fused on a GPU). ``--vs peer``
(default when both are traced) lists the places where a side moves more bytes or launches
more kernels than the peer: the casts, copies and kept tensors it adds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.instruments import fake_step
from benchmarks.instruments.step_memory import inner_tensors, module_hooks, setting

H100 = {"name": "NVIDIA H100 80GB HBM3 (SXM)", "flops": 989e12, "fp8_flops": 1979e12,
        "bytes_per_s": 3.35e12, "launch_s": 4e-6}
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_scaled_mm", "matmul", "linear",
         "_int_mm"}
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
             "unsqueeze", "squeeze", "detach", "alias", "as_strided", "split", "chunk",
             "unbind", "reshape", "_reshape_alias", "lift_fresh", "empty", "empty_like",
             "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "is_same_size", "_to_copy_noop", "view_as", "split_with_sizes", "diagonal",
             "expand_as", "narrow", "unflatten", "flatten", "movedim", "set_", "resize_",
             "device", "dim", "size", "stride", "sym_size", "sym_stride", "sym_numel",
             "is_contiguous", "is_pinned", "_has_compatible_shallow_copy_type"}


def _bytes(ts) -> int:  # noqa: ANN001
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            for leaf in inner_tensors(t):
                total += leaf.numel() * leaf.element_size()
    return total


# torch's multi-tensor apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh) as an H100 runs it
# (CUDA 12.1+: 32 KB of kernel arguments): one launch takes blocks of 65,536 elements, at most
# 2,240 of them, from at most so many tensors by the number of tensor lists (1..5)
MTA_CHUNK, MTA_BLOCKS = 65536, 2240
MTA_TENSORS = (770, 448, 336, 252, 210)
MTA_TENSORS_WITH_SCALARS = (672, 448, 336, 252, 210)  # a list of one scalar per tensor too


def multi_tensor_launches(numels: list[int], depth: int, scalars: bool = False) -> int:
    """Kernel launches of one multi-tensor op over tensors of ``numels`` elements in ``depth``
    lists (``scalars``: with a scalar per tensor): a launch whenever its blocks or its tensors
    are full (a tensor counts once all its blocks are in), and one for what is left. Empty
    tensors take no block."""
    most = (MTA_TENSORS_WITH_SCALARS if scalars else MTA_TENSORS)[min(depth, 5) - 1]
    launches = tensors = blocks = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // MTA_CHUNK)
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if blocks == MTA_BLOCKS or (tensors == most and last):
                launches, blocks = launches + 1, 0
                tensors = 0 if last else 1  # a tensor cut short goes on in the next launch
    return launches + (blocks > 0)


def gpu_launches(name: str, args: tuple, tensors: list) -> int:
    """The kernels an op of the optimizer's step launches on a GPU: none when it touches no
    CUDA tensor (host work, e.g. a foreach AdamW's step counts); a multi-tensor op's launches
    (:func:`multi_tensor_launches`: its tensor lists, plus the output list of an out-of-place
    ``_foreach_*``; a ``_fused_*`` optimizer's step counts ride along, not a list of their
    own); one otherwise."""
    if not any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors):
        return 0
    if not name.startswith(("_foreach_", "_fused_")):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a
             and all(isinstance(x, torch.Tensor) for x in a)]
    scalars = any(isinstance(a, (list, tuple)) and a and not isinstance(a[0], torch.Tensor)
                  for a in args)
    depth = len(lists) - 1 if name.startswith("_fused_") else \
        len(lists) + (not name.endswith("_"))
    return multi_tensor_launches([t.numel() for t in lists[0]], depth, scalars)


class OpCensus(TorchDispatchMode):
    """Per place and op: kernels, bytes read + written, GEMM FLOPs. ``optimizer_on_gpu``: the
    optimizer's step runs on (fake) CUDA tensors; its kernels are counted as a GPU launches
    them (:func:`gpu_launches`)."""

    def __init__(self, names: dict[int, str], optimizer_on_gpu: bool = False) -> None:
        super().__init__()
        self.optimizer_on_gpu = optimizer_on_gpu
        self.names = names  # id(module) -> dotted name
        self.stack: list[str] = []
        self.phase = "forward"
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self.flops: dict[str, int] = {}  # set by the FlopCounterMode around it

    def place(self) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if self.stack:
            return ("recompute: " if self.phase == "backward" else "") + self.stack[-1]
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            return f"backward: {type(node).__name__ if node is not None else '?'}"
        return self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in NO_KERNEL:
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        kernels = 1
        if self.optimizer_on_gpu and self.phase == "optimizer":
            kernels = gpu_launches(name, args, flat_in + flat_out)
            if not kernels:
                return out
        moved = _bytes(flat_in) + (0 if name.endswith("_") else _bytes(flat_out))
        row = self.rows[(self.place(), name)]
        flops = gemm_flops(name, *gemm_operands(name, args), flat_out) if name in GEMMS else 0
        row[0] += kernels
        row[1] += moved
        row[2] += flops
        row[3] += call_seconds(name, flops, moved)
        return out

    def in_phase(self, phase: str) -> contextlib.AbstractContextManager:
        return setting(self, "phase", phase)

    def watching_modules(self) -> contextlib.AbstractContextManager:
        def pre(module, args):  # noqa: ANN001, ANN202
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def post(module, args, out):  # noqa: ANN001, ANN202
            if self.stack:
                self.stack.pop()

        return module_hooks(pre, post)


def gemm_operands(name: str, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The two matrices a GEMM contracts: its first two arguments (``mm``, ``bmm``, ``matmul``,
    ``linear``, ``_int_mm``, ``_scaled_mm``, whose scales follow them), or the two after the
    bias (``addmm``, ``baddbmm`` and their in-place forms)."""
    first = 1 if name.rstrip("_") in ("addmm", "baddbmm") else 0
    return args[first], args[first + 1]


def gemm_flops(name: str, a: torch.Tensor, b: torch.Tensor, out) -> int:  # noqa: ANN001
    """2·M·N·K of a matmul from its output and the contraction of its operands."""
    o = next(t for t in out if isinstance(t, torch.Tensor)) if isinstance(out, list) else out
    k = a.shape[-1]
    return 2 * o.numel() * k


def call_seconds(name: str, flops: float, moved: float) -> float:
    """One call's time on paper: the larger of its FLOP time (FP8 tensor cores for
    ``_scaled_mm``) and its byte time."""
    peak = H100["fp8_flops" if name == "_scaled_mm" else "flops"]
    return max(flops / peak, moved / H100["bytes_per_s"])


# the other bytes by kind, first match wins: (kind, words in the place, ops)
KINDS = (
    ("optimizer", ("optimizer",), ()),
    ("dropout", ("dropout", "Dropout"), ("native_dropout", "native_dropout_backward",
                                          "bernoulli", "bernoulli_")),
    ("adapter path", ("lora_", "Lora", "AdapterAdd"), ()),
    ("loss", ("LinearCrossEntropy", "loss", "Loss", "NllLoss", "LogSoftmax"),
     ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
      "logsumexp")),
    ("casts and copies", (), ("_to_copy", "copy_", "clone", "contiguous", "to", "copy",
                              "fp8_quantize_rows")),
    ("NF4 decode", (), ("nf4_dequantize",)),  # the fused operator (its torch ops: the rows above)
    ("norms", ("norm", "Norm", "Rsqrt", "Pow", "Mean"), ("rsqrt", "_fused_rms_norm",
                                                         "rms_norm", "rms_norm_backward")),
    ("activation (SwiGLU)", ("act_fn", "Silu", "Gelu", "foundryx_swiglu"),
     ("silu", "silu_backward", "gelu", "gelu_backward", "swiglu", "swiglu_backward")),
    ("RoPE", ("rotary", "Rotary", "NegBackward", "CatBackward", "foundryx_rope"),
     ("neg", "cat", "rope", "rope_backward")),
)
# a block's own adds are its residual adds; an adapted projection's own multiplies and adds
# are PEFT's scaling and its sum with the base output
BLOCK = re.compile(r"^(recompute: )?layers\.N$")
PROJECTION = re.compile(r"(_proj|Wqkv|out_proj|fc\d?|dense\w*)$")


def kind_of(place: str, op: str) -> str:
    """The kind of a non-GEMM (place, op): see KINDS; "other" for the rest. A backward place
    is the autograd node's name, a forward or recompute place the module's."""
    for kind, words, ops in KINDS:
        if op in ops or any(w in place for w in words):
            return kind
    if op in ("add", "add_") and BLOCK.match(place):
        return "residual adds"
    if op in ("add", "add_", "mul", "mul_") and PROJECTION.search(place):
        return "adapter path"
    return "other"


def normalise(place: str) -> str:
    """A place with block numbers as N and the wrappers' prefixes dropped, so that foundryx's
    and the peer's names meet (``base_model.model.model.layers.3.mlp`` -> ``layers.N.mlp``)."""
    place = re.sub(r"\.\d+(\.|$)", r".N\1", place)
    place = re.sub(r"^(recompute: )?(?:[\w.]*?\.)?(layers\.N)", r"\1\2", place)
    place = re.sub(r"(_checkpoint_wrapped_module\.|_fsdp_wrapped_module\.|_orig_mod\.)", "", place)
    return place.replace(".default", "")


def op_counts(result: dict) -> dict[str, int]:
    """Kernels per operator over every place of a :func:`census` result: one a call, but a
    multi-tensor optimizer op's launches (:func:`gpu_launches`)."""
    ops: dict[str, int] = {}
    for key, (n, _, _) in result["places"].items():
        op = key.split(" | ")[1]
        ops[op] = ops.get(op, 0) + n
    return ops


def census(side: str, shape: Path, batch: int = 2, seq: int = 4096,
           overrides: list[str] | tuple[str, ...] = (), recipe: Path | None = None) -> dict:
    with fake_step.fake_mode(), fake_step.gpu_kernels():
        step = fake_step.build(side, shape, batch, seq, overrides, recipe, gpu_optimizer=True)
        names = {id(m): n for n, m in step.model.named_modules()}
        fake_step.run_step(step, lambda name: contextlib.nullcontext())  # optimizer state
        return measure(side, names, lambda c: fake_step.run_step(step, c.in_phase),
                       optimizer_on_gpu=True)


def measure(side: str, names: dict[int, str], run: Callable[[OpCensus], None],
            optimizer_on_gpu: bool = False) -> dict:
    """The census of what ``run(census)`` dispatches (``names``: module ids to dotted names;
    ``run`` enters the census's phases; ``optimizer_on_gpu``: see :class:`OpCensus`),
    summarised."""
    c = OpCensus(names, optimizer_on_gpu)
    fake_step.ATTENTION_CALLS.clear()
    flops = FlopCounterMode(display=False)
    with c, c.watching_modules(), flops:
        run(c)
    calls = list(fake_step.ATTENTION_CALLS)
    rows = defaultdict(lambda: [0, 0, 0.0, 0.0])
    for (place, op), values in c.rows.items():
        r = rows[(normalise(place), op)]
        for i, v in enumerate(values):
            r[i] += v
    out = summarise(side, rows, [f for _, f in calls])
    out["flop_counter"] = flops.get_total_flops()  # torch's count: no in-place GEMMs (addmm_)
    return out


def summarise(side: str, rows: dict, attention: list[int]) -> dict:
    """``rows``: (place, op) -> [kernels, bytes, FLOPs, seconds on paper, summed per call];
    ``attention``: the FLOPs of each flash-attention call."""
    kernels = sum(r[0] for r in rows.values()) + len(attention)
    other = {(place, op): r for (place, op), r in rows.items() if op not in GEMMS}
    by_kind: dict[str, float] = defaultdict(float)
    for (place, op), r in other.items():
        by_kind[kind_of(place, op)] += r[1]
    optimizer_s = sum(r[3] for (place, _), r in rows.items() if place == "optimizer")
    optimizer_kernels = sum(r[0] for (place, _), r in rows.items() if place == "optimizer")
    compute_s = sum(r[3] for (place, _), r in rows.items() if place != "optimizer")
    compute_s += sum(f / H100["flops"] for f in attention)  # FLOP-bound: q, k, v, o are ~1/6
    gemm = sum(r[2] for (_, op), r in rows.items() if op in GEMMS)
    return {"side": side, "gemm_flops": gemm, "attention_flops": sum(attention),
            "other_bytes": sum(r[1] for r in other.values()), "kernels": kernels,
            "optimizer_kernels": optimizer_kernels,
            "compute_s": compute_s, "optimizer_s": optimizer_s, "paper_s": compute_s + optimizer_s,
            "launch_floor_s": kernels * H100["launch_s"], "other_bytes_by_kind": dict(by_kind),
            "places": {f"{place} | {op}": [n, moved, f] for (place, op), (n, moved, f, _)
                       in rows.items()}}


def differences(side: dict, peer: dict, top: int = 15) -> list[tuple[str, int, int]]:
    """Places where ``side`` moves more bytes than ``peer``: (place | op, extra bytes, extra
    kernels), largest first."""
    out = []
    for key, (n, moved, _) in side["places"].items():
        pn, pmoved, _ = peer["places"].get(key, (0, 0, 0))
        if moved > pmoved or n > pn:
            out.append((key, moved - pmoved, n - pn))
    return sorted(out, key=lambda x: -x[1])[:top]


def report(results: dict[str, dict]) -> str:
    lines = ["| side | GEMM TFLOP | attention TFLOP | other GB moved | kernels | of them the "
             "optimizer's | forward + backward s | optimizer s | on paper s | launch floor s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in results.items():
        lines.append(f"| {s} | {r['gemm_flops'] / 1e12:.1f} | {r['attention_flops'] / 1e12:.1f} | "
                     f"{r['other_bytes'] / 1e9:.1f} | {r['kernels']} | {r['optimizer_kernels']} | "
                     f"{r['compute_s']:.3f} | "
                     f"{r['optimizer_s']:.3f} | {r['paper_s']:.3f} | "
                     f"{r['launch_floor_s']:.3f} |")
    kinds = [k for k, _, _ in KINDS] + ["residual adds", "other"]
    lines += ["", "other GB moved by kind", "| kind | " + " | ".join(results) + " |",
              "|---|" + "---|" * len(results)]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{r['other_bytes_by_kind'].get(k, 0) / 1e9:.1f}"
                                             for r in results.values()) + " |")
    peer = results.get("peer")
    if peer is not None and len(results) > 1:
        lines += ["", "kernels against the peer's (of them the optimizer's)"]
        lines += [f"  {s}: {r['kernels']} / {peer['kernels']} = {r['kernels'] / peer['kernels']:.2f}x "
                  f"({r['optimizer_kernels']} / {peer['optimizer_kernels']})"
                  for s, r in results.items() if s != "peer"]
    for s, r in results.items():
        if peer is None or s == "peer":
            continue
        lines += ["", f"{s}: more than the peer (place | op: extra GB, extra kernels)"]
        lines += [f"  {k}: {b / 1e9:+.2f} GB, {n:+d} kernels" for k, b, n in differences(r, peer)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Path, default=Path("yamls/shapes/llama-3.1-8b"))
    p.add_argument("--sides", default="peer,bf16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    fake_step.add_recipe_overrides(p)
    p.add_argument("--json", type=Path)
    p.add_argument("--mpt", type=Path, metavar="RECIPE",
                   help="census of a pretraining recipe's MPT instead (e.g. yamls/mpt-1b.yaml, "
                        "with --batch 8 --seq 2048 as the H100 run)")
    a = p.parse_args(argv)
    if a.mpt is not None:
        a.shape, a.sides = a.mpt, "mpt"
        if not a.mpt.is_file():
            print(f"op_census: --mpt {a.mpt}: no such recipe", file=sys.stderr)
            return 2
    results = fake_step.each_side("op_census", a.shape if a.mpt is None else None, a.sides,
                                  lambda side: census(side, a.shape, a.batch, a.seq, a.overrides,
                                                      a.recipe))
    if results is None:
        return 2
    print(report(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
