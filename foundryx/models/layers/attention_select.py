"""Which attention implementation can run a call, and ``attn_impl: auto``.

``auto`` chooses, per call, the implementation that was fastest where it was measured: the
table of :mod:`foundryx.models.layers.attention_table`, one row per (device kind, head dim,
mask: one document / packed documents / ALiBi, causal, GQA) with TFLOP/s per implementation.
The rules, in order, for one call:

1. tensors not on a GPU -> ``torch`` (flash-attn and the Triton kernel need CUDA or ROCm;
   FlexAttention on a CPU computes dense scores too);
2. the table has no row for this device kind (``torch.cuda.get_device_name()``) -> ``torch``
   (SDPA), measuring nothing, in a line that says so;
3. the device has rows, but none for this mask and causality -> ``torch``, said the same way;
4. otherwise the nearest row (the same GQA-ness first, then the nearest head dim; an
   approximation is named in the line): its implementations from fastest to slowest
   (forward + backward when a gradient is wanted, else forward), the first that can run this
   call (flash-attn installed, the Triton kernel supporting it, FlexAttention without dropout).

``torch`` can run every call but one: a masked call (packed documents, ALiBi, padding, a
window) whose dense mask, which SDPA needs, would pass :data:`DENSE_MASK_LIMIT` (4 GiB: one
row of packed documents past about 21K tokens; at 512K it is terabytes). There rules 2-4 skip it, and where no measured
implementation runs, the first of :data:`UNMEASURED` that runs is chosen: flash-attn's varlen
kernel (no mask at all: each document its own sequence), else ``flex`` (a block mask built from
the documents, compiled on the GPU), else the Triton kernel.

``auto`` logs one line per distinct choice, with the reason and the figures. Asking for
``flash`` or ``triton`` where it cannot run raises :class:`AttentionError` saying what to
install or choose.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from foundryx import registry
from foundryx.errors import FoundryxError
from foundryx.models.layers import attention_table

log = logging.getLogger(__name__)

FLASH_MIN_VERSION = (2, 6)
INSTALL_FLASH = "pip install 'foundryx[gpu]'"
CHOOSE = "set model.attn_config.attn_impl to {others} or auto (which picks one that runs here)"


class AttentionError(FoundryxError):
    """An attention implementation was asked for where it cannot run."""


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in the autocast dtype when autocast is on (as SDPA gets them), else unchanged."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


@functools.cache
def flash_attn_module() -> tuple[ModuleType | None, str | None]:
    """The flash_attn package, or None and why it cannot be used."""
    try:
        module = importlib.import_module("flash_attn")
    except ModuleNotFoundError as e:
        if e.name != "flash_attn":
            return None, f"flash-attn does not import: {e}"
        return None, "flash-attn is not installed"
    except (ImportError, OSError, RuntimeError) as e:  # a build for another torch or CUDA
        return None, f"flash-attn does not import: {e}"
    version = getattr(module, "__version__", "0")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < FLASH_MIN_VERSION:
        return None, f"flash-attn {version} is too old; foundryx needs >= 2.6"
    return module, None


def flash_problem(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the flash-attn package cannot run this call, or None."""
    _, problem = flash_attn_module()
    if problem:
        return problem
    if q.device.type != "cuda":
        return f"flash-attn needs a CUDA or ROCm GPU; the tensors are on {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        return f"flash-attn takes fp16 or bf16; got {q.dtype} (train with precision amp_bf16)"
    if q.shape[-1] > 256:
        return f"flash-attn supports head_dim <= 256, got {q.shape[-1]}"
    if torch.version.hip is None and torch.cuda.get_device_capability(q.device)[0] < 8:
        return "flash-attn 2 needs an sm80 (Ampere) or newer NVIDIA GPU"
    if q.shape[1] != k.shape[1]:
        return f"query length {q.shape[1]} differs from key length {k.shape[1]}"
    return None


def triton_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> str | None:
    """Why the Triton kernel cannot run this call, or None."""
    try:  # lazy: imports Triton, an optional heavy dependency (absent on macOS, say)
        from foundryx.kernels.flash_attention import unsupported
    except ImportError as e:
        return f"Triton does not import ({e}); it comes with torch's CUDA and ROCm wheels"
    return unsupported(q, k, v, dropout_p)


