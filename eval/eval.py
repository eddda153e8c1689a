"""Evaluate models on ICL tasks: ``composer eval/eval.py eval/yamls/<name>.yaml key=value ...``.

The same as ``foundryx eval``; the composer launcher runs this file once per process.
"""

import sys

from foundryx.cli import run

if __name__ == "__main__":
    run(["eval", *sys.argv[1:]])
