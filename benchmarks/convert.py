"""Conversion speed: `foundryx data convert` with 1 and 2 workers, beside the tokenizer alone
on the same text and cores (and, with ``--llmfoundry``, LLM Foundry 0.22's converter).

    python -m benchmarks.convert --copies 40 --max-seq-len 256 --rounds 3 [--llmfoundry]
    python -m benchmarks.convert --copies 4 --rounds 1          # a quick look

The corpus is ../shared/corpus/tinyshakespeare.txt repeated ``--copies`` times (documents are
its blank-line-separated paragraphs); the tokenizer is a byte-level BPE (vocab 4096) trained
on it. Every side runs in its own fresh process, and the sides alternate within each round
(the order turns each round), so load from other processes hits them alike:

* ``convert, N workers``: ``foundryx data convert --workers N`` as a user runs it; its wall
  time is the whole process (imports, tokenizer load, reading, tokenizing, writing shards)
  and, separately, the ``convert_to_mds`` call alone (timed inside the process);
* ``tokenizer alone``: the same tokenizer (``tokenizers.Tokenizer``) on the same paragraphs,
  read into memory before the clock starts, batches of 1,000 through ``encode_batch_fast``
  (its fastest documented call: ``encode_batch`` without offsets), either on its own thread
  pool (``TOKENIZERS_PARALLELISM=true``, every core) or in N processes of one thread each,
  each on its share of the batches; the faster of the two is the tokenizer's own throughput;
  and in 1 process, so the tokenizer's own speed-up from a second process on this machine
  stands beside the conversion's (2 workers over 1);
* ``LLM Foundry, 2 processes`` (``--llmfoundry``): LLM Foundry 0.22's
  ``convert_text_to_mds`` (installed in its own venv as benchmarks/vs_llmfoundry.py does) on
  a folder of the same text, one file per copy (it parallelises over files), its ``--processes
  2``, ``concat_tokens`` = ``--max-seq-len``, the eos text between documents; its wall time
  is its whole process.

Each row gives the median of the rounds and their range; tokens/s counts the tokens each side
produced (the conversion's are the tokenizer's plus one eos a document). The load average is
printed with every run: on a shared machine the figures understate what a quiet one gives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOKENIZER_ALONE = r"""
import json, os, sys, time
mode, n, corpus, tok_file, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
os.environ["TOKENIZERS_PARALLELISM"] = "true" if mode == "threads" else "false"
from tokenizers import Tokenizer
text = open(corpus, encoding="utf-8").read()
docs = [d for d in text.split("\n\n") if d.strip()]
batches = [docs[i:i + batch] for i in range(0, len(docs), batch)]

def run(share):
    tok = Tokenizer.from_file(tok_file)
    tokens = 0
    for b in share:
        for e in tok.encode_batch_fast(b, add_special_tokens=False):
            tokens += len(e.ids)
    return tokens

import resource
def cpu():
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
if mode == "threads":
    start, cpu0 = time.perf_counter(), cpu()
    tokens = run(batches)
    wall = time.perf_counter() - start
