"""The benchmarks' shared instruments, imported by the scripts beside this package and by
the tests: ``fake_step`` (one training step built and run on fake tensors, no weight
allocated: what the CPU instruments measure), ``step_memory`` (device memory by category under
fake tensors), ``step_profile`` (one profiled step: top kernels, allocator peak sites, state
bytes), ``report_out`` (print a result section and append it to ``--out``) and
``recipe_sizes`` (the sizes and tiny models at which every recipe runs on 2 CPU ranks: the
2-rank test's, and plan_vs_run's)."""
