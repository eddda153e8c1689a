"""The software stack foundryx runs on, as installed: the packages frozen upstream that are
installed without their caps (pyproject.toml, README "Installing").

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import importlib.util

# The two packages foundryx runs on that are frozen upstream and installed without their caps
# (pyproject.toml): import name -> what to install.
FROZEN = {"composer": "mosaicml==0.32.1", "streaming": "mosaicml-streaming==0.13.0"}


def frozen_missing() -> str | None:
    """The message for a missing Composer or mosaicml-streaming, else None."""
    missing = [pkg for mod, pkg in FROZEN.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    one = len(missing) == 1
    return (f"{' and '.join(missing)} {'is' if one else 'are'} not installed: "
            f"foundryx trains and evaluates through Composer and reads data with "
            f"mosaicml-streaming. Add {'it' if one else 'them'} to this "
            f"environment without {'its' if one else 'their'} upstream caps, so that torch and transformers stay as "
            f"they are: pip install --no-deps {' '.join(missing)}; or install the stack as "
            f"Composer pins it (torch 2.7): pip install 'foundryx[pinned]' (README, Installing)")
