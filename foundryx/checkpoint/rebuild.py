"""``rebuild_model``: the model of a checkpoint, built through the ``models`` registry and
holding the checkpoint's weights. ``foundryx export``, ``foundryx eval`` and the tests get a
model back from a checkpoint this one way.

The model's description comes from, in order:

1. a run config the caller gives (``run_config`` and ``overrides``): its ``model`` and
   ``tokenizer`` sections;
2. the checkpoint's ``components.json``: the sections the Checkpointer recorded, so a
   plugin's model is rebuilt by its registry name like a built-in one;
3. the checkpoint's ``hf/config.json`` (checkpoints of older foundryx versions, or when the
   recorded section cannot be built here, e.g. its pretrained folder is gone; one log line
   says so): that Hugging Face model, as a Composer ``HuggingFaceModel``.

The tokenizer is the caller's, else the run config's, else the copy saved in ``hf/``, else
the recorded tokenizer section built through the ``tokenizers`` registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import foundryx.models.mpt.modeling  # noqa: F401  (registers foundryx_mpt with the Auto classes)
from foundryx.checkpoint.layout import MANIFEST, resolve_checkpoint
from foundryx.checkpoint.lora import lora_options, read_base, with_base
from foundryx.checkpoint.metadata import COMPONENTS, METADATA_DIR, metadata_folder, read_components
from foundryx.checkpoint.remote import fetch, is_remote
from foundryx.checkpoint.weights import fit_weights, load_model_weights
from foundryx.config.components import build_component, component_problems
from foundryx.config.load import precheck_sections
from foundryx.errors import CheckpointError, ConfigError, FoundryxError
from foundryx.loading import load as load_pretrained
from foundryx.loading import prepare as prepare_pretrained
from foundryx.loading import wants_pretrained
from foundryx.models.composer_base import CausalLMBase
from foundryx.models.peft.lora import apply_lora
from foundryx.parallel.materialize import has_meta, init_meta
from foundryx.runtime.hf_compat import no_init_weights

log = logging.getLogger(__name__)


@dataclass
class RebuiltModel:
    """A checkpoint's model with its weights, in eval mode."""

    model: Any  # the ComposerModel (``model.model`` is the Hugging Face model, when it has one)
    tokenizer: Any  # None when no tokenizer was given, saved or recorded
    checkpoint: Path  # the checkpoint folder or weights file the weights came from
    origin: str  # where the model's description came from, for messages
    lora: Any = None  # a LoRA run's LoraOptions (its adapters are in ``model``), else None
    lora_base: dict[str, Any] | None = None  # a LoRA checkpoint's lora_base.json


def checkpoint_path(checkpoint: str | Path) -> Path:
    """A checkpoint folder (from itself, its manifest or a save_folder) or a weights file; an
    ``s3://`` one is downloaded (verified) into the local cache first."""
    if is_remote(checkpoint):
        return fetch(str(checkpoint))
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder or file")
    return resolve_checkpoint(path) if path.is_dir() or path.name == MANIFEST else path


def run_config_sections(path: str | Path, overrides: list[str] | None = None,
                        with_tokenizer: bool = True) -> dict[str, Any]:
    """The resolved ``model`` (and ``tokenizer``) sections of a run YAML, checked as
    ``load_config`` checks them; the rest of the config (data folders that may live on
    another machine, batch sizes, ...) is not needed to rebuild a model and not checked."""
    sections = precheck_sections(path, overrides, ("model", "tokenizer") if with_tokenizer
                                 else ("model",))
    problems = component_problems(sections)
    if problems:
        raise ConfigError(problems, source=str(path))
    return sections


def build_tokenizer(spec: Any) -> Any:
    """A tokenizer from a section (``{name: <tokenizers key>, ...}``), from a folder or hub
    name (the ``hf`` tokenizer), or a tokenizer object (returned as is); None for None."""
    if isinstance(spec, str):
        spec = {"name": "hf", "path": spec}
    return build_component("tokenizers", spec) if isinstance(spec, dict) else spec


