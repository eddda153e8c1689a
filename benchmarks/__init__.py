"""foundryx's benchmarks: each script is a module run from the repository root as
``python -m benchmarks.<name>`` (so it imports this checkout's foundryx and its sibling
modules with no path set-up); the code several of them share is :mod:`benchmarks.instruments`.
Each script is run by a test at a tiny size or by the run book (benchmarks/gpu_runbook.sh);
RESULTS.md holds the current figures, history/ the older ones."""
