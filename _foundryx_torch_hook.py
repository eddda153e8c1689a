"""torch's device-backend entry point for foundryx (pyproject.toml, ``torch.backends``): torch
calls :func:`autoload` at the end of every ``import torch``, in every process of an
environment where foundryx is installed. Outside foundryx's package on purpose: only in
Composer's launcher (the ``composer`` command) does it import foundryx
(:mod:`foundryx.composer_launcher`, the launcher's signal handling); any other process, a
plain transformers + peft script included, imports nothing of foundryx through it.
``FOUNDRYX_LAUNCHER=0`` or ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def autoload() -> None:
    """foundryx.composer_launcher.autoload in the ``composer`` command; elsewhere nothing."""
    if os.environ.get("FOUNDRYX_LAUNCHER") == "0":
        return
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if Path(script).name != "composer" or Path(sys.argv[0] if sys.argv else "").name != "composer":
        return
    try:  # torch turns any error here into its own, and then no `import torch` works at all
        from foundryx import composer_launcher  # the composer command only (see the module doc)

        composer_launcher.autoload()
    except Exception as e:  # noqa: BLE001 - Composer's launcher then runs as it is, said in one line
        print(f"foundryx: the composer command runs without foundryx's signal handling ({type(e).__name__}: "
              f"{e}); FOUNDRYX_LAUNCHER=0 turns it off", file=sys.stderr)
