"""Export a model (rebuilt from a checkpoint, or a live model's weights) as a Hugging Face
model folder.

Formats: ``llama`` (an MPT configured Llama-style → ``LlamaForCausalLM``, loads with plain
``transformers``), ``mpt`` (any MPT → model_type ``foundryx_mpt``, see
:mod:`foundryx.export.mpt`), and, for every other Hugging Face model (``hf_causal_lm``, a
plugin's), the model's own architecture. ``auto`` picks ``llama`` for a Llama-style MPT, else
``mpt``, and logs why.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from foundryx.checkpoint.layout import EXPORT_DIR, run_folder
from foundryx.checkpoint.lora import read_base
from foundryx.checkpoint.metadata import has_model_record
from foundryx.checkpoint.rebuild import checkpoint_path, rebuild_model
from foundryx.checkpoint.weights import fit_weights
from foundryx.errors import ExportError
from foundryx.export import llama, lora, mpt
from foundryx.export.writer import check_target, save_model_folder, write_atomically
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM

log = logging.getLogger(__name__)

FORMATS = ("auto", "llama", "mpt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ExportSpec:
    """What an export of bare weights needs besides them: the Hugging Face config
    (``MPTConfig`` or any ``PretrainedConfig``), the tokenizer, and where they came from (for
    messages)."""

    config: Any
    tokenizer: Any
    origin: str


def choose_format(config: Any, fmt: str) -> str:
    """``llama``, ``mpt`` or ``hf`` (the model's own architecture) for ``--format fmt``."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if isinstance(config, MPTConfig):
        problems = llama.llama_problems(config)
        if fmt == "llama" and problems:
            raise ExportError("--format llama: this MPT is not Llama-style: " + "; ".join(problems)
                              + ". Export it with --format mpt (or auto) instead")
        if fmt == "auto":
            fmt = "mpt" if problems else "llama"
            why = "not Llama-style: " + "; ".join(problems) if problems else "a Llama-style MPT"
            log.info("export format: %s (%s)", fmt, why)
        return fmt
    if fmt == "mpt":
        raise ExportError(f"--format mpt is for MPT models; this is a {config.model_type!r} model, "
                          "export it with --format auto")
    if fmt == "llama" and config.model_type != "llama":
        raise ExportError(f"--format llama: this is a {config.model_type!r} model; export it with "
                          "--format auto (as its own architecture)")
    return "hf"


def check_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype] if dtype is not None else None


def base_dtype(composer_model: Any) -> str | None:
    """The ``--dtype`` a merged LoRA export takes by default: its base's, as the base's
    config.json records it (``stored_dtype`` of ``hf_causal_lm``), said in one line; None
    (as trained, float32) when the base records none."""
    stored = getattr(composer_model, "stored_dtype", None)
    name = next((k for k, v in DTYPES.items() if v == stored), None)
    if name is not None:
        log.info("export: --merged writes %s, the dtype of the base's weights (--dtype fp32, "
                 "bf16 or fp16 writes another)", name)
    return name


def hf_model_of(composer_model: Any) -> Any:
    """The Hugging Face model (``PreTrainedModel``) a ComposerModel holds as ``.model``."""
    model = getattr(composer_model, "model", None)
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise ExportError(f"{type(composer_model).__name__} holds no Hugging Face model (a `.model` "
                          "with a config); foundryx export writes Hugging Face models")
    return model


