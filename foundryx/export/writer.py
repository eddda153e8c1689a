"""Writing a Hugging Face model folder atomically: safetensors, config.json,
generation_config.json and tokenizer files appear together or not at all."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from foundryx.checkpoint.metadata import save_tokenizer
from foundryx.errors import ExportError
from foundryx.runtime.atomic_writes import replace_all
from foundryx.runtime.file_modes import give_usual_modes


def replaceable(out: Path) -> bool:
    """An existing ``out`` may be replaced only if it is an empty folder or a model folder."""
    return out.is_dir() and (not any(out.iterdir()) or (out / "config.json").is_file()
                             or (out / "adapter_config.json").is_file())


def check_target(out: str | Path, overwrite: bool) -> Path:
    """``out`` as a Path, or ExportError when it exists and may not (or cannot) be replaced."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ExportError(f"{out} already exists; choose another folder or pass --overwrite "
                              "(overwrite: true in the callback)")
        if not replaceable(out):
            raise ExportError(f"{out} exists and is not a model folder (no config.json); "
                              "refusing to replace it, choose another folder")
    return out


def write_atomically(out: str | Path, fill: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run ``fill(tmp)`` on a temporary sibling folder of ``out``, then rename it to ``out``
    (replacing an older export when ``overwrite``), its files and folders given the modes the
    umask gives any (``0o644``/``0o755`` under umask 022). On any error nothing is left behind and
    ``out`` is as it was; a failed write (full disk, no permission) is an ExportError naming
    ``out``."""
    out = check_target(out, overwrite)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        fill(tmp)
        give_usual_modes(tmp)  # mkdtemp's 0o700, safetensors' 0o600: readable as any file is
        replace_all([(tmp, out)])
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            kept = "the previous export there is unchanged" if out.exists() else "nothing was written"
            raise ExportError(f"could not write the export to {out} ({e.strerror or e}); {kept}. "
                              "Free space or fix the folder's permissions and export again") from e
        raise
    return out


def set_special_tokens(model: Any, tokenizer: Any) -> None:
    """Copy the tokenizer's bos/eos/pad ids into the model config and generation config."""
    if tokenizer is None:
        return
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            setattr(model.config, name, value)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, name, value)


def save_model_folder(folder: Path, model: Any, tokenizer: Any, max_shard_size: str = "5GB") -> None:
    """``save_pretrained`` of model (safetensors) and tokenizer into ``folder`` (the tokenizer
    as :func:`~foundryx.checkpoint.metadata.save_tokenizer` saves it)."""
    set_special_tokens(model, tokenizer)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)  # model_input_names without token_type_ids
