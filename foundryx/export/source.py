"""What an export needs besides the weights: the model config and the tokenizer.

They come from the run config the checkpoint was trained with (``--config``), or from the
``hf/`` folder that :func:`write_model_metadata` puts inside a checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.errors import ExportError

log = logging.getLogger(__name__)

METADATA_DIR = "hf"  # inside a checkpoint folder: config.json and tokenizer files


@dataclass
class ModelSpec:
    """A model config (``MPTConfig`` or any ``PretrainedConfig``), its tokenizer, and where
    they came from (for messages)."""

    config: Any
    tokenizer: Any
    origin: str


def read_model_sections(path: str | Path, overrides: list[str] | None, with_tokenizer: bool
                        ) -> dict[str, Any]:
    """The resolved ``model`` (and ``tokenizer``) sections of a run YAML, checked like
    ``load_config`` checks them; the rest of the config (data folders that may live on
    another machine, batch sizes, ...) is not needed for an export and not checked."""
    from foundryx.config.components import component_problems
    from foundryx.config.load import read_merged, resolve
    from foundryx.errors import ConfigError

    merged, problems = read_merged(path, overrides)
    names = ("model", "tokenizer") if with_tokenizer else ("model",)
    sections = {name: resolve(merged.get(name), name, problems) for name in names}
    problems += [f"{name}: missing; the export needs it" for name in names
                 if not isinstance(sections[name], dict)]
    problems += component_problems({k: v for k, v in sections.items() if isinstance(v, dict)})
    if problems:
        raise ConfigError(problems, source=str(path))
    return sections


def spec_from_run_config(path: str | Path, overrides: list[str] | None = None,
                         tokenizer: Any = None) -> ModelSpec:
    """The model config and tokenizer of a run YAML (``mpt_causal_lm`` or ``hf_causal_lm``);
    a given ``tokenizer`` replaces the YAML's."""
    from foundryx import builders

    sections = read_model_sections(path, overrides, with_tokenizer=tokenizer is None)
    section = dict(sections["model"])
    name = section.pop("name")
    if tokenizer is None:
        tokenizer = builders.build_component("tokenizers", sections["tokenizer"])
    if name == "mpt_causal_lm":
        from foundryx.models.mpt.configuration import MPTConfig

        config = MPTConfig(**section)
    elif name == "hf_causal_lm":
        from foundryx.models.hf import build_config

        config, _ = build_config(section.get("pretrained_model_name_or_path"), section.get("config"),
                                 section.get("config_overrides") or {},
                                 bool(section.get("trust_remote_code")))
        if section.get("allow_embedding_resizing") and len(tokenizer) > config.vocab_size:
            config.vocab_size = len(tokenizer)  # as Composer resized the embeddings in training
    else:
        raise ExportError(f"{path}: model.name is {name!r}; foundryx export reads models "
                          "mpt_causal_lm and hf_causal_lm")
    return ModelSpec(config, tokenizer, f"model section of {path}")


def write_model_metadata(folder: str | Path, composer_model: Any) -> Path | None:
    """Write ``folder/hf/``: the model's config.json and its tokenizer files, so that
    ``foundryx export`` and ``foundryx eval`` need no run config. Returns the ``hf`` folder, or
    None for a model without a Hugging Face config (a plugin's own ComposerModel); a tokenizer
    without ``save_pretrained`` is left out."""
    config = getattr(getattr(composer_model, "model", None), "config", None)
    if not hasattr(config, "save_pretrained"):
        return None
    out = Path(folder) / METADATA_DIR
    config.save_pretrained(out)
    tokenizer = getattr(composer_model, "tokenizer", None)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    return out


def metadata_folder(checkpoint: str | Path) -> Path | None:
    """The ``hf/`` folder of a checkpoint folder, of the newest checkpoint of a save_folder,
    or beside a weights file; None when there is none (or no checkpoint at all)."""
    from foundryx.checkpoint.layout import resolve_checkpoint
    from foundryx.errors import CheckpointError

    path = Path(checkpoint)
    if path.is_dir() or path.name == "manifest.json":
        try:
            path = resolve_checkpoint(path)
        except CheckpointError:
            return None
    meta = (path if path.is_dir() else path.parent) / METADATA_DIR
    return meta if (meta / "config.json").is_file() else None


def spec_from_checkpoint(checkpoint: str | Path, tokenizer: Any = None) -> ModelSpec | None:
    """The spec stored in ``hf/`` of a checkpoint (see :func:`metadata_folder`), or None when
    there is none."""
    from transformers import AutoConfig, AutoTokenizer

    import foundryx.models.mpt.modeling  # noqa: F401  (registers foundryx_mpt)

    meta = metadata_folder(checkpoint)
    if meta is None:
        return None
    config = AutoConfig.from_pretrained(meta, local_files_only=True)
    if tokenizer is None and (meta / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(meta, local_files_only=True)
    return ModelSpec(config, tokenizer, str(meta / "config.json"))