def flex_problem(dropout_p: float = 0.0) -> str | None:
    """Why FlexAttention cannot run a call, or None."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401  (torch >= 2.5)
    except ImportError:
        return f"this torch ({torch.__version__}) has no FlexAttention; it needs torch >= 2.5"
    if dropout_p:
        return f"attention dropout (attn_pdrop {dropout_p}) is not implemented by FlexAttention"
    return None


DENSE_MASK_LIMIT = 4 << 30  # bytes of dense mask past which auto does not pick SDPA
UNMEASURED = ("flash", "flex", "triton")  # SDPA cannot hold the mask, nothing measured runs


def dense_mask_problem(q: Any, k: Any, *, sequence_id: Any = None, alibi_slopes: Any = None,
                       key_padding_mask: Any = None, sliding_window: Any = None,
                       **_: Any) -> str | None:
    """Why ``torch`` (SDPA with a dense mask or bias) should not run this call: the mask it
    builds (the ``seq x seq`` distances in int64, a boolean keep mask per row, an ALiBi bias
    per head in q's dtype) would pass :data:`DENSE_MASK_LIMIT`; None when it is smaller, or
    when the call has no mask (SDPA's fused kernels)."""
    if all(x is None for x in (sequence_id, alibi_slopes, key_padding_mask, sliding_window)):
        return None
    batch, seq, heads = (int(n) for n in q.shape[:3])
    per_row = batch if sequence_id is not None or key_padding_mask is not None else 1
    size = seq * seq * (8 + per_row)
    if alibi_slopes is not None:
        itemsize = torch.empty((), dtype=getattr(q, "dtype", torch.float32)).element_size()
        size += per_row * heads * seq * seq * itemsize
    if size <= DENSE_MASK_LIMIT:
        return None
    return (f"SDPA's dense mask would take {size / 2**30:,.0f} GiB at {seq} tokens (auto "
            f"leaves SDPA past {DENSE_MASK_LIMIT / 2**30:.0f} GiB)")


def unmeasured_choice(runs: Callable[[str], str | None], why: str) -> tuple[str, str]:
    """(implementation, reason) where SDPA cannot hold the mask (``why``) and no measured
    implementation runs: the first of :data:`UNMEASURED` that can."""
    skipped = []
    for name in UNMEASURED:
        problem = runs(name)
        if problem is None:
            reason = (f"{why}; {name}, the first of flash-attn's varlen kernel, flex and "
                      "triton that runs this call (not measured on this device)")
            return name, reason + (f"; {'; '.join(skipped)}" if skipped else "")
        skipped.append(f"{name} cannot run: {problem}")
    return "torch", f"{why}, but nothing else runs: {'; '.join(skipped)}; SDPA"


def require(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> None:
    """Raise :class:`AttentionError` if ``impl`` ('flash' or 'triton') cannot run this call."""
    if impl == "flash":
        problem = flash_problem(q, k)
        if problem and flash_attn_module()[0] is None:
            fix = f"install it with `{INSTALL_FLASH}` (a CUDA or ROCm build), or " + CHOOSE
        else:
            fix = CHOOSE
        others = "triton, torch"
    else:
        problem = triton_problem(q, k, v, dropout_p)
        fix, others = CHOOSE, "flash, torch"
    if q.device.type != "cuda":
        others = "torch"
    if problem:
        raise AttentionError(
            f"attn_impl {impl!r} cannot run here: {problem}. Fix: {fix.format(others=others)}."
        )


@dataclass(frozen=True)
class Case:
    """What the table is keyed by, for one call."""

    head_dim: int
    mask: str  # none, docs, alibi, docs+alibi, or with padding / window (never measured)
    causal: bool
    gqa: bool
    train: bool  # a gradient is wanted: rank by forward + backward, else by forward

    def words(self) -> str:
        docs = "packed documents" if "docs" in self.mask else "one document"
        extra = [m for m in self.mask.split("+") if m not in ("none", "docs")]
        return (f"head dim {self.head_dim}, {docs}{''.join(f' + {m}' for m in extra)}, "
                f"{'causal' if self.causal else 'non-causal'}, {'GQA' if self.gqa else 'MHA'}")


def case_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
            sequence_id: Any = None, alibi_slopes: Any = None, key_padding_mask: Any = None,
            sliding_window: Any = None, **_: Any) -> Case:
    """The table's key for a call with ``torch_attention``'s arguments."""
    parts = [name for name, given in (("docs", sequence_id), ("alibi", alibi_slopes),
                                      ("padding", key_padding_mask), ("window", sliding_window))
             if given is not None]
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    return Case(head_dim=int(q.shape[-1]), mask="+".join(parts) or "none", causal=bool(causal),
                gqa=int(q.shape[2]) != int(k.shape[2]), train=grad)


@functools.cache
def device_kind(device: torch.device) -> tuple[str, str]:
    """(name, architecture) of a CUDA/ROCm device: ``("NVIDIA H100 80GB HBM3", "sm90")``."""
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else ""
    return torch.cuda.get_device_name(device), arch or f"sm{props.major}{props.minor}"


def table_choice(case: Case, device: str, rows: list[dict[str, Any]],
                 runs: Callable[[str], str | None]) -> tuple[str, str]:
    """(implementation, reason) for ``case`` on ``device`` from the table's ``rows``:
    the fastest measured implementation that ``runs(name)`` (None: it can run this call, else
    why not) allows. No row for the device or for the case: ``torch``, said so, or where SDPA
    cannot hold the mask (``runs("torch")``), the first of :data:`UNMEASURED` that runs."""
    mine = [r for r in rows if r["device"].lower() == device.lower()]
    dense = runs("torch")
    if dense and not [r for r in mine if r["mask"] == case.mask and r["causal"] == case.causal]:
        return unmeasured_choice(runs, dense)
    if not mine:
        return "torch", (f"the attention table (foundryx/models/layers/attention_table.py) has no "
                         f"row for this device ({device}); SDPA, without measuring (python -m "
                         f"benchmarks.attention --table measures rows for it)")
    same = [r for r in mine if r["mask"] == case.mask and r["causal"] == case.causal]
    if not same:
        return "torch", (f"the attention table has rows for {device} but none for {case.words()}; "
                         f"SDPA, without measuring")
    row = min(same, key=lambda r: (r["gqa"] != case.gqa, abs(r["head_dim"] - case.head_dim),
                                   -r["head_dim"]))
    near = []
    if row["head_dim"] != case.head_dim:
        near.append(f"head dim {row['head_dim']}")
    if row["gqa"] != case.gqa:
        near.append("GQA" if row["gqa"] else "MHA")
    key = "train" if case.train else "fwd"
    figures = row.get(key) or row.get("train") or row.get("fwd")
    ranked = sorted(figures.items(), key=lambda kv: -kv[1])
    skipped = []
    for name, tflops in ranked:
        problem = runs(name)
        if problem is None:
            others = ", ".join(f"{n} {t:.0f}" for n, t in ranked if n != name)
            what = "fwd+bwd" if figures is row.get("train") else "fwd"
            reason = (f"fastest measured on {device} for {case.words()}: {name} {tflops:.0f} "
                      f"TFLOP/s {what}" + (f" against {others}" if others else ""))
            if near:
                reason += f" (nearest row: {' and '.join(near)}, measured at seq {row['seq']})"
            if skipped:
                reason += f"; {'; '.join(skipped)}"
            return name, reason + f" [{row['source']}]"
        skipped.append(f"{name} ({tflops:.0f}) cannot run: {problem}")
    if dense:
        return unmeasured_choice(runs, f"no measured implementation can run: "
                                       f"{'; '.join(skipped)}")
    return "torch", f"no measured implementation can run: {'; '.join(skipped)}; SDPA"


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
           rows: list[dict[str, Any]] | None = None, **features: Any) -> tuple[str, str]:
    """(implementation name, reason) for one call, by the rules in the module docstring;
    ``features``: the call's ``causal``, ``sequence_id``, ... (``torch_attention``'s)."""
    if q.device.type != "cuda":
        return "torch", (
            f"the tensors are on {q.device.type}; flash-attn and the Triton kernel need a "
            f"CUDA or ROCm GPU"
        )

    dense = dense_mask_problem(q, k, **features)

    def runs(name: str) -> str | None:
        if name == "torch":
            return dense
        if name == "flex":
            return flex_problem(dropout_p)
        if name == "flash":
            return flash_problem(q, k)
        if name == "triton":
            return triton_problem(q, k, v, dropout_p)
        return f"{name!r} is not an implementation auto knows"

    name = device_kind(q.device)[0]
    table = attention_table.ROWS if rows is None else rows
    return table_choice(case_of(q, k, v, **features), name, table, runs)


_impls: dict[str, Callable] = {}
_logged: set[tuple[str, str]] = set()


def auto_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0, **kwargs
):
    """``attn_impl: auto``: run the implementation :func:`choose` picks for this call."""
    q, k, v = autocast_inputs(q, k, v)
    name, reason = choose(q, k, v, dropout_p, **kwargs)
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        log.info("attention: auto chose %r: %s", name, reason)
    if name not in _impls:
        _impls[name] = registry.attention_implementations.get(name)
    return _impls[name](q, k, v, dropout_p=dropout_p, **kwargs)
