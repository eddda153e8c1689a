"""Attention speed on a GPU: the Triton kernel, flash-attn (when installed), FlexAttention
(compiled) and SDPA.

    python -m benchmarks.attention --out benchmarks/RESULTS.md        # kernels + MPT-1B step
    python -m benchmarks.attention --seqs 2048 --no-mpt              # a quick look
    python -m benchmarks.attention --tune                            # rows for kernels/tuning.py
    python -m benchmarks.attention --seqs 4096 --head-dims 128 --no-mpt --bwd split atomic
                                                      # the Triton backward's two modes, side by side
    python -m benchmarks.attention --table rows.json                 # attn_impl auto's table rows
    python -m benchmarks.attention --apply-table rows.json           # ... into the table (no GPU)

Kernel table: forward and forward+backward TFLOP/s, bf16, batch x seq = 16k tokens,
heads = 2048 / head_dim, for dense and packed sequences (documents of 1/16 to 1/4 of the
sequence), causal and not. Each cell first checks the output against SDPA. FLOPs count only
the attended pairs (4 * d per pair forward, 2.5x that backward), so packed rows show the
work a kernel skips. The MPT-1B rows time whole training steps (bf16 autocast, AdamW).
Needs only torch and Triton (flash-attn optional).

``--table FILE`` measures the cases of ``attn_impl: auto``'s table
(foundryx/models/layers/attention_table.py) on this GPU: each head dim (default 64 and 128),
mask (one document, packed documents, ALiBi, both), causal, MHA and GQA (kv heads = heads / 4),
at seq 2048 (the recipes'), and writes them as JSON rows; ``--apply-table FILE`` replaces the
rows of the devices in FILE in the table's module (anywhere: no GPU needed).

``--bwd split atomic`` times the Triton kernel once per backward (columns ``triton-split``:
the dK/dV and dQ kernels; ``triton-atomic``: FlashAttention-2's one kernel, dQ added
atomically), whatever ``kernels/tuning.py``'s ``BWD`` row chooses; the faster one per device
and head dim goes into that row. ``--tune`` times the atomic kernel's tiles in its own mode.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch

from foundryx.kernels import tuning
from foundryx.models.layers.attention import torch_attention
from foundryx.models.layers.attention_flash import flash_attention
from foundryx.models.layers.attention_flex import flex_attention
from foundryx.models.layers.attention_select import flash_attn_module
from foundryx.models.layers.attention_triton import triton_attention

ROOT = Path(__file__).resolve().parents[1]

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional on a bare GPU image

    def tqdm(items, **_):
        return items


IMPLS = {"triton": triton_attention, "flash": flash_attention, "flex": flex_attention,
         "torch": torch_attention}


def triton_with_bwd(mode: str):
    """triton_attention with the backward ``mode`` (split or atomic), whatever the tuning
    table says (the mode is chosen in the forward, so it holds for the backward too)."""

    def attention(q, k, v, **kw):
        with tuning.forced(bwd=mode):
            return triton_attention(q, k, v, **kw)

    return attention


for _mode in tuning.BWD_MODES:  # --bwd's columns
    IMPLS[f"triton-{_mode}"] = triton_with_bwd(_mode)
TOKENS = 16384
D_MODEL = 2048
MPT_SEQ = 2048


def gpu_info() -> str:
    """GPU name, driver and library versions, for the results header."""
    name = torch.cuda.get_device_name()
    if torch.version.hip:
        driver = f"ROCm {torch.version.hip}"
    else:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            )
            driver = f"driver {out.stdout.split()[0]}, CUDA {torch.version.cuda}"
        except (OSError, subprocess.CalledProcessError, IndexError):
            driver = f"CUDA {torch.version.cuda}"
    import triton

    fa = flash_attn_module()[0]
    flash = f"flash-attn {fa.__version__}" if fa else "flash-attn not installed"
    return f"{name}, {driver}; torch {torch.__version__}, triton {triton.__version__}, {flash}"


def doc_ids(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """sequence_id rows of documents 1/16 to 1/4 of seq long, and the sum of squared lengths."""
    g = torch.Generator().manual_seed(seed)
    rows, squares = [], 0
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            n = int(torch.randint(seq // 16, seq // 4 + 1, (1,), generator=g))
            lengths.append(min(n, seq - sum(lengths)))
        squares += sum(n * n for n in lengths)
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows).cuda(), squares


def bench(fn, q, k, v, dout=None, **kw) -> float:
    """Mean milliseconds (triton.testing.do_bench) of ``fn(q, k, v, **kw)``, and of its
    backward too when ``dout`` is given."""
    from triton.testing import do_bench

    if dout is None:
        return do_bench(lambda: fn(q, k, v, **kw), warmup=25, rep=100)
    return do_bench(
        lambda: fn(q, k, v, **kw).backward(dout), warmup=25, rep=100, grad_to_none=[q, k, v]
    )


def alibi_slopes(heads: int) -> torch.Tensor:
    """MPT's ALiBi slopes (alibi_bias_max 8): 2 ** (-8 * (i + 1) / heads)."""
    return torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")


