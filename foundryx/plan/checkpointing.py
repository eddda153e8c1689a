"""``activation_checkpointing.mode: auto``: selective checkpointing where the run's planned
peak with it fits the device, else full (issue 51). The same terms and the same "fits" as
``foundryx plan`` (the planned peak, its 10% allocator margin and 1 GiB context included, at
most the device's memory); on a CPU device: full."""

from __future__ import annotations

from dataclasses import dataclass, replace

from foundryx.config.load import LoadedConfig
from foundryx.plan.memory import GiB, full_checkpointing, terms
from foundryx.plan.settings import Planned, plan_setup


@dataclass(frozen=True)
class ModeChoice:
    """The mode ``auto`` takes, the planned peaks per device it was chosen on, and its line."""

    mode: str  # full | selective
    selective_bytes: int | None  # None: not planned (a CPU device)
    full_bytes: int | None
    line: str
    planned: Planned | None = None  # the run planned in that mode (None: a CPU device)


def with_mode(loaded: LoadedConfig, mode: str) -> LoadedConfig:
    """``loaded`` with ``activation_checkpointing.mode`` set to ``mode`` (a copy)."""
    ac = replace(loaded.cfg.activation_checkpointing, mode=mode)
    return replace(loaded, cfg=replace(loaded.cfg, activation_checkpointing=ac))


def is_auto(loaded: LoadedConfig) -> bool:
    ac = loaded.cfg.activation_checkpointing
    return bool(ac.enabled) and ac.mode == "auto"


def choose_mode(loaded: LoadedConfig, per_node: int, kind: str, capacity: int, device: str,
                tp: int | None = None) -> ModeChoice:
    """What ``mode: auto`` picks for ``loaded`` on a device of ``kind`` (cuda, rocm, cpu) with
    ``capacity`` bytes (``device``: its name, for the line), ``per_node`` processes a node."""
    if kind == "cpu":
        return ModeChoice("full", None, None, "activation_checkpointing.mode: auto -> full (a CPU "
                          "device: selective checkpointing trades memory for GPU time; mode: "
                          "selective asks for it)")
    # one plan: the modes differ only in what a checkpointed block keeps (Setup's ac_selective
    # and selective_kept)
    selective = plan_setup(with_mode(loaded, "selective"), loaded.derived.world_size, per_node,
                           kind, tp)
    planned = {"selective": selective,
               "full": replace(selective, setup=full_checkpointing(selective.setup))}
    need = {mode: sum(terms(p.census, p.setup).values()) for mode, p in planned.items()}
    fits = need["selective"] <= capacity
    sel, full, cap = need["selective"] / GiB, need["full"] / GiB, capacity / GiB
    if fits:
        line = (f"activation_checkpointing.mode: auto -> selective (planned peak {sel:.1f} GiB "
                f"fits the {device}'s {cap:.1f} GiB; full would be {full:.1f} GiB with more "
                "recompute)")
    else:
        line = (f"activation_checkpointing.mode: auto -> full (selective's planned peak {sel:.1f} "
                f"GiB does not fit the {device}'s {cap:.1f} GiB; full: {full:.1f} GiB)")
    mode = "selective" if fits else "full"
    return ModeChoice(mode, need["selective"], need["full"], line, planned[mode])
