"""The non-tensor training state as JSON: timestamp, schedulers, data position, RNG.

Model and optimizer tensors go through torch.distributed.checkpoint; everything else a
resumed run needs is small, and stored here as plain JSON so loading it runs no code.
"""

from __future__ import annotations

import base64
import datetime
import logging
import random
from typing import Any

import numpy as np
import torch

from foundryx.errors import CheckpointError

log = logging.getLogger(__name__)
_WCT = ("total_wct", "iteration_wct", "epoch_wct", "batch_wct")


def train_dataset(state: Any) -> Any:
    loader = state.train_dataloader
    return getattr(loader, "dataset", None)


def capture(state: Any) -> dict[str, Any]:
    """The JSON-able training state of a Composer ``State`` (rank 0 writes it)."""
    ts = state.timestamp.state_dict()
    for k in _WCT:
        if isinstance(ts.get(k), datetime.timedelta):
            ts[k] = ts[k].total_seconds()
    out: dict[str, Any] = {
        "timestamp": ts,
        "schedulers": [s.state_dict() for s in state.schedulers],
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "rank_zero_seed": state.rank_zero_seed,
        "dataset": None,
    }
    dataset = train_dataset(state)
    if callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None)):
        out["dataset"] = _at_epoch_start(dataset.state_dict(int(state.timestamp.sample_in_epoch), True),
                                         state.timestamp)
    return out


def _at_epoch_start(data: Any, timestamp: Any) -> Any:
    """A streaming dataset's state at an epoch's start (a checkpoint written as an epoch ends):
    it still names the epoch it finished (it counts an epoch when its next one is iterated);
    the timestamp's, which has moved on, is the one to resume."""
    if (isinstance(data, dict) and isinstance(data.get("epoch"), int)
            and int(timestamp.batch_in_epoch) == 0 and data["epoch"] < int(timestamp.epoch)):
        data = {**data, "epoch": int(timestamp.epoch), "sample_in_epoch": 0}
    return data


def restore(state: Any, data: dict[str, Any], weights_from: str) -> None:
    """Put a captured training state back into a Composer ``State``."""
    ts = dict(data["timestamp"])
    for k in _WCT:
        if isinstance(ts.get(k), (int, float)):
            ts[k] = datetime.timedelta(seconds=ts[k])
    state.timestamp.load_state_dict(ts)
    if len(data["schedulers"]) != len(state.schedulers):
        raise CheckpointError(
            f"{weights_from}: saved with {len(data['schedulers'])} LR scheduler(s), this run has "
            f"{len(state.schedulers)}; resume with the same scheduler section"
        )
    for sched, sd in zip(state.schedulers, data["schedulers"]):
        sched.load_state_dict(sd)
    if data.get("scaler") is not None and state.scaler is not None:
        state.scaler.load_state_dict(data["scaler"])
    dataset = train_dataset(state)
    if data.get("dataset") is not None and callable(getattr(dataset, "load_state_dict", None)):
        dataset.load_state_dict(data["dataset"])
        state.dataset_resumption["train"] = True  # Composer then does not skip batches itself
    elif int(state.timestamp.batch_in_epoch):
        log.info("the train dataset has no saved position; Composer skips %d batches to resume",
                 int(state.timestamp.batch_in_epoch))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and CUDA) RNG states as JSON."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(data: dict[str, Any]) -> None:
    version, internal, gauss = data["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = data["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(data["torch"]))
    if data.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in data["cuda"]])