def kernel_rows(seqs, head_dims, impls, masks=("none", "docs"), gqas=(False,), causals=(True, False)):
    """One row per (head_dim, causal, mask, gqa, seq): TFLOP/s of each implementation.

    ``masks``: none (one document), docs (packed documents), alibi, docs+alibi; ``gqas``:
    False (kv heads = heads), True (kv heads = heads / 4)."""
    rows = []
    cells = [
        (d, c, m, g, s) for d in head_dims for c in causals for m in masks for g in gqas
        for s in seqs
    ]
    for head_dim, causal, mask, gqa, seq in tqdm(cells, desc="attention kernels"):
        batch, heads = max(1, TOKENS // seq), D_MODEL // head_dim
        kv_heads = heads // 4 if gqa else heads
        q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k, v = (
            torch.randn(batch, seq, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
            for _ in range(2)
        )
        kw = {"causal": causal}
        squares = batch * seq * seq
        if "docs" in mask:
            kw["sequence_id"], squares = doc_ids(batch, seq)
        if "alibi" in mask:
            kw["alibi_slopes"] = alibi_slopes(heads)
        flops = 4 * heads * head_dim * squares * (0.5 if causal else 1.0)
        row = {"head_dim": head_dim, "causal": causal, "packed": "docs" in mask, "mask": mask,
               "gqa": gqa, "seq": seq, "batch": batch}
        dout = torch.randn_like(q)
        with torch.no_grad():
            want = torch_attention(q, k, v, **kw).float()
        for name in impls:
            try:
                fn = IMPLS[name]
                with torch.no_grad():
                    err = (fn(q, k, v, **kw).float() - want).abs().max().item()
                if err > 0.05:  # bf16 attention outputs agree to ~1e-2
                    row[name] = f"wrong (max error {err:.2g})"
                    continue
                fwd, both = bench(fn, q, k, v, **kw), bench(fn, q, k, v, dout, **kw)
                row[name] = (flops / fwd / 1e9, 3.5 * flops / both / 1e9)
            except Exception as e:  # noqa: BLE001 - out of memory or unsupported: a cell says so
                row[name] = f"{type(e).__name__}"
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def table_rows(rows, impls, device: str, arch: str, source: str) -> list[dict]:
    """kernel_rows' rows as rows of foundryx/models/layers/attention_table.py (cells that did
    not run, or ran wrong, are left out of a row's figures; a row with none is dropped)."""
    out = []
    for r in rows:
        done = [n for n in impls if isinstance(r.get(n), tuple)]
        if not done:
            continue
        out.append({"device": device, "arch": arch, "head_dim": r["head_dim"], "mask": r["mask"],
                    "causal": r["causal"], "gqa": r["gqa"], "seq": r["seq"],
                    "train": {n: round(r[n][1], 1) for n in done},
                    "fwd": {n: round(r[n][0], 1) for n in done}, "source": source})
    return out


TABLE_MODULE = ROOT / "foundryx" / "models" / "layers" / "attention_table.py"
BEGIN, END = "# BEGIN ROWS", "# END ROWS"


def apply_table(text: str, new_rows: list[dict]) -> str:
    """The table module's ``text`` with the rows of ``new_rows``' devices replaced by them
    (other devices' rows kept, in order), one row per line."""
    namespace: dict = {}
    exec(compile(text, str(TABLE_MODULE), "exec"), namespace)  # our own module's text
    devices = {r["device"].lower() for r in new_rows}
    rows = [r for r in namespace["ROWS"] if r["device"].lower() not in devices] + new_rows
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    lines = "".join(
        "    {" + ", ".join(f"{k!r}: {v!r}" for k, v in r.items()) + "},\n" for r in rows
    )
    return (f"{head}{BEGIN} (rewritten by benchmarks/attention.py --apply-table)\n"
            f"ROWS: list[dict[str, Any]] = [\n{lines}]\n{END}{tail}")


def mpt_rows(impls, batch: int, steps: int = 5):
    """Milliseconds and tokens/s of one MPT-1B training step (bf16 autocast, AdamW)."""
    try:
        from foundryx import registry
        from foundryx.models.mpt.configuration import MPTConfig
        from foundryx.models.mpt.modeling import MPTForCausalLM, causal_lm_loss
    except ImportError as e:
        print(f"MPT-1B step skipped: the MPT model does not import here ({e})")
        return []
    for name, fn in IMPLS.items():  # a checkout that is not pip-installed has no entry points
        if name not in registry.attention_implementations:
            registry.attention_implementations.register(name, fn)
    rows = []
    for name in tqdm(impls, desc="MPT-1B steps"):
        try:
            ms = _mpt_step_ms(MPTConfig, MPTForCausalLM, causal_lm_loss, name, batch, steps)
            rows.append((name, ms, batch * MPT_SEQ / ms * 1e3))
        except Exception as e:  # noqa: BLE001 - out of memory or unsupported: the row says so
            rows.append((name, None, f"{type(e).__name__}: {str(e)[:80]}"))
        torch.cuda.empty_cache()  # the model of this row is gone with _mpt_step_ms's frame
    return rows


def _mpt_step_ms(config_cls, model_cls, loss_fn, impl: str, batch: int, steps: int) -> float:
    cfg = config_cls(
        d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4, max_seq_len=MPT_SEQ,
        vocab_size=50368, no_bias=True, attn_config={"attn_impl": impl, "alibi": True},
    )  # fmt: skip
    with torch.device("cuda"):
        model = model_cls(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (batch, MPT_SEQ), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x).logits, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def markdown(rows, mpt, impls, batch: int) -> str:
    def cell(v, i):
        return f"{v[i]:.0f}" if isinstance(v, tuple) else str(v)

    tritons = [n for n in impls if n.startswith("triton")]  # triton, or one per --bwd mode
    others = [n for n in impls if n not in tritons]
    ratios = others and tritons
    head = (
        "| head_dim | causal | docs | seq | batch | "
        + " | ".join(f"fwd {n}" for n in impls)
        + " | "
        + " | ".join(f"fwd+bwd {n}" for n in impls)
        + ("".join(f" | {n} ÷ best other (fwd+bwd)" for n in tritons) + " |" if ratios else " |")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        docs = ("packed" if r["packed"] else "one") + (" + ALiBi" if "alibi" in r.get("mask", "") else "")
        docs += ", GQA" if r.get("gqa") else ""
        line = f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | "
        line += f"{docs} | {r['seq']} | {r['batch']} | "
        line += " | ".join(cell(r[n], 0) for n in impls) + " | "
        line += " | ".join(cell(r[n], 1) for n in impls) + " |"
        best = [r[n][1] for n in others if isinstance(r[n], tuple)]
        for n in tritons if ratios else ():
            ratio = r[n][1] / max(best) if best and isinstance(r[n], tuple) else None
            line += f" {ratio:.2f} |" if ratio else " n/a |"
        lines.append(line)
    text = "TFLOP/s (bf16)\n\n" + "\n".join(lines)
    if mpt:
        base = next((ms for n, ms, _ in mpt if n == "torch" and ms), None)
        text += (
            f"\n\nMPT-1B training step (seq 2048, batch {batch}, ALiBi, bf16 autocast, AdamW)\n\n"
        )
        text += "| attn_impl | ms/step | tokens/s | speed vs torch |\n|---|---|---|---|\n"
        for name, ms, tps in mpt:
            if ms is None:
                text += f"| {name} | n/a | {tps} | |\n"
            else:
                text += f"| {name} | {ms:.0f} | {tps:,.0f} | {base / ms if base else float('nan'):.2f}x |\n"
    return text


def tune(head_dims, seq: int = 4096):
    """Time every candidate of kernels/tuning.py on this GPU; print the best per kernel."""
    family = tuning.device_family(torch.device("cuda"))
    print(f"tuning on {torch.cuda.get_device_name()} (family {family!r}), seq {seq}, causal, bf16")
    for head_dim in head_dims:
        heads, batch = D_MODEL // head_dim, TOKENS // seq
        q, k, v = (
            torch.randn(
                batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True
            )
            for _ in range(3)
        )
        dout = torch.randn_like(q)
        for kernel in tuning.KERNELS:
            timed = []
            # each backward kernel in the mode that runs it
            mode = {"bwd_dkdv": "split", "bwd_dq": "split", "bwd_atomic": "atomic"}.get(kernel)
            for cfg in tqdm(tuning.CANDIDATES[kernel], desc=f"{kernel} d={head_dim}"):
                with tuning.forced(bwd=mode, **{kernel: cfg}):
                    try:
                        ms = bench(triton_attention, q, k, v, None if kernel == "fwd" else dout)
                    except Exception:  # noqa: BLE001 - tiles that do not fit are skipped
                        continue
                timed.append((ms, cfg))
            timed.sort(key=lambda t: t[0])
            print(
                f"  head_dim {head_dim} {kernel}: best {timed[0][1]} ({timed[0][0]:.3f} ms); "
                f"table's {tuning.config(kernel, head_dim, q.device)}"
            )


def write_table(path: Path, rows, impls, info: str) -> None:
    """The table's rows of this GPU, as JSON, to ``path`` (``--apply-table`` reads it)."""
    import json

    props = torch.cuda.get_device_properties(0)
    arch = (getattr(props, "gcnArchName", "") if torch.version.hip else "") or \
        f"sm{props.major}{props.minor}"
    seqs = " ".join(sorted({str(r["seq"]) for r in rows}))
    heads = " ".join(sorted({str(r["head_dim"]) for r in rows}))
    source = (f"python -m benchmarks.attention --table FILE --seqs {seqs} --head-dims {heads} "
              f"({datetime.date.today().isoformat()}; {info})")
    out = table_rows(rows, impls, torch.cuda.get_device_name(), arch, source)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} rows of the attention table to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="sequence lengths (default 512 to 16384; with --table 2048)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--impls", nargs="+", default=["triton", "flash", "flex", "torch"],
                   choices=list(IMPLS))
    p.add_argument("--mpt-batch", type=int, default=4, help="sequences per MPT-1B step")
    p.add_argument("--no-mpt", action="store_true", help="skip the MPT-1B training steps")
    p.add_argument("--tune", action="store_true", help="time tuning.CANDIDATES instead")
    p.add_argument("--bwd", nargs="+", choices=tuning.BWD_MODES, default=None,
                   help="time the Triton kernel once per backward mode (columns triton-split, "
                        "triton-atomic) instead of the tuning table's choice (BWD)")
    p.add_argument("--out", type=Path, help="append the markdown tables to this file")
    p.add_argument("--table", type=Path, metavar="FILE",
                   help="measure attn_impl auto's cases (causal; each mask; MHA and GQA) and "
                        "write them as the table's JSON rows to FILE")
    p.add_argument("--apply-table", type=Path, metavar="FILE",
                   help="replace FILE's devices' rows in foundryx/models/layers/"
                        "attention_table.py with FILE's rows (no GPU needed), then exit")
    args = p.parse_args(argv)
    if args.apply_table:
        import json

        new_rows = json.loads(args.apply_table.read_text())
        TABLE_MODULE.write_text(apply_table(TABLE_MODULE.read_text(), new_rows))
        devices = sorted({r["device"] for r in new_rows})
        print(f"{TABLE_MODULE.relative_to(ROOT)}: {len(new_rows)} rows for {', '.join(devices)}")
        return 0
    if args.bwd and args.table:
        print("--bwd compares the Triton backward's modes; --table measures what attn_impl auto "
              "runs (the tuning table's mode): run them apart", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA or ROCm GPU: torch sees none here. (On CPU "
            "the Triton kernel runs only in Triton's interpreter, for tests.)",
            file=sys.stderr,
        )
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to benchmark compiled kernels", file=sys.stderr)
        return 2
    if args.tune:
        tune(args.head_dims)
        return 0
    impls = [n for n in args.impls if n != "flash" or flash_attn_module()[0] is not None]
    if len(impls) < len(args.impls):
        print(f"flash skipped: {flash_attn_module()[1]}")
    if args.bwd and "triton" in impls:
        at = impls.index("triton")
        impls[at : at + 1] = [f"triton-{m}" for m in dict.fromkeys(args.bwd)]
    info = gpu_info()
    print(info)
    if args.table:
        rows = kernel_rows(args.seqs or [MPT_SEQ], args.head_dims, impls,
                           masks=("none", "docs", "alibi", "docs+alibi"), gqas=(False, True),
                           causals=(True,))
        write_table(args.table, rows, impls, info)
        args.no_mpt = True
    else:
        rows = kernel_rows(args.seqs or [512, 1024, 2048, 4096, 8192, 16384], args.head_dims, impls)
    mpt = [] if args.no_mpt else mpt_rows(impls, args.mpt_batch)
    table = markdown(rows, mpt, impls, args.mpt_batch)
    print(table)
    if args.out:
        command = "python -m benchmarks.attention " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        section = (
            f"\n## Attention kernels on {torch.cuda.get_device_name()} "
            f"({datetime.date.today().isoformat()})\n\n"
            f"Command: `{command}`  \nMachine: {info}\n\n{table}\n"
        )
        with args.out.open("a") as f:
            f.write(section)
        print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
