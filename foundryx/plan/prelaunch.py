"""The check ``foundryx train`` runs before it builds anything on a GPU: the plan of this run on
this GPU, one log line, and a stop with the plan's suggestions when it does not fit
(``plan_check: false`` turns it off)."""

from __future__ import annotations

import logging
import os

from foundryx.config.load import LoadedConfig
from foundryx.errors import ConfigError
from foundryx.plan.census import MODELS
from foundryx.plan.gpus import GiB
from foundryx.plan.planner import Plan, plan_loaded

log = logging.getLogger(__name__)


def gpu_facts() -> tuple[str, int, str]:
    """(device name, total memory in bytes, cuda or rocm) of this process's GPU."""
    import torch  # here: the check runs only on a GPU

    return (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory,
            "rocm" if torch.version.hip else "cuda")


def check_fits(loaded: LoadedConfig, facts: tuple[str, int, str] | None = None) -> Plan | None:
    """Plan ``loaded`` on this GPU (``facts``: name, bytes, kind; default: this process's GPU);
    log the estimate; raise ConfigError with the suggestions when it does not fit."""
    name = loaded.cfg.model.get("name")
    if name not in MODELS:
        log.info("plan: no pre-launch estimate for model %r (the planner sizes %s)", name,
                 " and ".join(sorted(MODELS)))
        return None
    device, capacity, kind = facts or gpu_facts()
    plan = plan_loaded(loaded, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device, kind, device,
                       capacity)
    need, have = plan.per_device_bytes / GiB, capacity / GiB
    log.info("plan: estimated peak %.1f GiB per device of %.1f GiB on %s, headroom %.1f GiB "
             "(`foundryx plan` shows each term)", need, have, device, have - need)
    if plan.fits:
        return plan
    problems = [f"plan_check: the run needs an estimated {need:.1f} GiB per device and the "
                f"{device} has {have:.1f} GiB; it would run out of memory"]
    problems += [f"plan_check: fix: {s.change} -> {s.per_device_bytes / GiB:.1f} GiB "
                 f"({s.overrides})" for s in plan.suggestions[:4]]
    problems.append("plan_check: `foundryx plan CONFIG` shows every term; plan_check: false "
                    "starts the run anyway")
    raise ConfigError(problems, source=loaded.source)
