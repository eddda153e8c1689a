"""A plugin's component declares its options as a dataclass (docs/plugins.md): the validator
checks a YAML section against it, every problem at once, and the builder passes an instance."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from foundryx import registry
from foundryx.config.components import ModelFacts, build_component, component_problems
from foundryx.config.types import coerce, option
from foundryx.errors import ConfigError


@dataclass
class Window:
    size: int = option("tokens", gt=0)


@dataclass
class JsonlLoaderOptions:
    path: str = option("a .jsonl file")
    max_seq_len: int = option("tokens per sample", gt=0)
    side: str = option("padding side", default="right",
                       check=(lambda v: v in ("left", "right"), "left or right"))
    norm: str = option("a norm, by registry name", default="layernorm", registry="norms")
    windows: dict[str, Window] = option("named windows", default_factory=dict)

    def problems(self) -> list[str]:
        return [] if self.path.endswith(".jsonl") else [f"path: {self.path} is not a .jsonl file"]

    def problems_with(self, model: ModelFacts) -> list[str]:
        if model.max_seq_len is not None and self.max_seq_len > model.max_seq_len:
            return [f"max_seq_len: longer than the model's {model.max_seq_len}"]
        return []


def build_jsonl_loader(options: JsonlLoaderOptions, tokenizer, device_batch_size):
    return options, tokenizer, device_batch_size


@pytest.fixture
def jsonl_loader():
    registry.dataloaders.register("test_jsonl", build_jsonl_loader)
    yield
    registry.dataloaders.unregister("test_jsonl")


def test_a_plugin_section_is_checked_against_its_dataclass(jsonl_loader):
    model = {"name": "mpt_causal_lm", "max_seq_len": 64}
    loader = {"name": "test_jsonl", "path": "x.txt", "max_seq_len": 0, "sid": "left",
              "norm": "rmsnrm", "windows": {"a": {"size": -1}, "b": 3}}
    found = component_problems({"model": model, "train_loader": loader})
    assert found == [
        "train_loader.max_seq_len: expected an integer > 0, got 0",
        "train_loader.sid: unknown option of the 'test_jsonl' dataloader (did you mean 'side'?)",
        "train_loader.norm: unknown name 'rmsnrm' in registry 'norms' (did you mean 'rmsnorm'?); "
        "use one of layernorm, rmsnorm",
        "train_loader.windows.a.size: expected an integer > 0, got -1",
        "train_loader.windows.b: expected a mapping (key: value lines), got 3",
        "train_loader.path: x.txt is not a .jsonl file",  # rules run beside the field problems
    ]
    loader = {"name": "test_jsonl", "path": "x.jsonl", "max_seq_len": 128, "side": "up"}
    assert component_problems({"model": model, "train_loader": loader}) == [
        "train_loader.side: expected left or right, got 'up'",
        "train_loader.max_seq_len: longer than the model's 64",
    ]


def test_the_builder_passes_an_instance(jsonl_loader):
    section = {"name": "test_jsonl", "path": "x.jsonl", "max_seq_len": 8, "windows": {"a": {"size": 2}}}
    options, tokenizer, batch = build_component("dataloaders", section, tokenizer="tok",
                                                device_batch_size=4)
    assert options == JsonlLoaderOptions(path="x.jsonl", max_seq_len=8, windows={"a": Window(2)})
    assert (tokenizer, batch) == ("tok", 4)


def test_python_callers_get_every_problem_in_one_error():
    with pytest.raises(ConfigError) as info:
        coerce(JsonlLoaderOptions, {"max_seq_len": "8", "pth": "x"}, owner="the 'jsonl' loader")
    assert info.value.problems == [
        "max_seq_len: expected an integer, got '8'",
        "pth: unknown option of the 'jsonl' loader (did you mean 'path'?)",
        "path: missing; a .jsonl file",
    ]


def test_components_without_a_dataclass_get_signature_checks():
    found = component_problems({"optimizer": {"name": "adamw", "lr": 1e-3, "betass": [0.9, 0.95]}})
    assert len(found) == 1 and found[0].startswith("optimizer.betass: unknown option for 'adamw'")
    assert "did you mean 'betas'" in found[0]
