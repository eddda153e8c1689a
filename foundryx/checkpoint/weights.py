"""``load_model_weights``: the full model state dict from a checkpoint, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata

from foundryx.checkpoint.layout import DCP_DIR, Manifest, resolve_checkpoint
from foundryx.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from foundryx.checkpoint.verify import raise_problems, verify_files
from foundryx.errors import CheckpointError

MODEL_KEY = "model"  # top-level key of the model in the DCP state dict (next to "optim")


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

    try:
        load(state, storage_reader=SafeFileSystemReader(str(dcp_dir)), planner=SafeLoadPlanner(),
             no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{dcp_dir}: cannot read the model tensors ({_first_line(e)})") from None
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
