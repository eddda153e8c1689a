"""Export weights (from a checkpoint or a live model) as a Hugging Face model folder.

Formats: ``llama`` (an MPT configured Llama-style → ``LlamaForCausalLM``, loads with plain
``transformers``), ``mpt`` (any MPT → model_type ``foundryx_mpt``, see
:mod:`foundryx.export.mpt`), and, for ``hf_causal_lm`` models, the model's own architecture.
``auto`` picks ``llama`` for a Llama-style MPT, else ``mpt``, and logs why.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from foundryx.checkpoint.verify import shape_mismatches
from foundryx.errors import CheckpointError, ExportError
from foundryx.export import llama, mpt
from foundryx.export.source import ModelSpec, spec_from_checkpoint, spec_from_run_config
from foundryx.export.writer import check_target, save_model_folder, write_atomically
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM

log = logging.getLogger(__name__)

FORMATS = ("auto", "llama", "mpt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPOSER_PREFIX = "model."  # a ComposerModel holds the Hugging Face model as ``.model``


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


def meta_model(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        if isinstance(config, MPTConfig):
            return MPTForCausalLM(config)
        return AutoModelForCausalLM.from_config(config)


def _shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in state.items()}


def align_weights(state: Mapping[str, torch.Tensor], model: torch.nn.Module, source: str,
                  origin: str) -> dict[str, torch.Tensor]:
    """``state`` keyed as ``model.state_dict()``: the ComposerModel prefix dropped if present,
    tied weights filled from their twin; CheckpointError listing any difference."""
    want = model.state_dict()
    stripped = {k[len(COMPOSER_PREFIX):]: v for k, v in state.items() if k.startswith(COMPOSER_PREFIX)}
    if len(stripped) == len(state) and len(want.keys() & stripped) > len(want.keys() & state):
        state = stripped
    state = dict(state)
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
            + "\nExport it with the run config it was trained with (--config RUN.yaml)."
        )
    return state


def cast(state: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Floating tensors cast to ``dtype`` (fp32/bf16/fp16), keeping shared tensors shared."""
    if dtype is None:
        return state
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    memo: dict[int, torch.Tensor] = {}
    return {k: memo.setdefault(id(v), v.to(DTYPES[dtype]) if v.is_floating_point() else v)
            for k, v in state.items()}


def export_model(state: Mapping[str, torch.Tensor], spec: ModelSpec, fmt: str, dtype: str | None,
                 source: str) -> torch.nn.Module:
    """The model to save for format ``fmt`` (``llama``/``mpt``/``hf``), holding ``state``."""
    config = copy.deepcopy(spec.config)  # the caller's (maybe a live model's) stays as it is
    if isinstance(config, MPTConfig):
        config.init_device = "cpu"  # the export loads on a real device
    model = meta_model(config)
    model.load_state_dict(cast(align_weights(state, model, source, spec.origin), dtype), assign=True)
    model.tie_weights()
    if fmt == "llama":
        target = meta_model(llama.llama_config(config))
        target.load_state_dict(llama.llama_state_dict(config, model.state_dict()), assign=True)
        target.tie_weights()
        return target
    if fmt == "mpt":
        mpt.prepare(model)
    return model


def export_weights(state: Mapping[str, torch.Tensor], spec: ModelSpec, out: str | Path, *,
                   fmt: str = "auto", dtype: str | None = None, overwrite: bool = False,
                   progress: bool = True, source: str = "the weights") -> Path:
    """Write ``state`` (a model or ComposerModel state dict) as a Hugging Face folder ``out``."""
    fmt = choose_format(spec.config, fmt)
    check_target(out, overwrite)
    with tqdm(total=2, desc=f"export {Path(out).name}", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"check and convert to {fmt}")
        model = export_model(state, spec, fmt, dtype, source)
        bar.update()
        bar.set_postfix_str("write safetensors and tokenizer")

        def fill(tmp: Path) -> None:
            save_model_folder(tmp, model, spec.tokenizer)
            if fmt == "mpt":
                mpt.write_code_files(tmp)

        out = write_atomically(out, fill, overwrite)
        bar.update()
    if spec.tokenizer is None:
        log.warning("%s has no tokenizer files: none was given (--tokenizer) or stored", out)
    log.info("exported %s as %s (%s) to %s", source, type(model).__name__, fmt, out)
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, config: str | Path | None = None,
                      overrides: list[str] | None = None, tokenizer: str | None = None,
                      fmt: str = "auto", dtype: str | None = None, overwrite: bool = False,
                      progress: bool = True, verify: bool = True) -> Path:
    """Export a checkpoint (folder, save_folder, or weights file) to the folder ``out``.

    The model config and tokenizer come from ``config`` (the run YAML, with dotlist
    ``overrides``) or from the checkpoint's ``hf/`` folder; ``tokenizer`` (a folder or hub
    name) replaces theirs. Nothing is read or written before the options are checked.
    """
    from foundryx.checkpoint import load_model_weights
    from foundryx.checkpoint.layout import resolve_checkpoint
    from foundryx.data.tokenizers import build_hf_tokenizer

    check_target(out, overwrite)
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder or file")
    if path.is_dir():
        path = resolve_checkpoint(path)
    tok = build_hf_tokenizer(tokenizer) if tokenizer else None
    spec = spec_from_run_config(config, overrides, tok) if config else spec_from_checkpoint(path, tok)
    if spec is None:
        raise ExportError(f"{path} holds no model config (no hf/config.json); give the run config "
                          f"it was trained with: foundryx export {checkpoint} {out} --config RUN.yaml")
    fmt = choose_format(spec.config, fmt)  # before reading gigabytes
    state = load_model_weights(path, verify=verify)
    return export_weights(state, spec, out, fmt="auto" if fmt == "hf" else fmt, dtype=dtype,
                          overwrite=overwrite, progress=progress, source=str(path))
