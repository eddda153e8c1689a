"""Optimizers, as ``optimizers`` registry entries (pyproject.toml): ``decoupled_adamw`` is
:class:`~foundryx.optim.decoupled_adamw.DecoupledAdamW`, Composer's decoupled AdamW whose step
runs torch's multi-tensor kernels on a GPU. Imports nothing of foundryx but ``config``,
``errors`` and ``registry``."""