def saved_tokenizer(meta: Path | None) -> Any:
    """The tokenizer saved in a checkpoint's ``hf/`` folder, or None when there is none."""
    if meta is None or not (meta / "tokenizer_config.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(meta, local_files_only=True)


def wrap_hf_model(model: Any, tokenizer: Any) -> Any:
    """A Hugging Face ``PreTrainedModel`` (causal LM) as a Composer model that ICL eval can run."""
    return CausalLMBase(model=model, tokenizer=tokenizer, use_logits=True, eval_metrics=[])


def _from_hf_folder(meta: Path, tokenizer: Any) -> Any:
    try:
        config = AutoConfig.from_pretrained(meta, local_files_only=True)
    except (OSError, ValueError) as e:  # invalid JSON; an auto_map that needs remote code
        raise CheckpointError(f"{meta / 'config.json'}: cannot rebuild the model from it "
                              f"({_first_line(e)}); give the run config it was trained with "
                              "(export: --config RUN.yaml)") from None
    if getattr(config, "init_device", "cpu") != "cpu":
        config.init_device = "cpu"  # an MPT trained from meta: the weights are loaded next
    return wrap_hf_model(AutoModelForCausalLM.from_config(config), tokenizer)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def describe_and_build(path: Path, run_config: str | Path | None = None,
                       overrides: list[str] | None = None, tokenizer: Any = None
                       ) -> tuple[Any, Any, str]:
    """``(model with fresh weights, tokenizer, origin)`` of the checkpoint at ``path`` (see the
    module doc for where each comes from)."""
    if run_config is not None:
        sections = run_config_sections(run_config, overrides, with_tokenizer=tokenizer is None)
        tok = build_tokenizer(tokenizer if tokenizer is not None else sections["tokenizer"])
        model = build_component("models", sections["model"], tokenizer=tok)
        return model, tok, f"model section of {run_config}"
    recorded, meta = read_components(path), metadata_folder(path)
    if recorded is None and meta is None:
        raise CheckpointError(
            f"{path}: holds no record of its model (no {COMPONENTS} and no {METADATA_DIR}/ "
            "folder: a bare weights file, or a checkpoint not written by foundryx); give the "
            "run config it was trained with")
    tok = build_tokenizer(tokenizer) if tokenizer is not None else saved_tokenizer(meta)
    if recorded is not None:
        record, where = recorded
        if tok is None:
            tok = build_tokenizer(record.get("tokenizer"))
        try:
            return build_component("models", record["model"], tokenizer=tok), tok, str(where)
        except FoundryxError as e:
            if meta is None:
                raise
            log.warning("%s: cannot build the recorded model here (%s); rebuilding it from %s "
                        "instead", where, _first_line(e), meta / "config.json")
    else:
        log.info("%s holds no %s (saved by an older foundryx); rebuilding the model from %s",
                 path, COMPONENTS, meta / "config.json")
    return _from_hf_folder(meta, tok), tok, str(meta / "config.json")


def _model_section(path: Path, run_config: str | Path | None,
                   overrides: list[str] | None) -> dict[str, Any] | None:
    """The model section the model was built from (run config, else the recorded one)."""
    if run_config is not None:
        return run_config_sections(run_config, overrides, with_tokenizer=False)["model"]
    recorded = read_components(path)
    return recorded[0]["model"] if recorded is not None else None


def rebuild_model(checkpoint: str | Path, *, run_config: str | Path | None = None,
                  overrides: list[str] | None = None, tokenizer: Any = None, verify: bool = True,
                  check: Callable[[Any], None] | None = None) -> RebuiltModel:
    """The model of ``checkpoint`` (a checkpoint folder, a save_folder (its newest), or a
    weights file with ``components.json`` or ``hf/`` beside it) with its weights, in eval mode.

    ``run_config`` (a run YAML, with dotlist ``overrides``) replaces the checkpoint's own
    record; ``tokenizer`` (a section, a folder or hub name, or a tokenizer) replaces the
    tokenizer. ``check(model)`` runs before any weights are read (e.g. export's format
    check). With ``verify`` the checkpoint's files are checked against its manifest.
    CheckpointError names the checkpoint and the origin when the weights do not fit.
    """
    path = checkpoint_path(checkpoint)
    with no_init_weights():  # no random init (torch.nn.init, _init_weights): weights come next
        model, tok, origin = describe_and_build(path, run_config, overrides, tokenizer)
        options = lora_options(_model_section(path, run_config, overrides)) if path.is_dir() else None
        if options is not None:  # the adapters' weights come from the checkpoint
            apply_lora(model, options)
        if check is not None:
            check(model)
        folder = wants_pretrained(model)  # init_device: meta with a pretrained folder
        plan = prepare_pretrained(model, folder) if folder else None
        if has_meta(model):  # e.g. init_device: meta; every tensor is overwritten or initialised
            init_meta(model, torch.device("cpu"))
        if plan is not None:  # the base an adapter-only checkpoint was trained on
            load_pretrained(model, plan, torch.device("cpu"))
    weights = load_model_weights(path, verify=verify)
    saved = read_base(path) if path.is_dir() else None
    if saved is not None and saved.get("adapter_only"):
        weights = with_base(model, weights, path, saved)
    state = fit_weights(weights, model, str(path), origin)
    model.load_state_dict(state)
    model.eval()
    return RebuiltModel(model=model, tokenizer=tok, checkpoint=path, origin=origin, lora=options,
                        lora_base=saved)
