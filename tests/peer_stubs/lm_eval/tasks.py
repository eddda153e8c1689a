"""lm-eval's ``TaskManager``, as far as benchmarks/eval_vs_lmeval.py uses it."""


class TaskManager:
    def __init__(self, include_path: str | None = None) -> None:
        self.include_path = include_path
