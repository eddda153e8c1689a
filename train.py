"""Train from a run config: ``composer train.py yamls/quickstart.yaml key=value ...``.

The same as ``foundryx train``; the composer launcher runs this file once per process.
"""

import sys

from foundryx.cli import run

if __name__ == "__main__":
    run(["train", *sys.argv[1:]])
