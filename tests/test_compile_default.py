"""compile.enabled: auto (the default) compiles each block where this torch and device can,
says so in one line, and says why not where it cannot; `compile: false` turns it off."""

from __future__ import annotations

import logging

import pytest
import torch

from foundryx.config.load import load_config
from foundryx.config.schema import CompileConfig
from foundryx.errors import ConfigError
from foundryx.parallel import wrappers
from foundryx.parallel.parallelize import resolve_compile

CPU = torch.device("cpu")


def test_default_is_auto_and_bare_switch_is_accepted(quickstart_data):
    base = ["variables.data_root=" + str(quickstart_data)]
    assert load_config("yamls/quickstart.yaml", base).cfg.compile == CompileConfig(enabled="auto")
    off = load_config("yamls/quickstart.yaml", [*base, "compile=false"]).cfg
    assert off.compile == CompileConfig(enabled=False)
    ac = load_config("yamls/quickstart.yaml", [*base, "activation_checkpointing=true"]).cfg
    assert ac.activation_checkpointing.enabled is True
    with pytest.raises(ConfigError) as e:
        load_config("yamls/quickstart.yaml", [*base, "compile.enabled=sometimes"])
    assert "compile.enabled" in str(e.value) and "auto" in str(e.value)


def test_auto_compiles_on_cpu_with_a_compiler_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("FOUNDRYX_COMPILE", raising=False)
    monkeypatch.setattr(wrappers.shutil, "which", lambda name: f"/usr/bin/{name}")
    with caplog.at_level(logging.INFO):
        assert resolve_compile(CompileConfig(), CPU, has_blocks=True) is True
    assert "compile: torch.compile per transformer block on cpu" in caplog.text
    assert "compile: false turns it off" in caplog.text


@pytest.mark.parametrize("env, which, blocks, reason", [
    ("0", "/usr/bin/g++", True, "FOUNDRYX_COMPILE=0"),
    (None, None, True, "no C++ compiler"),
    (None, "/usr/bin/g++", False, "the model names no blocks"),
])
def test_auto_stays_off_with_the_reason(monkeypatch, caplog, env, which, blocks, reason):
    if env is None:
        monkeypatch.delenv("FOUNDRYX_COMPILE", raising=False)
    else:
        monkeypatch.setenv("FOUNDRYX_COMPILE", env)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(wrappers.shutil, "which", lambda name: which)
    with caplog.at_level(logging.INFO):
        assert resolve_compile(CompileConfig(), CPU, has_blocks=blocks) is False
    assert f"compile: off ({reason}" in caplog.text


def test_explicit_setting_wins_over_auto(monkeypatch):
    monkeypatch.setenv("FOUNDRYX_COMPILE", "0")
    assert resolve_compile(CompileConfig(enabled=True), CPU, has_blocks=True) is True
    assert resolve_compile(CompileConfig(enabled=False), CPU, has_blocks=True) is False