else:  # n processes of one thread, forked with the batches in memory, each a contiguous share
    import multiprocessing as mp
    shares = [batches[len(batches) * i // n:len(batches) * (i + 1) // n] for i in range(n)]
    ctx = mp.get_context("fork")
    go, done = ctx.Barrier(n + 1), ctx.Queue()
    def child(share):
        go.wait()
        done.put(run(share))
    procs = [ctx.Process(target=child, args=(s,)) for s in shares]
    for p in procs:
        p.start()
    cpu0 = cpu()
    go.wait()
    start = time.perf_counter()
    tokens = sum(done.get() for _ in procs)
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
print(json.dumps({"wall": wall, "cpu": cpu() - cpu0, "tokens": tokens, "docs": len(docs)}))
"""

CONVERT = r"""
import json, resource, sys, time
def cpu():
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
from foundryx.cli import main
import foundryx.data.convert as convert
call = {}
inner = convert.convert_to_mds
def timed(*a, **k):
    start, cpu0 = time.perf_counter(), cpu()
    out = inner(*a, **k)
    call["s"], call["cpu"], call["manifest"] = time.perf_counter() - start, cpu() - cpu0, out
    return out
convert.convert_to_mds = timed
import foundryx.cli.data_command as dc
dc.convert_to_mds = timed
rc = main(sys.argv[2:])
json.dump({"call_s": call["s"], "call_cpu": call["cpu"], "tokens": call["manifest"]["tokens"] + call["manifest"]["tokens_dropped"],
           "documents": call["manifest"]["documents"]}, open(sys.argv[1], "w"))
sys.exit(rc)
"""

LLMFOUNDRY = r"""
import sys
from llmfoundry.command_utils import convert_text_to_mds
inp, out, tok, seq, procs = sys.argv[1:6]
convert_text_to_mds(tokenizer_name=tok, output_folder=out, input_folder=inp, concat_tokens=int(seq),
                    eos_text="<|endoftext|>", bos_text="", no_wrap=False, compression=None,
                    processes=int(procs), args_str="bench", reprocess=True, trust_remote_code=False)
"""


def cpu_seconds() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def timed_process(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of a fresh process."""
    start, cpu0 = time.perf_counter(), cpu_seconds()
    env = {**os.environ, **(env or {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package runs: bytecode cached
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    if p.returncode != 0:
        sys.exit(f"convert benchmark: {' '.join(map(str, cmd))} failed:\n{p.stderr[-4000:]}")
    return wall, cpu, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/corpus/tinyshakespeare.txt"))
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=1000, help="paragraphs a batch, tokenizer alone")
    ap.add_argument("--llmfoundry", action="store_true", help="LLM Foundry 0.22's converter too")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/foundryx-bench/llmfoundry")
    ap.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    py = sys.executable
    lf_py = None
    if args.llmfoundry:
        from benchmarks.vs_llmfoundry import ensure_llmfoundry

        lf_py = str(ensure_llmfoundry(args.venv))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text = Path(args.corpus).read_text(encoding="utf-8").strip() + "\n\n"
        src = work / "corpus.txt"
        src.write_text(text * args.copies, encoding="utf-8")
        size_mb = src.stat().st_size / 2**20
        tok_dir = work / "tok"
        if not (tok_dir / "tokenizer.json").exists():
            subprocess.run([py, "-c", "import sys; from foundryx.data.tokenizers import "
                            "train_bpe_tokenizer; from foundryx.data.sources import read_documents; "
                            "train_bpe_tokenizer(read_documents(sys.argv[1]), 4096, sys.argv[2])",
                            args.corpus, str(tok_dir)], check=True, env={**os.environ, **env})
        scripts = {}
        for name, body in (("alone", TOKENIZER_ALONE), ("convert", CONVERT), ("lf", LLMFOUNDRY)):
            scripts[name] = work / f"{name}.py"
            scripts[name].write_text(body)
        if lf_py:
            lf_in = work / "lf-in"
            lf_in.mkdir(exist_ok=True)
            for i in range(args.copies):
                (lf_in / f"part-{i:03d}.txt").write_text(text, encoding="utf-8")

        sides = [f"convert, {w} worker{'s' if w > 1 else ''}" for w in args.workers]
        sides += ["tokenizer alone, thread pool", f"tokenizer alone, {cores} processes",
                  "tokenizer alone, 1 process"]
        sides += ["LLM Foundry, 2 processes"] if lf_py else []
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        print(f"corpus: {size_mb:.1f} MB ({args.copies} copies), {cores} cores; load average "
              f"before: {os.getloadavg()}", flush=True)
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                if side.startswith("convert"):
                    w = int(side.split(", ")[1].split()[0])
                    out = work / f"out{w}"
                    wall, cpu, _ = timed_process(
                        [py, str(scripts["convert"]), str(work / "res.json"), "data", "convert",
                         "--input", str(src), "--out", str(out), "--tokenizer", str(tok_dir),
                         "--max-seq-len", str(args.max_seq_len), "--workers", str(w),
                         "--overwrite", "--no-progress"], env)
                    res = json.loads((work / "res.json").read_text())
                    row = {"wall": wall, "cpu": cpu, "call": res["call_s"], "call_cpu": res["call_cpu"],
                           "tokens": res["tokens"]}
                elif side.startswith("tokenizer"):
                    mode = "threads" if "thread" in side else "procs"
                    n = 1 if side.endswith("1 process") else cores
                    wall, cpu, stdout = timed_process(
                        [py, str(scripts["alone"]), mode, str(n), str(src),
                         str(tok_dir / "tokenizer.json"), str(args.batch)])
                    res = json.loads(stdout.strip().splitlines()[-1])
                    # the conversion's tokens: the tokenizer's plus one eos a document
                    row = {"wall": res["wall"], "cpu": cpu, "call": res["wall"], "call_cpu": res["cpu"],
                           "tokens": res["tokens"] + res["docs"], "process": wall}
                else:
                    shutil.rmtree(work / "lf-out", ignore_errors=True)  # it refuses a full folder
                    wall, cpu, _ = timed_process(
                        [lf_py, str(scripts["lf"]), str(work / "lf-in"), str(work / "lf-out"),
                         str(tok_dir), str(args.max_seq_len), "2"],
                        {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
                    row = {"wall": wall, "cpu": cpu, "call": wall, "call_cpu": cpu, "tokens": None}
                runs[side].append(row)
                print(f"  round {r + 1}, {side}: {row['call']:.1f} s, {row['call_cpu']:.1f} CPU s "
                      f"(process {row['wall']:.1f} s, {row['cpu']:.1f} CPU s), load {os.getloadavg()[0]:.2f}", flush=True)
        load = os.getloadavg()
    med = {s: statistics.median(x["call"] for x in runs[s]) for s in sides}
    tokens = runs[sides[0]][0]["tokens"]
    alone = [s for s in sides if s.startswith("tokenizer") and not s.endswith("1 process")]
    best_alone = min(alone, key=lambda s: med[s])
    conv = [s for s in sides if s.startswith("convert")]

    def spread(side: str, key: str = "call") -> str:
        xs = [x[key] for x in runs[side]]
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"

    print(f"\nload average after: {load}\n")
    print(f"{datetime.date.today()}: {size_mb:.1f} MB ({args.copies} copies of tinyshakespeare), "
          f"{tokens:,} tokens, max_seq_len {args.max_seq_len}, {cores} cores, {args.rounds} "
          f"rounds alternating; medians (min..max)\n")
    print("| side | s (the work) | process s | tokens/s | vs the tokenizer alone | "
          "speed-up vs 1 worker | CPU s (the work / process) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in sides:
        proc = spread(s, "process" if "process" in runs[s][0] else "wall")
        vs = f"{med[best_alone] / med[s]:.2f}x"
        up = f"{med[conv[0]] / med[s]:.2f}x" if s in conv else ""
        cpu = statistics.median(x["cpu"] for x in runs[s])
        work_cpu = statistics.median(x["call_cpu"] for x in runs[s])
        print(f"| {s} | {spread(s)} | {proc} | {tokens / med[s]:,.0f} | {vs} | {up} | "
              f"{work_cpu:.1f} / {cpu:.1f} |")
    print(f"\nThe tokenizer's own throughput: {best_alone} ({tokens / med[best_alone]:,.0f} "
          f"tokens/s). Each round's conversion over the tokenizer alone (2 workers / fastest "
          f"alone, same round): " + ", ".join(
              f"{min(runs[t][r]['call'] for t in alone) / runs[conv[-1]][r]['call']:.2f}"
              for r in range(args.rounds)))
    one_alone = "tokenizer alone, 1 process"
    if len(conv) > 1:
        print(f"Per round, {conv[-1]} over {conv[0]}: " + ", ".join(
            f"{runs[conv[0]][r]['call'] / runs[conv[-1]][r]['call']:.2f}" for r in range(args.rounds))
            + f"; the tokenizer alone, {cores} processes over 1 (what the machine gives a second "
            f"process): " + ", ".join(
                f"{runs[one_alone][r]['call'] / runs[alone[-1]][r]['call']:.2f}"
                for r in range(args.rounds)))


if __name__ == "__main__":
    main()
