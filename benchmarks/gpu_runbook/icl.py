"""One ICL eval on the GPU and on the CPU, in one process: the same scores (issue 36).

    python -m benchmarks.gpu_runbook.icl --out icl.md                # CPU, then the GPU
    python -m benchmarks.gpu_runbook.icl --devices cpu cpu --out x.md  # no GPU: the check itself

The model: a tiny random Llama (hidden 64, 2 layers, initializer_range 0.2 so that its choices'
losses are far apart: a random model's near-ties would make the comparison a coin toss on
rounding), saved as a Hugging Face folder with a small BPE tokenizer. The tasks: the
quickstart's (eval/yamls/quickstart.yaml: facts_lm at 0 and 3 shots, facts_mc at 0 shots),
generated offline. `foundryx eval`'s library function (``run_eval``, the CLI's) runs the same
config once per ``--devices`` entry with ``device=`` and ``precision=fp32`` overridden (and TF32
off on a GPU, which Composer's GPU device otherwise allows); every result must be the same on
each, within ``--tolerance`` (1e-6: a changed answer moves a score by at least 1e-3; float32
sums in another order by about 1e-8); exit 1 when one differs. The markdown table has each
result on each device and their difference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "eval" / "yamls" / "quickstart.yaml"
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "vocab_size": 512, "initializer_range": 0.2}


def tiny_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from foundryx.data.synthetic import generate_corpus
    from foundryx.data.tokenizers import train_bpe_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA)).save_pretrained(out)
    train_bpe_tokenizer(generate_corpus(300, seed=1), vocab_size=400, out_dir=out)
    return out


def full_fp32_on_gpus() -> bool:
    """Composer's GPU device allows TF32 matrix products unless told otherwise (10 mantissa bits):
    a random model's near-tied choices could then flip against the CPU's fp32 for no fault of
    the eval. The eval's device is made with TF32 off here, so both sides compute in fp32.
    False when foundryx's eval no longer takes its device from where this reaches."""
    import foundryx.eval.run as run

    if not callable(getattr(run, "get_device", None)):
        return False
    from composer.devices import DeviceGPU

    made = run.get_device

    def get_device(name):
        return DeviceGPU(allow_tf32=False) if name == "gpu" else made(name)

    run.get_device = get_device
    return True


def evaluate(model: Path, data: Path, device: str, batch: int) -> dict[str, float]:
    from foundryx.eval.config import load_eval_config
    from foundryx.eval.run import run_eval

    overrides = [f"variables.data_root={data}", f"models=[{{label: tiny, hf: {model}}}]",
                 f"device={device}", "precision=fp32", f"device_eval_batch_size={batch}",
                 "python_log_level=warning"]
    outcome = run_eval(load_eval_config(str(CONFIG), overrides), write=False)
    return dict(outcome.results.scores["tiny"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", nargs=2, default=["cpu", "gpu"], metavar=("REFERENCE", "DEVICE"),
                   help="the two devices compared (default: cpu gpu)")
    p.add_argument("--batch", type=int, default=16, help="device_eval_batch_size (16)")
    p.add_argument("--tolerance", type=float, default=1e-6,
                   help="largest difference of a score allowed (default 1e-6: an answer that "
                        "changes moves a score by 1/items, at least 1e-3 here; the same sums in "
                        "float32 in another order differ by about 1e-8, as the first H100 run "
                        "showed)")
    p.add_argument("--out", type=Path, required=True, help="the markdown file to write")
    a = p.parse_args(argv)
    exact = full_fp32_on_gpus()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "model")
        scores, seconds = {}, {}
        for dev in dict.fromkeys(a.devices):
            start = time.perf_counter()
            scores[dev] = evaluate(model, Path(tmp) / "data", dev, a.batch)
            seconds[dev] = time.perf_counter() - start
    ref, dev = a.devices
    keys = list(scores[ref])
    bad = [k for k in keys if abs(scores[ref][k] - scores[dev].get(k, float("nan"))) > a.tolerance
           or k not in scores[dev]]
    lines = [f"Tiny random Llama ({LLAMA['hidden_size']} wide, {LLAMA['num_hidden_layers']} "
             f"layers), `{CONFIG.relative_to(ROOT)}`'s tasks, fp32 "
             f"({'TF32 off' if exact else 'TF32 as Composer sets it'} on a GPU), batch {a.batch}: "
             f"{ref} {seconds[ref]:.1f} s, {dev} {seconds[dev]:.1f} s (model load included).", "",
             f"| result | {ref} | {dev} | difference | same |", "|---|---:|---:|---:|---|"]
    for k in keys:
        other = scores[dev].get(k, float("nan"))
        lines.append(f"| {k} | {scores[ref][k]:.6f} | {other:.6f} | "
                     f"{abs(scores[ref][k] - other):.1e} | {'**no**' if k in bad else 'yes'} |")
    lines += ["", f"**{len(bad)} of {len(keys)} results differ**"
              + (f" (tolerance {a.tolerance})" if a.tolerance else "") + "." if bad else
              f"All {len(keys)} results are the same on {ref} and {dev}."]
    text = "\n".join(lines) + "\n"
    a.out.write_text(text)
    print(text)
    return 1 if bad or not keys else 0


if __name__ == "__main__":
    sys.exit(main())
