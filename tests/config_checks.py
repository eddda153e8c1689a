"""What the config validator says of one component section, as tests want it."""

from __future__ import annotations

from foundryx.config.components import COMPONENT_SECTIONS, component_problems

_REGISTRY_SECTION = {"dataloaders": "train_loader", **{r: s for s, r in COMPONENT_SECTIONS.items()
                                                       if r != "dataloaders"}}


def section_problems(registry: str, name: str, options: dict) -> list[str]:
    """Problems of ``{name: <name>, **options}`` in the section of ``registry`` (paths relative
    to the section), as ``foundryx train --dry-run`` finds them."""
    section = _REGISTRY_SECTION[registry]
    found = component_problems({section: {"name": name, **options}})
    return [p.removeprefix(section + ".") for p in found]
