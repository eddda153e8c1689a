"""``load_model_weights``: the full model state dict from a checkpoint, in one process; and
``fit_weights``: such a state dict keyed as a given model (the one place that adds or drops
the ``model.`` prefix of Hugging Face ComposerModels)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata

from foundryx.checkpoint.layout import DCP_DIR, Manifest, resolve_checkpoint
from foundryx.checkpoint.safe_dcp import (
    DCP_ERRORS,
    SafeFileSystemReader,
    SafeLoadPlanner,
    dcp_error_text,
    read_metadata,
)
from foundryx.checkpoint.verify import raise_problems, shape_mismatches, verify_files
from foundryx.errors import CheckpointError

MODEL_KEY = "model"  # top-level key of the model in the DCP state dict (next to "optim")
WRAPPER_PREFIX = "model."  # a Hugging Face ComposerModel holds its PreTrainedModel as ``.model``


def model_tensor_shapes(meta: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{model key: (global shape, dtype)}`` of the model tensors in DCP metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = MODEL_KEY + "."
    return {
        key[len(prefix):]: (tuple(md.size), md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def load_model_weights(path: str | Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on CPU, read by one process.

    ``path``: a foundryx checkpoint folder, its ``manifest.json``, a save_folder (its newest
    complete checkpoint), a ``.safetensors`` file, or a ``.pt``/``.bin`` weights file (a plain
    state dict, or a Composer checkpoint's ``state.model``). Keys are those of the trained
    ComposerModel's ``state_dict()`` (for Hugging Face wrappers they start with ``model.``).
    No pickled code runs: DCP metadata is read with an allow-list and ``torch.load`` uses
    ``weights_only=True``. With ``verify`` the checkpoint's files are checked against its
    manifest first. Raises :class:`CheckpointError` naming the file on any problem.
    """
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p), device="cpu")
    if p.is_file() and p.suffix in (".pt", ".pth", ".bin"):
        return _load_torch_file(p)
    folder = resolve_checkpoint(p)
    if verify:
        raise_problems(folder, verify_files(folder, Manifest.read(folder)))
    dcp_dir = folder / DCP_DIR
    shapes = model_tensor_shapes(read_metadata(dcp_dir))
    if not shapes:
        raise CheckpointError(f"{dcp_dir / '.metadata'}: holds no model tensors")
    state = {f"{MODEL_KEY}.{k}": torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    from torch.distributed.checkpoint import load

    reader = SafeFileSystemReader(str(dcp_dir))
    try:
        load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except DCP_ERRORS as e:
        raise CheckpointError(f"{reader.where()}: cannot read the model tensors "
                              f"({dcp_error_text(e)}); the checkpoint is damaged: use an earlier "
                              "one") from None
    return {k[len(MODEL_KEY) + 1:]: v for k, v in state.items()}


def _load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: cannot load with weights_only=True ({_first_line(e)}); foundryx does not "
            "execute pickled code from checkpoints"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state"), dict) and "model" in obj["state"]:
        obj = obj["state"]["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return dict(obj)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def match_prefix(weights: Mapping[str, Any], expected: Iterable[str]) -> dict[str, Any]:
    """``weights`` with the ComposerModel's ``model.`` prefix added (a bare Hugging Face state
    dict loaded into a ComposerModel) or dropped (a ComposerModel's state dict loaded into its
    Hugging Face model) when that makes more keys match ``expected``."""
    expected = set(expected)
    best, hits = dict(weights), len(expected & weights.keys())
    dropped = {k[len(WRAPPER_PREFIX):]: v for k, v in weights.items() if k.startswith(WRAPPER_PREFIX)}
    added = {WRAPPER_PREFIX + k: v for k, v in weights.items()}
    for candidate in (dropped if len(dropped) == len(weights) else None, added):
        if candidate is not None and len(expected & candidate.keys()) > hits:
            best, hits = candidate, len(expected & candidate.keys())
    return best


def fit_weights(weights: Mapping[str, torch.Tensor], model: torch.nn.Module, source: str,
                origin: str) -> dict[str, torch.Tensor]:
    """``weights`` keyed as ``model.state_dict()``: prefix matched (:func:`match_prefix`), tied
    weights filled from their twin. CheckpointError naming ``source`` (the weights) and
    ``origin`` (where the model's description came from) and listing the differences."""
    want = model.state_dict()
    state = match_prefix(weights, want)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():
        have = [n for n in names if n in state]
        for n in names:
            if have and n not in state:
                state[n] = state[have[0]]
    problems = shape_mismatches(_shapes(want), _shapes(state))
    if problems:
        raise CheckpointError(
            f"{source} does not match the model config from {origin}:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nGive the run config it was trained with (`foundryx export --config RUN.yaml`, "
            "run_config in an eval config)."
        )
    return state


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in state.items() if isinstance(v, torch.Tensor)}
