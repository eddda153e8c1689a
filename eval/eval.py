"""Evaluate models on ICL tasks: ``composer eval/eval.py eval/yamls/<name>.yaml key=value ...``.

The same as ``foundryx eval``; the composer launcher runs this file once per process.
"""

import sys

from foundryx.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