def meta_model(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device (no memory, no init)."""
    with torch.device("meta"):
        if isinstance(config, MPTConfig):
            return MPTForCausalLM(config)
        return AutoModelForCausalLM.from_config(config)


def convert(model: torch.nn.Module, fmt: str, dtype: str | None) -> torch.nn.Module:
    """The model to save for format ``fmt`` (``llama``/``mpt``/``hf``), from ``model`` (a
    Hugging Face model holding the weights, changed in place: dtype, MPT auto_map)."""
    if isinstance(model.config, MPTConfig):
        model.config.init_device = "cpu"  # the export loads on a real device
    to = check_dtype(dtype)
    if to is not None:
        model.to(to)
    if fmt == "llama":
        target = meta_model(llama.llama_config(model.config))
        target.load_state_dict(llama.llama_state_dict(model.config, model.state_dict()), assign=True)
        target.tie_weights()
        return target
    if fmt == "mpt":
        mpt.prepare(model)
    return model


def write_export(model: torch.nn.Module, tokenizer: Any, out: str | Path, *, fmt: str,
                 dtype: str | None = None, overwrite: bool = False, progress: bool = True,
                 source: str = "the weights") -> Path:
    """Convert ``model`` (a Hugging Face model holding the weights; ``fmt`` already chosen)
    and write it with ``tokenizer`` as the folder ``out``, atomically."""
    with tqdm(total=2, desc=f"export {Path(out).name}", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"convert to {fmt}")
        model = convert(model, fmt, dtype)
        bar.update()
        bar.set_postfix_str("write safetensors and tokenizer")

        def fill(tmp: Path) -> None:
            save_model_folder(tmp, model, tokenizer)
            if fmt == "mpt":
                mpt.write_code_files(tmp)

        out = write_atomically(out, fill, overwrite)
        bar.update()
    if tokenizer is None:
        log.warning("%s has no tokenizer files: none was given (--tokenizer) or stored", out)
    log.info("exported %s as %s (%s) to %s", source, type(model).__name__, fmt, out)
    return out


def export_weights(state: Mapping[str, torch.Tensor], spec: ExportSpec, out: str | Path, *,
                   fmt: str = "auto", dtype: str | None = None, overwrite: bool = False,
                   progress: bool = True, source: str = "the weights") -> Path:
    """Write ``state`` (a model or ComposerModel state dict) as a Hugging Face folder ``out``."""
    fmt = choose_format(spec.config, fmt)
    check_dtype(dtype)
    check_target(out, overwrite)
    config = copy.deepcopy(spec.config)  # the caller's (maybe a live model's) stays as it is
    if isinstance(config, MPTConfig):
        config.init_device = "cpu"
    model = meta_model(config)
    model.load_state_dict(fit_weights(state, model, source, spec.origin), assign=True)
    model.tie_weights()
    return write_export(model, spec.tokenizer, out, fmt=fmt, dtype=dtype, overwrite=overwrite,
                        progress=progress, source=source)


def default_out(checkpoint: str | Path, *, fmt: str = "auto", merged: bool = False) -> Path:
    """Where ``foundryx export CHECKPOINT`` writes without OUT: the run folder's ``export/``
    (``runs/x/export/hf`` for ``runs/x/checkpoints``; ``export/adapter`` for a LoRA run,
    ``export/merged`` with ``merged``, ``export/<fmt>`` for a format other than auto).
    ExportError when the checkpoint is not in a run folder (a weights file, a URL)."""
    run = run_folder(checkpoint)
    if run is None:
        raise ExportError(f"{checkpoint} is not a checkpoint in a run folder (runs/<name>/"
                          f"<save_folder>), so there is no default output: give one, e.g. "
                          f"foundryx export {checkpoint} exports/my-model")
    if merged:
        kind = "merged"
    elif read_base(checkpoint_path(checkpoint)) is not None:
        kind = "adapter"
    else:
        kind = "hf" if fmt == "auto" else fmt
    return run / EXPORT_DIR / kind


def export_checkpoint(checkpoint: str | Path, out: str | Path | None = None, *,
                      config: str | Path | None = None,
                      overrides: list[str] | None = None, tokenizer: str | None = None,
                      fmt: str = "auto", dtype: str | None = None, overwrite: bool = False,
                      progress: bool = True, verify: bool = True, merged: bool = False) -> Path:
    """Export a checkpoint (folder, save_folder, or weights file) to the folder ``out``.

    The model is rebuilt with :func:`~foundryx.checkpoint.rebuild.rebuild_model`: from
    ``config`` (the run YAML, with dotlist ``overrides``) when given, else from the
    checkpoint's own record; ``tokenizer`` (a folder or hub name) replaces its tokenizer.
    Nothing is read or written before the options are checked. Without ``out``: the run
    folder's ``export/`` (:func:`default_out`).

    A LoRA run's checkpoint is written as a PEFT adapter folder for the base of the chosen
    format, or with ``merged`` as the plain model with the adapters folded in (see
    :mod:`foundryx.export.lora`).
    """
    if out is None:
        out = default_out(checkpoint, fmt=fmt, merged=merged)
        log.info("export: to %s (the run folder's %s/; give OUT to write elsewhere)", out, EXPORT_DIR)
    check_target(out, overwrite)
    check_dtype(dtype)
    path = checkpoint_path(checkpoint)
    if config is None and not has_model_record(path):
        raise ExportError(f"{path} holds no model config (no components.json, no hf/config.json); "
                          f"give the run config it was trained with: foundryx export {checkpoint} "
                          f"{out} --config RUN.yaml")
    chosen: list[str] = []

    def check(model: Any) -> None:  # before reading gigabytes of weights
        chosen.append(choose_format(hf_model_of(model).config, fmt))

    rebuilt = rebuild_model(path, run_config=config, overrides=overrides, tokenizer=tokenizer,
                            verify=verify, check=check)
    model = hf_model_of(rebuilt.model)
    if rebuilt.lora is None:
        if merged:
            raise ExportError(f"--merged: {path} is not a checkpoint of a LoRA run (its model has "
                              "no peft_config); export it without --merged")
    elif merged:
        model = lora.merge_adapters(model)
        dtype = dtype or base_dtype(rebuilt.model)
    else:
        base = (rebuilt.lora_base or {}).get("source")
        return lora.write_adapter(model, rebuilt.lora, rebuilt.tokenizer, out, fmt=chosen[0],
                                  base=base, dtype=check_dtype(dtype), overwrite=overwrite,
                                  source=str(path))
    return write_export(model, rebuilt.tokenizer, out, fmt=chosen[0],
                        dtype=dtype, overwrite=overwrite, progress=progress, source=str(path))
