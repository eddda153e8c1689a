"""Per-row e4m3 quantization as its definition, in float64, written without foundryx's code:
the yardstick of tests/test_fp8_definition.py and tests/test_fp8_rows.py.

Per row of ``x' = x * col_scale`` (float32, one rounding) or ``x``: ``scale = max(max |x'| /
fmax, min_scale)`` rounded to float32, ``q = x' / scale`` rounded to float32, clamped to
``+-fmax`` and rounded to the nearest e4m3 value, ties to the even code. Each float32 rounding
is a float64 operation rounded to float32: float64 holds more than 2 * 24 + 2 bits, so the
double rounding of a product or a quotient equals float32's one (Figueroa, 1995).

The e4m3 values are built from their bit fields: code ``c`` (7 bits, the sign apart) is
exponent ``c >> 3`` and mantissa ``c & 7``; e4m3fn (bias 7) has its NaN at 127, so its largest
value is 1.75 * 2^8 = 448; e4m3fnuz (bias 8) has no negative zero and reaches 1.875 * 2^7 =
240. Consecutive codes alternate their mantissa's last bit, so "even code" is "even mantissa".
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
FNUZ = getattr(torch, "float8_e4m3fnuz", None)


def magnitudes(dtype: torch.dtype) -> torch.Tensor:
    """The finite non-negative values of ``dtype``, indexed by their code (float64)."""
    bias, codes = (7, 127) if dtype == E4M3 else (8, 128)
    out = []
    for c in range(codes):
        e, m = c >> 3, c & 7
        out.append(m * 2.0 ** (1 - bias - 3) if e == 0 else (1 + m / 8) * 2.0 ** (e - bias))
    return torch.tensor(out, dtype=torch.float64)


def fmax(dtype: torch.dtype) -> float:
    return float(magnitudes(dtype)[-1])


def f32(t: torch.Tensor) -> torch.Tensor:
    """A float64 result rounded to float32 (and held in float64 again)."""
    return t.to(torch.float32).to(torch.float64)


def round_codes(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of float64 values (each within +-fmax, no NaN) rounded to ``dtype``."""
    grid = magnitudes(dtype)
    mag = v.abs().flatten()
    hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    code = torch.where(d_lo < d_hi, lo, hi)
    code = torch.where(d_lo == d_hi, torch.where(lo % 2 == 0, lo, hi), code)  # ties: even code
    negative = torch.signbit(v.flatten())
    if dtype != E4M3:
        negative &= code != 0  # e4m3fnuz has no -0 (0x80 is its NaN)
    return (code | (negative.long() << 7)).to(torch.uint8).view(v.shape)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None,
                  min_scale: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a 2-D ``x`` by the definition above: ``q`` in ``dtype``, ``scale``
    float32, on ``x``'s device."""
    top = fmax(dtype)
    work = x.detach().cpu().to(torch.float64)
    if col_scale is not None:
        work = f32(work * col_scale.detach().cpu().to(torch.float64))
    amax = work.abs().amax(dim=1)
    scale = torch.maximum(f32(amax / top), f32(torch.tensor(min_scale, dtype=torch.float64)))
    q = f32(work / scale[:, None]).clamp(-top, top)
    codes = round_codes(q, dtype)
    return codes.view(dtype).to(x.device), scale.to(torch.float32).to(x.device)


def sample_rows(k: int = 96, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes 1e-6 to 1e4, a zero row, and a row whose e4m3fn scale is exactly 1
    (its largest value is fmax) holding ties between e4m3 steps (136 between 128 and 144, 19
    between 18 and 20), the smallest subnormal, a subnormal tie, values that round to +0 and
    to -0, and -0 itself."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(12, k, generator=gen) * torch.logspace(-6, 4, 12)[:, None]
    x[2] = 0
    edge = [448.0, 136.0, -136.0, 19.0, 2.0**-9, -3 * 2.0**-10, 2.0**-11, -1e-30, -0.0]
    x[5, :len(edge)] = torch.tensor(edge)
    x[5, len(edge):] = torch.rand(k - len(edge), generator=gen) * 100
    return x
