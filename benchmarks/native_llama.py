"""The native Llama (foundryx.models.llama) against transformers' LlamaForCausalLM on the model
of benchmarks/eval_vs_llmfoundry.py (seeded random Llama, hidden 64, 2 layers, vocab 8192,
fp32), through the eval's two operations: a scoring forward of 4 x 512 tokens
(``scoring_forward`` vs ``native_scoring_forward``) and greedy generation of 100 new tokens
for 32 and 4 left-padded rows (``greedy_generate`` vs ``native_greedy_generate``), one process,
CPU seconds (process time) and wall seconds, best of ``--repeat``; each side's results are
checked equal first. ``--imports``: also the import time of each side's modules, each in a
fresh process. Figures in docs/eval.md ("The native Llama") are from OMP_NUM_THREADS=1 runs
(2 threads on a shared 2-core machine measure the neighbours).

    OMP_NUM_THREADS=1 python -m benchmarks.native_llama [--work DIR] [--repeat 5] [--imports]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch


def best(fn, repeat: int) -> tuple[float, float]:
    """(CPU s, wall s) of the fastest of ``repeat`` calls after one warm-up."""
    fn()
    runs = []
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        fn()
        runs.append((time.process_time() - c, time.perf_counter() - w))
    return min(runs, key=lambda r: r[1])


def import_seconds(stmt: str) -> float:
    code = f"import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/native_llama_bench"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--imports", action="store_true", help="also time the imports")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from benchmarks.eval_vs_llmfoundry import build_model
    from foundryx.eval.generate import greedy_generate
    from foundryx.eval.native_lm import native_greedy_generate, native_scoring_forward
    from foundryx.eval.score import scoring_forward
    from foundryx.models.llama import load_hf_llama

    args.work.mkdir(parents=True, exist_ok=True)
    folder = build_model(args.work)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    c, w = time.process_time(), time.perf_counter()
    native = load_hf_llama(folder)
    load = (time.process_time() - c, time.perf_counter() - w)
    vocab = native.spec.vocab_size

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (4, 512))
    lengths = torch.tensor([512, 480, 400, 300])
    mask = (torch.arange(512)[None] < lengths[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "cont_start": lengths - 8,
             "cont_end": lengths}
    hf_score, nat_score = scoring_forward(hf), native_scoring_forward(native)
    with torch.no_grad():
        assert torch.equal(hf_score(batch)[0], nat_score(batch)[0])

    prompt_lengths = torch.randint(20, 64, (32,))
    gen_mask = (torch.arange(64)[None] >= 64 - prompt_lengths[:, None]).long()  # left padded
    gen_ids = torch.randint(0, vocab, (32, 64)) * gen_mask
    new = args.new_tokens
    assert (greedy_generate(hf, None, gen_ids, gen_mask, new)
            == native_greedy_generate(native, None, gen_ids, gen_mask, new))

    def hf_scoring():
        with torch.no_grad():
            hf_score(batch)

    small = {k: v[:1, :128] if v.ndim == 2 else v[:1] for k, v in batch.items()}
    small["cont_start"], small["cont_end"] = torch.tensor([120]), torch.tensor([127])

    def hf_small():
        with torch.no_grad():
            hf_score(small)

    def gen(fn, model, n):
        return lambda: fn(model, None, gen_ids[:n], gen_mask[:n], new)

    rows = [
        ("scoring forward 4 x 512", best(hf_scoring, args.repeat),
         best(lambda: nat_score(batch), args.repeat)),
        ("scoring forward 1 x 128", best(hf_small, args.repeat),
         best(lambda: nat_score(small), args.repeat)),
        (f"generate 32 rows x {new} new tokens", best(gen(greedy_generate, hf, 32), args.repeat),
         best(gen(native_greedy_generate, native, 32), args.repeat)),
        (f"generate 4 rows x {new} new tokens", best(gen(greedy_generate, hf, 4), args.repeat),
         best(gen(native_greedy_generate, native, 4), args.repeat)),
    ]
    imports = [] if not args.imports else [
        ("import torch", import_seconds("import torch")),
        ("import transformers' LlamaForCausalLM",
         import_seconds("from transformers import LlamaForCausalLM")),
        ("import foundryx.eval.native_lm", import_seconds("import foundryx.eval.native_lm"))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {folder.name}; "
          f"load_hf_llama {load[0]:.3f} CPU s, {load[1]:.3f} s; best of {args.repeat}")
    print("| operation | transformers CPU s | transformers s | native CPU s | native s | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, (hc, hw), (nc, nw) in rows:
        print(f"| {name} | {hc:.3f} | {hw:.3f} | {nc:.3f} | {nw:.3f} | {hw / nw:.1f}x |")
    for name, seconds in imports:
        print(f"{name}: {seconds:.2f} s (fresh process)")


if __name__ == "__main__":
    main()
