"""The peer, as a user writes it (issue 46): plain transformers + peft LoRA on a Llama model
folder, in its own process, one JSON object out.

    python -m benchmarks.peer_lora --model ~/.cache/foundryx-bench/llama-3.1-8b-bf16 --json peer.json
    python -m benchmarks.peer_lora --model FOLDER --device cpu --seq 64 --steps 3 --json p.json

The method, exactly as the issue's table measured it: the model loaded in bf16 (on a GPU, onto
it with ``device_map``), ``model.train()``, ``gradient_checkpointing_enable(
gradient_checkpointing_kwargs={"use_reentrant": False})``, ``get_peft_model`` with LoRA r16 /
alpha 32 / dropout 0.05 on all linear layers (``target_modules="all-linear"``: q, k, v, o, gate,
up, down; not lm_head), forward under ``torch.autocast`` bf16, AdamW lr 2e-4 (``fused=True`` on
a GPU), ``--batch`` x ``--seq`` random tokens per step with ``labels = input_ids``, one optimizer
step per batch. On a CPU (tests): the model in fp32, no autocast, AdamW unfused.

It reports tokens/s (mean of steps 2..N, a profiled step left out), the peak allocated and
reserved GPU memory over the steps (``torch.cuda.max_memory_allocated`` / ``_reserved``,
the peaks reset after loading, as foundryx's memory monitor resets them when fitting starts),
each step's loss and seconds, and the versions. The model folder is the one
benchmarks/flagship.py writes (random bf16 weights of ``--shape``); ``--profile-step K``
profiles step K into ``--profile-dir`` (benchmarks/step_profile.py: peer-kernels.md,
peer-memory.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

GiB = 2**30


def train(a: argparse.Namespace) -> dict:
    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA or ROCm GPU visible to torch")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype,
                                                 **({"device_map": {"": "cuda"}} if cuda else {}))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, fused=cuda)
    load_s = time.perf_counter() - t0

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    data = torch.randint(0, vocab, (a.steps, a.batch, a.seq), generator=g)
    profiler = None
    if a.profile_step:
        from benchmarks.instruments.step_profile import StepProfile

        profiler = StepProfile(a.profile_dir, "peer", a.device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, seconds = [], []
    for step in range(1, a.steps + 1):
        x = data[step - 1].to(model.device)
        if profiler is not None and step == a.profile_step:
            profiler.start()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the step
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(value)
        if profiler is not None and step == a.profile_step:
            profiler.stop(model, optimizer)
        print(f"step {step}: loss {value:.4f}, {seconds[-1]:.3f} s", flush=True)
    timed = [s for i, s in enumerate(seconds, 1) if i >= 2 and i != a.profile_step]
    tokens = a.batch * a.seq
    out = {
        "side": "peer", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens_per_s": statistics.mean(tokens / s for s in timed) if timed else None,
        "losses": losses, "step_seconds": seconds, "load_s": load_s,
        "tokens_per_step": tokens, "steps": a.steps, "profile_step": a.profile_step,
        "trainable_params": sum(p.numel() for p in trainable),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
    }
    if cuda:
        out["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    return out


def main(argv: list[str] | None = None) -> int:
    intro = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=intro.replace("\n", " "))
    p.add_argument("--model", type=Path, required=True, help="a Llama model folder (safetensors)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: bf16 weights, autocast bf16, fused AdamW; cpu: fp32, no autocast")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    p.add_argument("--profile-step", type=int, default=0,
                   help="profile this step (1-based; 0: none); left out of tokens/s")
    p.add_argument("--profile-dir", type=Path, default=Path("."),
                   help="where the profile's peer-kernels.md and peer-memory.md go")
    p.add_argument("--json", type=Path, default=None, help="write the result here (else stdout)")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps: at least 2 (tokens/s is the mean of steps 2..N)")
    result = train(a)
    text = json.dumps(result, indent=1)
    if a.json:
        a.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
