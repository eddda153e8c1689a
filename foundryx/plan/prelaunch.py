"""The check ``foundryx train`` runs before it builds anything on a GPU: the plan of this run on
this GPU and this node's host memory, one log line, and a stop with the plan's suggestions when
either does not fit (``plan_check: false`` turns it off)."""

from __future__ import annotations

import logging
import os

from foundryx.config.load import LoadedConfig
from foundryx.errors import ConfigError
from foundryx.plan.census import MODELS
from foundryx.plan.gpus import GiB
from foundryx.plan.length import RAN_OUT_WORDS
from foundryx.plan.planner import HostSpec, Plan, plan_loaded, this_machine

log = logging.getLogger(__name__)


def gpu_facts() -> tuple[str, int, str]:
    """(device name, total memory in bytes, cuda or rocm) of this process's GPU."""
    import torch  # here: the check runs only on a GPU

    return (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory,
            "rocm" if torch.version.hip else "cuda")


def check_fits(loaded: LoadedConfig, facts: tuple[str, int, str] | None = None,
               host: HostSpec | None = None) -> Plan | None:
    """Plan ``loaded`` on this GPU (``facts``: name, bytes, kind; default: this process's GPU)
    and this node (``host``; default: this machine's RAM); log the estimate; raise ConfigError
    with the numbers and the fixes when the device or the node's host memory cannot hold it."""
    name = loaded.cfg.model.get("name")
    if name not in MODELS:
        log.info("plan: no pre-launch estimate for model %r (the planner sizes %s)", name,
                 " and ".join(sorted(MODELS)))
        return None
    device, capacity, kind = facts or gpu_facts()
    plan = plan_loaded(loaded, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device, kind, device,
                       capacity, host=host or this_machine())
    need, have = plan.per_device_bytes / GiB, capacity / GiB
    h = plan.host
    log.info("plan: estimated peak %.1f GiB per device of %.1f GiB on %s, headroom %.1f GiB; "
             "host %.1f GiB per node of %.1f GiB (`foundryx plan` shows each term)", need, have,
             device, have - need, h.per_node / GiB, h.capacity / GiB)
    if plan.fits:
        return plan
    problems: list[str] = []
    if not plan.device_fits:
        problems.append(f"plan_check: the run needs an estimated {need:.1f} GiB per device and "
                        f"the {device} has {have:.1f} GiB; it would run out of memory")
        problems += [f"plan_check: fix: {s.change} -> {s.per_device_bytes / GiB:.1f} GiB "
                     f"({s.overrides})" for s in plan.suggestions[:4]]
    if not plan.host_fits:
        problems.append(host_problem(plan))
        problems += [f"plan_check: fix: {f.change} -> {f.per_node_bytes / GiB:.1f} GiB per node "
                     f"({f.overrides})" for f in plan.host_fixes[:5]]
    problems += longest_line(plan)
    problems.append("plan_check: `foundryx plan CONFIG` shows every term; plan_check: false "
                    "starts the run anyway")
    raise ConfigError(problems, source=loaded.source)


def host_problem(plan: Plan) -> str:
    """The host-memory refusal with its numbers: per node, per rank and by phase."""
    h = plan.host
    return (f"plan_check: the run needs an estimated {h.per_node / GiB:.1f} GiB of host memory "
            f"per node ({h.ranks_per_node} rank(s) of {h.per_rank / GiB:.1f} GiB at most: "
            f"loading {h.load_per_rank / GiB:.1f} GiB, training {h.train_per_rank / GiB:.1f} "
            f"GiB) and {h.node} has {h.capacity / GiB:.1f} GiB; the node would run out of memory")


def longest_line(plan: Plan) -> list[str]:
    """The longest sequence the run fits, and what runs out past it (a fix, for a run whose
    length is what does not fit), or nothing when even that does not help."""
    answer = plan.longest_sequence()
    if not answer.seq_len or answer.seq_len >= plan.setup.seq_len * plan.seq_share:
        return []
    return [f"plan_check: fix: the longest sequence that fits is {answer.seq_len:,} tokens "
            f"({plan.seq_key}={answer.seq_len}; {answer.device_bytes / GiB:.1f} GiB per "
            f"device); at {plan.setup.seq_len * plan.seq_share:,} "
            f"{RAN_OUT_WORDS[answer.ran_out]} run out"]
