"""``python -m foundryx.cli``: the ``foundryx`` command."""

from foundryx.cli import run

run()
