"""The GEMMs of a frozen FP8 base on FP8 tensor cores (``frozen_base: {dtype: fp8}``).

A frozen FP8 weight is ``W[n, k] ~= Wq[n, k] * s_w[n]`` (e4m3 rows, a float32 scale per output
row: :class:`~foundryx.models.peft.rowwise.RowScaledTensor`). Where the GPU has FP8 tensor
cores (:func:`foundryx.runtime.devices.fp8_gemm_dtype`, the one rule: NVIDIA compute capability 8.9+,
AMD gfx942 / gfx950), the layer's two GEMMs run in FP8 with row-wise scaled
``torch._scaled_mm`` instead of casting ``W`` to bf16 per layer; LoRA's adapters are not
touched (they stay in the run's precision). Elsewhere (A100, MI250, a CPU) the cast path runs
as before; :func:`choose` says which, in one log line.

**Forward**, ``y = x W^T``: ``x`` ([M, K], tokens by features) is quantized per row to e4m3,
``x[m, k] ~= xq[m, k] * s_x[m]`` with ``s_x[m] = max_k |x[m, k]| / fmax`` (448; e4m3fnuz's 240
on gfx942), so ``y[m, n] = s_x[m] * s_w[n] * sum_k xq[m, k] Wq[n, k]``:
``_scaled_mm(xq, Wq^T, scale_a=s_x[:, None], scale_b=s_w[None, :])``; ``Wq^T`` is a view
(the column-major operand ``_scaled_mm`` wants), so nothing of ``W`` is copied.

**Input gradient**, ``dx = dy W``: ``dx[m, k] = sum_n dy[m, n] * s_w[n] * Wq[n, k]``. Here
``W``'s scales lie along the *contraction* axis ``n``, which a row-wise scaled GEMM cannot
apply (its scales are per row of the first operand and per column of the second). So they
are folded into ``dy`` before it is quantized: ``g[m, n] = dy[m, n] * s_w[n]`` (float32, one
rounding), ``g`` quantized per row, ``g ~= gq * s_g[:, None]``, and
``dx = s_g[m] * sum_n gq[m, n] Wq[n, k]``: ``_scaled_mm(gq, Wq, scale_a=s_g[:, None],
scale_b=1)`` with ``Wq`` as a column-major operand, i.e. a transposed copy of the FP8 bytes
(1 byte per weight, dropped after use: half of the bf16 copy the cast path makes).

**Quantization** of ``x`` and of ``dy * s_w``, per row, is one Triton kernel on a GPU
(:mod:`foundryx.kernels.fp8_rows`, as the operator ``torch.ops.foundryx.fp8_quantize_rows``:
``x`` read twice, ``q`` written once, where the five torch ops it replaces move about five
times the bytes through a float32 copy); elsewhere those torch ops. The kernel gives their
bits exactly, checked once per GPU on a small sample (:func:`kernel_check`: a kernel that fails
or differs leaves the torch ops); ``frozen_base.fp8_rows`` chooses, :func:`choose`'s line says
which.

**Numerics.** Relative to the cast path (``W`` dequantized exactly, then bf16 GEMMs) the only
new rounding is of the activations (forward) and of ``dy * s_w`` (backward) to e4m3: 3
mantissa bits, a relative error of at most 2^-4 per element, saturating at ``fmax`` (never
inf or NaN: every row is scaled to its own maximum, and an all-zero row gets the smallest
scale and stays zero). The products accumulate in float32 on the tensor cores (the forward
with cuBLAS's fast accumulation, as torchao's float8 training does; the gradient without) and
are returned in bf16, then cast to the run's dtype. The emulation below computes the same
thing in float32 on any device. The CPU tests force the whole FP8 path
(``frozen_base.fp8_gemm: tensor_cores``: torch 2.15's CPU ``_scaled_mm``, torch 2.7's lacks one,
the emulation) against the cast path,
and check the GPU call's operands against torch's own ``_scaled_mm`` checks on fake CUDA
tensors.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from foundryx.kernels.fp8_rows_op import quantize_rows_eager, triton_missing
from foundryx.models.peft.rowwise import MIN_SCALE
from foundryx.runtime.device_choice import pick_device
from foundryx.runtime.devices import device_fp8_gemm

log = logging.getLogger(__name__)

ALIGN = 16  # _scaled_mm wants K and N multiples of 16


def supports(in_features: int, out_features: int) -> bool:
    """Whether a layer of this shape can run its GEMMs through ``_scaled_mm`` (both
    dimensions multiples of 16: the contraction of the forward is one, of the gradient the
    other)."""
    return in_features % ALIGN == 0 and out_features % ALIGN == 0


def choose(device: torch.device | None, layers: list[Any], tp: int = 1, gemm: str = "auto",
           rows: str = "auto") -> torch.dtype | None:
    """The float8 dtype the FP8 frozen ``layers`` (``LowPrecisionLinear`` with ``storage``
    fp8) multiply in on ``device`` (the run's; None: the current GPU when there is one), or
    None for the cast path; sets each layer's ``fp8_gemm`` and says in one line which path
    runs, and why. ``gemm`` and ``rows`` are ``frozen_base.fp8_gemm`` and ``fp8_rows``
    (``FrozenBaseOptions``): ``gemm`` "auto" (FP8 tensor cores where the device has them),
    "tensor_cores" (on any device: a CPU through torch's CPU ``_scaled_mm`` where it has one,
    else emulated in float32) or "cast"; ``rows``: :func:`quantizer`."""
    fp8 = [m for m in layers if m.storage == "fp8"]
    if not fp8:
        return None
    device = torch.device(device) if device is not None else pick_device()
    fits = [m for m in fp8 if supports(m.in_features, m.out_features)]
    dtype, why_not, where = None, None, device.type
    if gemm == "cast":
        why_not = "frozen_base.fp8_gemm: cast"
    elif gemm == "tensor_cores":
        dtype, where = torch.float8_e4m3fn, f"{device.type}, frozen_base.fp8_gemm: tensor_cores"
    elif tp > 1:
        why_not = f"tensor parallelism (tp {tp}) has no FP8 GEMM path yet"
    else:
        name, where = device_fp8_gemm(device)
        if name is None:
            why_not = (f"{where} has no FP8 tensor cores (NVIDIA compute capability 8.9+ or "
                       "AMD gfx942/gfx950 needed)")
        else:
            dtype = getattr(torch, name)
            why_not = probe(device, dtype)
            if why_not is not None:
                dtype = None
    if dtype is None or not fits:
        why_not = why_not or f"no layer has both dimensions multiples of {ALIGN}"
        log.info("frozen_base: fp8 weights cast to the compute dtype per layer (forward and "
                 "backward): %s", why_not)
        dtype = None
    use_op = False
    if dtype is not None:
        use_op, how = quantizer(device, dtype, rows)
        log.info("frozen_base: fp8 GEMMs on FP8 tensor cores (%s): row-wise scaled "
                 "torch._scaled_mm in %s, forward and input gradient, %d of %d layers%s; %s",
                 where, str(dtype).removeprefix("torch."), len(fits), len(fp8),
                 "" if len(fits) == len(fp8) else
                 f" (the others are not multiples of {ALIGN}: cast per layer)", how)
    for m in fp8:
        m.fp8_gemm = dtype if m in fits else None
        m.fp8_quantize_op = use_op
    return dtype


def probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a small row-wise scaled ``_scaled_mm`` in ``dtype`` runs on ``device``; else
    why not (an older torch or ROCm without row-wise scaling)."""
    try:
        a = torch.ones(ALIGN, 2 * ALIGN, device=device).to(dtype)
        b = torch.ones(ALIGN, 2 * ALIGN, device=device).to(dtype)
        scaled_mm(a, b.t(), torch.ones(ALIGN, 1, device=device),
                  torch.ones(1, ALIGN, device=device))
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__} cannot run a row-wise scaled _scaled_mm here ({e})"
    return None


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              fast_accum: bool = False) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b`` in bf16: ``a`` [M, K] row-major and ``b`` [K, N]
    column-major float8, ``scale_a`` [M, 1], ``scale_b`` [1, N] float32: torch's row-wise
    scaled ``_scaled_mm`` on a GPU, and on a CPU where this torch has it (2.15 does, 2.7 does
    not); elsewhere (only reached with ``fp8_gemm: tensor_cores``) :func:`emulated_scaled_mm`."""
    if a.device.type == "cuda" or _scaled_mm_runs_on(a.device.type):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return emulated_scaled_mm(a, b, scale_a, scale_b)


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor) -> torch.Tensor:
    """:func:`scaled_mm` in float32 on any device: the float8 values are exact in float32,
    their products too; the sums accumulate in float32, are scaled, and rounded to bf16 once
    (torch 2.15's CPU ``_scaled_mm`` gives the same to one bf16 step)."""
    out = a.to(torch.float32) @ b.to(torch.float32)
    return out.mul_(scale_a).mul_(scale_b).to(torch.bfloat16)


@functools.cache
def _scaled_mm_runs_on(kind: str) -> bool:
    """Whether this torch runs a row-wise scaled ``_scaled_mm`` on device type ``kind``
    (CUDA aside), found once by trying a small one."""
    if kind == "meta":
        return False
    try:
        a = torch.zeros(ALIGN, ALIGN, device=kind).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(ALIGN, 1, device=kind),
                         scale_b=torch.ones(1, ALIGN, device=kind), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantizer(device: torch.device, dtype: torch.dtype, rows: str = "auto") -> tuple[bool, str]:
    """Whether :func:`quantize` runs the operator (one Triton kernel on a GPU) on ``device``,
    and that in words (for :func:`choose`'s line). ``rows`` (``frozen_base.fp8_rows``): "auto":
    on a GPU the Triton kernel (one pass), checked once against the torch ops, elsewhere the
    torch ops; "torch": torch ops everywhere (the run book's A/B); "kernel": the operator on
    any device, unchecked (the op census, on fake CPU tensors, counts the GPU's one kernel)."""
    if rows == "torch":
        return False, "rows quantized by torch ops (frozen_base.fp8_rows: torch)"
    if rows == "kernel" and device.type != "cuda":
        return True, (f"rows quantized by torch.ops.foundryx.fp8_quantize_rows "
                      f"(frozen_base.fp8_rows: kernel; its torch ops on a {device.type})")
    if rows == "kernel":
        return True, ("rows quantized in one pass by foundryx's Triton kernel "
                      "(frozen_base.fp8_rows: kernel, unchecked)")
    if device.type != "cuda":
        return False, f"rows quantized by torch ops (no Triton kernel on a {device.type})"
    why = triton_missing() or kernel_check(str(device), dtype)
    if why is not None:
        return False, f"rows quantized by torch ops ({why})"
    return True, "rows quantized in one pass by foundryx's Triton kernel"


@functools.cache
def kernel_check(device: str, dtype: torch.dtype) -> str | None:
    """None when the Triton kernel gives the torch ops' bits for a small sample on ``device``
    (rows of several magnitudes, one with column scales); else what went wrong, once."""
    gen = torch.Generator().manual_seed(0)  # made on the CPU, whatever the default device
    x = torch.randn(8, 4112, generator=gen, device="cpu")
    x.mul_(torch.logspace(-4, 3, 8, device="cpu")[:, None])
    col = torch.rand(4112, generator=gen, device="cpu").add_(0.5)
    try:
        x, col = x.to(device, torch.bfloat16), col.to(device)
        for c in (None, col):
            got = torch.ops.foundryx.fp8_quantize_rows(x, c, dtype, MIN_SCALE)
            want = quantize_rows_eager(x, dtype, c, MIN_SCALE)
            if not (torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                    and torch.equal(got[1], want[1])):
                return f"the Triton kernel's bits differ from the torch ops' on {device}"
    except Exception as e:  # noqa: BLE001  (a compiler or launch error is the answer)
        text = str(e).strip().splitlines()
        return f"the Triton kernel failed on {device}: {type(e).__name__}: " \
               f"{text[0][:200] if text else ''}"
    return None


def quantize(x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None,
             op: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``x * col_scale`` (or ``x``) quantized per row
    (:func:`~foundryx.kernels.fp8_rows_op.quantize_rows_eager` says how): by
    ``torch.ops.foundryx.fp8_quantize_rows`` where ``op`` (one Triton kernel on a GPU), else by
    torch ops; the same bits."""
    if op:
        return torch.ops.foundryx.fp8_quantize_rows(x, col_scale, dtype, MIN_SCALE)
    return quantize_rows_eager(x, dtype, col_scale, MIN_SCALE)


def weight_operand(qdata: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored e4m3fn weight (``qdata`` [N, K], ``scale`` [N]) as ``dtype``'s rows and
    scales. e4m3fnuz (gfx942) reads the same bits as half the e4m3fn value (its exponent bias
    is 8, not 7, and both have subnormals down to their smallest step), so the bytes are kept
    and the scales doubled; only e4m3fn's negative zero (0x80, e4m3fnuz's NaN) becomes zero."""
    if qdata.dtype == dtype:
        return qdata, scale
    if dtype != getattr(torch, "float8_e4m3fnuz", None) or qdata.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8 GEMM: a {qdata.dtype} weight cannot be read as {dtype}")
    bits = qdata.view(torch.uint8)
    bits = bits.masked_fill(bits == 0x80, 0)
    return bits.view(dtype), scale * 2


def linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
           out_dtype: torch.dtype, op: bool = False) -> torch.Tensor:
    """``x @ W^T`` (no bias) for ``x`` [..., K] and the stored FP8 weight, in ``out_dtype``
    (``op``: :func:`quantize`'s)."""
    wq, sw = weight_operand(qdata, scale, dtype)
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize(x2, dtype, op=op)
    y = scaled_mm(xq, wq.t(), sx.unsqueeze(1), sw.unsqueeze(0), fast_accum=True)
    return y.to(out_dtype).view(*x.shape[:-1], wq.shape[0])


def input_grad(grad: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype, out_dtype: torch.dtype, op: bool = False) -> torch.Tensor:
    """``dy @ W`` for ``dy`` [..., N] and the stored FP8 weight, in ``out_dtype``: ``W``'s row
    scales folded into ``dy``'s columns before ``dy`` is quantized per row (module doc)."""
    wq, sw = weight_operand(qdata, scale, dtype)
    gq, sg = quantize(grad.reshape(-1, grad.shape[-1]), dtype, col_scale=sw, op=op)
    # [N, K] column-major: the FP8 bytes transposed (copied as bytes)
    w_cols = torch.clone(wq.view(torch.uint8).t(), memory_format=torch.contiguous_format)
    w_cols = w_cols.view(wq.dtype).t()
    ones = torch.ones(1, wq.shape[1], device=grad.device)
    dx = scaled_mm(gq, w_cols, sg.unsqueeze(1), ones)
    return dx.to(out_dtype).view(*grad.shape[:-1], wq.shape[1])
