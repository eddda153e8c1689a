"""Both transformers majors (4.57 on the pinned leg, 5.x on the modern one): installing foundryx
into an environment changes nothing else in it; a model or tokenizer written by a newer
transformers than the installed one is one message naming both versions; the tokenizers
foundryx writes load in either major; a missing Composer or streaming is one message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.runtime.hf_compat import TRANSFORMERS_5, TRANSFORMERS_VERSION

ROOT = Path(__file__).resolve().parents[1]
FOUNDRYX = str(Path(sys.executable).parent / "foundryx")


def test_installing_foundryx_changes_nothing_else_in_this_environment(tmp_path):
    """pip's own resolution of foundryx's requirements against this venv (offline: nothing may
    be fetched): it installs foundryx and nothing else, so torch, transformers and numpy stay
    (on the modern leg: torch 2.15, transformers 5)."""
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}  # no machine-wide cap in the way
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                        "--no-build-isolation", "--report", str(report), "-q", "-e", str(ROOT)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    installs = {i["metadata"]["name"]: i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert list(installs) == ["foundryx"], installs


def test_a_config_from_a_newer_transformers_names_both_versions(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama9", "transformers_version": "9.1.0", "hidden_size": 8}))
    r = subprocess.run([FOUNDRYX, "train", "--dry-run", "yamls/finetune/llama-lora.yaml",
                        f"variables.model_path={folder}"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "cannot load the config" in line]
    assert len(lines) == 1, r.stderr[-2000:]  # one message, under the model section's path
    assert lines[0].startswith("  - model.pretrained_model_name_or_path:"), lines
    assert "written by transformers 9.1.0" in lines[0]
    assert f"this environment has transformers {TRANSFORMERS_VERSION}" in lines[0]
    assert "install transformers>=9.1.0" in lines[0]


def test_a_model_type_unknown_here_names_the_installed_version():
    from foundryx.errors import ConfigError
    from foundryx.models.hf import build_config

    with pytest.raises(ConfigError) as e:
        build_config(None, {"model_type": "llama9"}, {})
    assert "'llama9' is not a Hugging Face model type" in str(e.value)
    from foundryx.runtime.hf_compat import newer_transformers_hint

    hint = newer_transformers_hint(ValueError("has model type `llama9` but Transformers does not "
                                              "recognize this architecture"), "/nonexistent")
    assert f"transformers {TRANSFORMERS_VERSION}, installed here, has no model type 'llama9'" in hint


def test_a_tokenizer_class_transformers_4_lacks_is_named_with_the_fix(tmp_path):
    """transformers 5 saves fast tokenizers as TokenizersBackend; 4.x cannot load that name."""
    from foundryx.data.tokenizers import build_hf_tokenizer, train_bpe_tokenizer
    from foundryx.errors import DataError

    folder = tmp_path / "tok"
    train_bpe_tokenizer(["a b c d e f g"] * 20, 300, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # what both majors load
    config["tokenizer_class"] = "TokenizersBackend"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if TRANSFORMERS_5:
        assert build_hf_tokenizer(str(folder)).encode("a b")  # its own name: loads
        return
    with pytest.raises(DataError) as e:
        build_hf_tokenizer(str(folder))
    assert "'TokenizersBackend' is transformers 5's name" in str(e.value)
    assert f"this environment has transformers {TRANSFORMERS_VERSION}" in str(e.value)
    assert '"tokenizer_class": "PreTrainedTokenizerFast"' in str(e.value)


def test_without_composer_or_streaming_one_message_exit_2():
    code = ("import sys; sys.modules['composer'] = None; sys.modules['streaming'] = None\n"
            "from foundryx.cli import run; run(['train', 'yamls/quickstart.yaml'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "mosaicml==0.32.1 and mosaicml-streaming==0.13.0 are not installed" in r.stderr
    assert "pip install --no-deps mosaicml==0.32.1 mosaicml-streaming==0.13.0" in r.stderr
    assert "pip install 'foundryx[pinned]'" in r.stderr
