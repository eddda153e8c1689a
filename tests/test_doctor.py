"""foundryx doctor: each known-bad combination, injected as facts, is flagged with its fix and
exit code 1; the tested torch 2.15 + Composer --no-deps leg is said to be tested, not broken."""

from __future__ import annotations

import dataclasses
import json
import platform

import pytest
import torch

import foundryx.doctor
from foundryx.cli import main
from foundryx.doctor import GIB, Facts, check, probe, render
from foundryx.doctor.facts import GPU

GOOD = Facts(python="3.11.7", torch="2.7.0+cu126", cuda="12.6", triton="3.3.0",
             flash_attn="2.7.4", nccl="2.26.2", composer="0.32.1",
             composer_torch_pin="<2.7.1,>=2.6.0", transformers="4.57.6", foundryx="0.1.0",
             gpus=[GPU("NVIDIA H100 80GB HBM3", 79.2, "h100-sxm", 989.0)],
             shm_bytes=64 * GIB, open_files=(65536, 65536))


def bad(facts: Facts) -> list[str]:
    return [f"{x.what} | fix: {x.fix}" for x in check(facts) if x.bad]


def test_a_good_machine_has_nothing_known_bad():
    assert bad(GOOD) == []
    text = render(GOOD, check(GOOD))
    assert "gpu 0         NVIDIA H100 80GB HBM3, 79.2 GiB; peak h100-sxm: 989 TFLOP/s bf16" in text
    assert text.endswith("nothing known-bad found")


@pytest.mark.parametrize("torch_version, verdict", [
    ("2.7.0+cu126", "within Composer 0.32.1's pin"),
    ("2.15.0+cu132", "outside Composer 0.32.1's pin (torch<2.7.1,>=2.6.0): a known, tested combination"),
    ("2.9.0+cu128", "BAD"),
])
def test_composer_torch_pin(torch_version, verdict):
    facts = dataclasses.replace(GOOD, torch=torch_version)
    if verdict == "BAD":
        (msg,) = bad(facts)
        assert "torch 2.9.0+cu128 is outside Composer 0.32.1's pin" in msg
        assert "not a tested combination" in msg and "make install-modern" in msg
    else:
        assert bad(facts) == []
        assert any(verdict in x.what for x in check(facts))


def test_flash_attn_built_for_another_torch():
    error = ("ImportError: .../flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined "
             "symbol: _ZN3c104cuda9SetDeviceEi")
    (msg,) = bad(dataclasses.replace(GOOD, torch="2.15.0+cu132", flash_attn_error=error))
    assert "flash-attn 2.7.4 was built for another torch than the installed 2.15.0+cu132" in msg
    assert "pip install --no-build-isolation --no-cache-dir --force-reinstall flash-attn==2.7.4" in msg


@pytest.mark.parametrize("workers, config, flagged", [
    (4, "run.yaml", True), (0, "run.yaml", False), (0, None, True)])
def test_small_dev_shm_with_dataloader_workers(workers, config, flagged):
    facts = dataclasses.replace(GOOD, shm_bytes=64 << 20, config=config, config_num_workers=workers)
    msgs = bad(facts)
    assert bool(msgs) == flagged
    if flagged:
        assert "/dev/shm is 0.06 GiB, below 1 GiB" in msgs[0] and "--shm-size" in msgs[0]


@pytest.mark.parametrize("cuda, why", [(None, "torch is a CPU-only build"),
                                       ("12.6", "torch sees no GPU")])
def test_config_asks_for_a_gpu_and_there_is_none(cuda, why):
    facts = dataclasses.replace(GOOD, gpus=[], cuda=cuda, nccl=None, config="run.yaml",
                                config_device="gpu")
    (msg,) = bad(facts)
    assert f"run.yaml sets device: gpu, but {why}" in msg and "set device: cpu" in msg
    assert bad(dataclasses.replace(facts, config_device="cpu")) == []


def test_cli_exit_codes_and_json(monkeypatch, capsys):
    broken = dataclasses.replace(GOOD, torch="2.9.0")
    monkeypatch.setattr(foundryx.doctor, "probe", lambda save_folder=None: broken)
    assert main(["doctor", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["facts"]["torch"] == "2.9.0"
    assert [f["level"] for f in out["findings"]].count("bad") == 1
    monkeypatch.setattr(foundryx.doctor, "probe", lambda save_folder=None: GOOD)
    assert main(["doctor"]) == 0
    assert "nothing known-bad found" in capsys.readouterr().out


def test_probe_of_this_machine(tmp_path):
    facts = probe(save_folder=str(tmp_path / "not" / "yet"))
    assert facts.python == platform.python_version()
    assert facts.torch.split("+")[0] == torch.__version__.split("+")[0]
    assert facts.composer == "0.32.1" and facts.composer_torch_pin
    assert facts.save_folder_free_bytes > 0 and facts.open_files[0] > 0
    assert bad(facts) == [], bad(facts)  # this test machine is sound


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_doctor_of_a_config_that_wants_a_gpu(quickstart_data, capsys):
    assert main(["doctor", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
                 "device=gpu"]) == 1
    out = capsys.readouterr().out
    assert "BAD   yamls/quickstart.yaml sets device: gpu, but" in out
