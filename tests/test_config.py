"""Typed config: overrides, variables, every problem at once with paths and did-you-mean."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from foundryx.config import load_config
from foundryx.errors import ConfigError

QUICKSTART = Path(__file__).parents[1] / "yamls" / "quickstart.yaml"


def write(tmp_path: Path, data: dict, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture
def base(quickstart_data) -> dict:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["variables"]["data_root"] = str(quickstart_data)
    return data


def problems_of(path, overrides=(), world_size=1) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides), world_size=world_size)
    return err.value.problems


def test_quickstart_loads_and_derives(base, tmp_path):
    loaded = load_config(write(tmp_path, base), ["global_train_batch_size=16",
                                                 "device_train_microbatch_size=4"], world_size=2)
    d = loaded.derived
    assert (d.world_size, d.device_train_batch_size, d.device_train_microbatch_size) == (2, 8, 4)
    assert d.grad_accum == 2
    assert d.tokens_per_step == 16 * loaded.cfg.max_seq_len
    assert d.device_eval_batch_size == 16  # the YAML's
    unset = load_config(write(tmp_path, {**base, "device_eval_batch_size": None}, "unset.yaml"),
                        ["global_train_batch_size=16", "device_train_microbatch_size=4"],
                        world_size=2)
    assert unset.derived.device_eval_batch_size == 4  # default: the microbatch


def test_overrides_and_variables(base, tmp_path):
    base["variables"]["lr"] = 0.5
    base["optimizer"]["lr"] = "${variables.lr}"
    loaded = load_config(write(tmp_path, base), ["max_duration=7ba", "variables.lr=0.25",
                                                 "model.n_layers=1"])
    assert loaded.cfg.max_duration == "7ba"
    assert loaded.cfg.optimizer["lr"] == 0.25
    assert loaded.cfg.model["n_layers"] == 1
    assert "variables" not in loaded.resolved


def test_every_problem_reported_at_once(base, tmp_path):
    base["max_duratoin"] = base.pop("max_duration")
    base["global_train_batch_size"] = "ten"
    base["optimizer"]["name"] = "decoupled_adamww"
    base["callbacks"] = {"speed_monitor": {"window_sise": 5}, "lr_monitr": {}}
    base["eval_interval"] = "10 batches"
    base["precision"] = "amp_bf61"
    base["model"]["d_modle"] = 64
    problems = problems_of(write(tmp_path, base))
    text = "\n".join(problems)
    assert "max_duratoin: unknown key (did you mean 'max_duration'?)" in text
    assert "max_duration: missing" in text
    assert "global_train_batch_size: expected an integer, got 'ten'" in text
    assert "optimizer.name:" in text and "did you mean 'decoupled_adamw'" in text
    assert "callbacks.speed_monitor.window_sise: unknown option" in text
    assert "did you mean 'window_size'" in text
    assert "callbacks.lr_monitr:" in text and "did you mean 'lr_monitor'" in text
    assert "eval_interval: expected a duration" in text
    assert "precision:" in text and "did you mean 'amp_bf16'" in text
    assert "model.d_modle" in text and "d_model" in text
    assert len(problems) >= 9


def test_misspelt_override_key(base, tmp_path):
    problems = problems_of(write(tmp_path, base), ["max_durration=5ba", "seed"])
    assert any("max_durration: unknown key (did you mean 'max_duration'?)" in p for p in problems)
    assert any("override 'seed': expected key=value" in p for p in problems)


def test_unresolvable_interpolation_names_the_path(base, tmp_path):
    base["optimizer"]["lr"] = "${variables.no_such_thing}"
    problems = problems_of(write(tmp_path, base))
    assert any(p.startswith("optimizer.lr: cannot resolve interpolation") for p in problems)


def test_missing_file_and_bad_yaml(tmp_path):
    assert "no such config file" in problems_of(tmp_path / "nope.yaml")[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "not valid YAML" in problems_of(bad)[0]
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    assert "top level must be a mapping" in problems_of(scalar)[0]


def test_batch_not_divisible_by_world_size(base, tmp_path):
    base["global_train_batch_size"] = 10
    (p,) = problems_of(write(tmp_path, base), world_size=4)
    assert p.startswith("global_train_batch_size: 10 does not divide by the world size 4")
    assert "e.g. 12" in p
    # a resume keeps the saved global batch: the process counts that can
    assert p.endswith("start a number of processes that keeps it: 1, 2, 5, 10 (a resume must "
                      "keep the saved global batch)"), p


def test_microbatch_must_divide_device_batch(base, tmp_path):
    (p,) = problems_of(write(tmp_path, base), ["global_train_batch_size=16",
                                               "device_train_microbatch_size=3"])
    assert p.startswith("device_train_microbatch_size: 3 must be positive and divide")


def test_batch_sizes_must_be_positive_all_reported_at_once(base, tmp_path):
    """Values the docs rule out are refused, never silently replaced (0 once meant 'whole batch')."""
    problems = problems_of(write(tmp_path, base), ["device_train_microbatch_size=0",
                                                   "device_eval_batch_size=-1",
                                                   "global_train_batch_size=0"])
    assert sorted(problems) == [
        "device_eval_batch_size: expected an integer > 0, got -1",
        "device_train_microbatch_size: expected an integer > 0, got 0",
        "global_train_batch_size: expected an integer > 0, got 0",
    ]


def test_missing_data_folder(base, tmp_path):
    base["train_loader"]["dataset"]["local"] = str(tmp_path / "no-data")
    problems = problems_of(write(tmp_path, base))
    assert any(p.startswith("train_loader.dataset.local:") and "no-data" in p for p in problems)


AUTO_MICROBATCH_MESSAGE = (
    "device_train_microbatch_size: 'auto' is not supported: Composer's auto-microbatching finds "
    "a size by running out of memory, which hangs distributed jobs, and fails on torch >= 2.7.1; "
    "set an integer that divides the per-device batch, or leave the key out for the whole "
    "per-device batch"
)


def test_auto_microbatch_is_one_clear_problem(base, tmp_path):
    """LLM Foundry's ``auto`` is refused on every torch with the reason and the fix, in one
    line, not as a wrong type."""
    assert problems_of(write(tmp_path, base), ["device_train_microbatch_size=auto"]) == [
        AUTO_MICROBATCH_MESSAGE]
    base["device_train_microbatch_size"] = "auto"
    assert problems_of(write(tmp_path, base)) == [AUTO_MICROBATCH_MESSAGE]
    # other wrong values keep the type message
    (p,) = problems_of(write(tmp_path, base), ["device_train_microbatch_size=automatic"])
    assert p == "device_train_microbatch_size: expected an integer or null, got 'automatic'"


def test_auto_microbatch_on_the_command_line_exits_2(quickstart_data, capsys):
    from foundryx.cli import main

    code = main(["train", "--dry-run", str(QUICKSTART), f"variables.data_root={quickstart_data}",
                 "device_train_microbatch_size=auto"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[1:] == [f"  - {AUTO_MICROBATCH_MESSAGE}"], err
