"""The run book's own modules (benchmarks/gpu_runbook.sh runs them as ``python -m
benchmarks.gpu_runbook.<name>``): ``report`` (the environment, the probe of what imports, the
report's tables) and ``icl`` (step 3: the ICL eval on the GPU against the CPU)."""
