"""Which attention implementation can run a call, and ``attn_impl: auto``.

The rules, in order, for one call (device, dtype, head dim, features):

1. tensors not on a GPU -> ``torch`` (flash-attn and the Triton kernel need CUDA or ROCm);
2. flash-attn 2 installed and supports the call -> ``flash``;
3. the Triton kernel supports the call -> ``triton``;
4. otherwise -> ``torch``.

``auto`` logs one line per distinct choice, with the reason. Asking for ``flash`` or
``triton`` where it cannot run raises :class:`AttentionError` saying what to install or choose.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from foundryx import registry
from foundryx.errors import FoundryxError

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


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0):
    """(implementation name, reason) for one call, by the rules in the module docstring."""
    if q.device.type != "cuda":
        return "torch", (
            f"the tensors are on {q.device.type}; flash-attn and the Triton kernel need a "
            f"CUDA or ROCm GPU"
        )
    flash = flash_problem(q, k)
    if flash is None:
        version = flash_attn_module()[0].__version__
        return "flash", f"flash-attn {version} is installed and supports this call"
    triton = triton_problem(q, k, v, dropout_p)
    if triton is None:
        return "triton", f"flash: {flash}; the Triton kernel supports this call"
    return "torch", f"flash: {flash}; triton: {triton}"


_impls: dict[str, Callable] = {}
_logged: set[tuple[str, str]] = set()


def auto_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0, **kwargs
):
    """``attn_impl: auto``: run the implementation :func:`choose` picks for this call."""
    q, k, v = autocast_inputs(q, k, v)
    name, reason = choose(q, k, v, dropout_p)
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        log.info("attention: auto chose %r: %s", name, reason)
    if name not in _impls:
        _impls[name] = registry.attention_implementations.get(name)
    return _impls[name](q, k, v, dropout_p=dropout_p, **kwargs)
