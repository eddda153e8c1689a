"""In-context-learning evaluation (see docs/eval.md).

- ``task_config``, ``task_types``, ``examples``, ``prompts``, ``encode``: task entries, the
  ``icl_tasks`` registry entries, jsonl reading, few-shot prompts, tokenization by offsets;
- ``data``, ``metrics``: prepared tasks, dataloaders and the ``metrics`` registry entries;
- ``gauntlet``: categories, baselines, weighting and averages;
- ``evaluators``: ICL evaluators and the gauntlet callback inside training;
- ``config``, ``models``, ``runner``, ``run``, ``report``, ``compare``: standalone eval
  (``foundryx eval``), results files and the convergence check;
- ``quickstart_tasks``: tasks built from the quickstart corpus's facts.
"""
