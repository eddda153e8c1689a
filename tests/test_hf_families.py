"""The model families people fine-tune in 2026 (tests/hf_families.py: Llama 3.x, Qwen3, Gemma 3
text, Mistral, OLMo 2, Phi-4), each as a tiny model of its family saved as bf16 safetensors in
several files: read shard by shard on 2 gloo ranks over an fp8 and an NF4 frozen base, LoRA
trained (the loss falls), its adapter exported, and the export read back by plain transformers
and peft in a separate process: the process of the other torch leg when its venv is there
(transformers 4.57 reads what 5.x wrote, and the other way round), else this one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from hf_families import FAMILIES, save_family
from hf_tiny import VOCAB, train_steps
from test_loading_dist import _build

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FROZEN = ("fp8", "nf4")
CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
           "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM"}


def _other_leg_python() -> tuple[str, str]:
    """(python, which) of the venv of the other transformers major version, else this one."""
    from foundryx.runtime.hf_compat import TRANSFORMERS_5

    other = ROOT / (".venv" if TRANSFORMERS_5 else ".venv-modern") / "bin" / "python"
    return (str(other), "other leg") if other.is_file() else (sys.executable, "this leg")


def _train_and_export(folders: dict[str, str], out: str, tokenizer_folder: str) -> dict:
    from transformers import AutoTokenizer

    from foundryx.export.lora import options_of, write_adapter
    from foundryx.parallel import dist

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)

    results: dict = {}
    for name, folder in folders.items():
        for frozen in FROZEN:
            model, opt = _build(folder, "meta", frozen)
            losses = train_steps(model, 4, opt=opt)
            # the adapters, gathered whole (FSDP2 shards them as DTensors)
            adapters = {k.removeprefix("model."): getattr(p, "full_tensor", lambda p=p: p)()
                        .detach().float() for k, p in model.named_parameters() if "lora_" in k}
            if dist.rank() == 0:
                write_adapter(model.model, options_of(model.model), tokenizer,
                              f"{out}/{name}-{frozen}", fmt="hf", base=folder, weights=adapters)
            results[f"{name}-{frozen}"] = {"losses": losses, "adapters": adapters}
    return results


def test_families_load_shard_by_shard_train_and_export_for_plain_peft(tmp_path, tiny_tokenizer):
    folders = {name: save_family(name, tmp_path / name) for name in FAMILIES}
    tiny_tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert all((tmp_path / name / "model.safetensors.index.json").is_file() for name in FAMILIES)
    out = tmp_path / "adapters"
    results = run_distributed(_train_and_export, args=(folders, str(out), str(tmp_path / "tokenizer")),
                              timeout=900)
    for case, run in results[0].items():
        losses = run["losses"]
        assert all(map(torch.isfinite, map(torch.tensor, losses))), (case, losses)
        assert losses[-1] < losses[0] - 0.05, (case, losses)
        assert losses == results[1][case]["losses"], case  # both ranks: one model
    cases = {case: [folders[case.split("-")[0]], str(out / case)] for case in results[0]}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torch.save(torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3)),
               tmp_path / "ids.pt")
    python, which = _other_leg_python()
    judged = subprocess.run([python, str(ROOT / "tests" / "family_judge.py"),
                             str(tmp_path / "cases.json"), str(tmp_path / "ids.pt"),
                             str(tmp_path / "judged.pt")], capture_output=True, text=True,
                            timeout=600)
    assert judged.returncode == 0, (which, judged.stderr[-3000:])
    said = torch.load(tmp_path / "judged.pt", weights_only=False)
    print(f"judged by transformers {said['transformers']} ({which})")
    for case, run in results[0].items():
        got = said[case]
        assert got["finite"] and got["changed"] > 0, (case, got)
        assert got["class"] == CLASSES[FAMILIES[case.split("-")[0]][0]], (case, got["class"])
        assert got["tokens"] == tiny_tokenizer("the king")["input_ids"], case  # its tokenizer
        # every trained adapter weight, under PEFT's names, as trained
        mine = {k.replace(".default.", "."): v for k, v in run["adapters"].items()}
        theirs = {k.removeprefix("base_model.model."): v for k, v in got["adapter"].items()}
        assert sorted(mine) == sorted(theirs), (case, sorted(set(mine) ^ set(theirs))[:6])
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), case


def _tp_against_fsdp(families: list[str]) -> dict:
    """Per family: the losses of the whole model and of LoRA at tp 2 and at FSDP2 shard 2
    (test_tp.py's steps, batches and AdamW), and the refusals of the families without a plan."""
    import test_tp

    from foundryx.parallel.tp import plan_problems

    out: dict = {}
    for name in families:
        model_type, config = FAMILIES[name]
        test_tp.LLAMA = {**config, "model_type": model_type, "vocab_size": 64,
                         "max_position_embeddings": test_tp.SEQ, "tie_word_embeddings": False}
        model = test_tp._build("llama", "full")
        out[("problems", name)] = plan_problems(model, 2)
        if out[("problems", name)]:
            continue
        for variant in ("full", "lora"):
            for mesh, (shard, tp) in {"fsdp": (2, 1), "tp": (1, 2)}.items():
                out[(name, variant, mesh)] = test_tp._losses("llama", shard, tp, variant,
                                                             steps=range(8))
    return out


@pytest.mark.modern_leg  # one leg: the plans are foundryx's, not what a version wrote (CI time)
def test_tensor_parallel_plans_of_the_families_give_fsdps_losses_or_say_why_not():
    import test_tp

    results = run_distributed(_tp_against_fsdp, args=(list(FAMILIES),), timeout=900)
    for r in results:
        for name, (model_type, _) in FAMILIES.items():
            problems = r[("problems", name)]
            if model_type in ("olmo2", "phi3"):  # refused, with the reason, at config time
                assert len(problems) == 1 and "no tensor-parallel plan" in problems[0], problems
                assert ("q_norm" in problems[0]) == (model_type == "olmo2"), problems
                continue
            assert problems == [], (name, problems)
            for variant in ("full", "lora"):
                got, want = r[(name, variant, "tp")], r[(name, variant, "fsdp")]
                assert test_tp._close(got, want), (name, variant, got, want)
