"""CPU seconds per GiB of one shard-on-read load, user and system apart (issue 23).

    python benchmarks/load_cpu.py FOLDER [frozen_base dtype: fp8 | int8 | bf16 | nf4 | none]

One process builds what ``foundryx train`` builds for an ``hf_causal_lm`` with LoRA r16 on all
linear layers, the frozen base and ``init_device: meta`` (``builders.build_model``), then runs
``builders.parallelize_and_load`` and reports ``getrusage`` around the loader's own call
(``builders.load_pretrained``): user and system CPU seconds per GiB read, wall seconds and
page faults. CPU seconds, unlike wall time, compare across runs on a shared machine; compare
two trees by alternating runs (``PYTHONPATH=tree``). ``benchmarks/load_memory.py`` measures
the grid (ranks, memory, throughput against ``cat``).
"""

from __future__ import annotations

import resource
import sys
from types import SimpleNamespace

import torch


def main() -> None:
    folder, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fp8"
    torch.set_num_threads(1)
    from foundryx import builders

    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder,
               "init_device": "meta",
               "peft_config": {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}}
    if dtype != "none":
        section["frozen_base"] = {"dtype": dtype}
    model = builders.build_model(SimpleNamespace(model=section), None)
    load = builders.load_pretrained

    def measured(*args, **kwargs):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        out = load(*args, **kwargs)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        gib = out["bytes_read"] / 2**30
        print(f"{dtype}: {out['seconds']:.2f} s wall, user {(r1.ru_utime - r0.ru_utime) / gib:.2f}"
              f" sys {(r1.ru_stime - r0.ru_stime) / gib:.2f} CPU s/GiB, {gib:.2f} GiB read, "
              f"{r1.ru_minflt - r0.ru_minflt} minor page faults", flush=True)
        return out

    builders.load_pretrained = measured
    builders.parallelize_and_load(model, None, device=torch.device("cpu"), precision="fp32")


if __name__ == "__main__":
    main()
