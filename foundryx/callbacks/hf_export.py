"""``hf_export``: write the model as a Hugging Face folder during and at the end of training.

YAML::

    callbacks:
      hf_export:
        save_folder: runs/my-run/hf     # exports go to save_folder/ba<batch>
        save_interval: 1000ba           # optional; none: only at the end
        format: auto                    # auto | llama | mpt (see docs/hf.md)

Every rank takes part in gathering the weights (FSDP2 shards them); rank 0 converts and
writes, the others wait, and an export error stops every rank with the same message. A LoRA
run's exports are PEFT adapter folders (see docs/finetuning.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from composer.core import Callback, Event, State
from composer.loggers import Logger

from foundryx.errors import ConfigError, ExportError
from foundryx.export.core import (
    DTYPES,
    FORMATS,
    ExportSpec,
    check_dtype,
    choose_format,
    export_weights,
)
from foundryx.export.lora import options_of, write_adapter
from foundryx.models.peft.adapters import has_lora
from foundryx.parallel.tp_fused import unpermute_full_state

log = logging.getLogger(__name__)


class HFExport(Callback):
    """Export to ``save_folder/ba<batch>`` every ``save_interval`` and/or at the end of fit.

    Args:
        save_folder: folder that receives one export folder per export.
        save_interval: a Composer time string (``500ba``, ``1ep``); none: no periodic exports.
        at_fit_end: export when training ends (skipped if that batch was just exported).
        format: ``auto``, ``llama`` or ``mpt``; checked when training starts.
        dtype: ``fp32``, ``bf16`` or ``fp16``; none: as trained.
        overwrite: replace an earlier export of the same batch (a resumed run).
    """

    def __init__(self, save_folder: str, save_interval: str | None = None, at_fit_end: bool = True,
                 format: str = "auto", dtype: str | None = None, overwrite: bool = True):
        from composer.utils import create_interval_scheduler

        problems = []
        if format not in FORMATS:
            problems.append(f"callbacks.hf_export.format: {format!r}; use one of {', '.join(FORMATS)}")
        if dtype is not None and dtype not in DTYPES:
            problems.append(f"callbacks.hf_export.dtype: {dtype!r}; use one of {', '.join(DTYPES)}")
        if save_interval is None and not at_fit_end:
            problems.append("callbacks.hf_export: save_interval is none and at_fit_end is false, "
                            "so it would never export; set one of them")
        try:
            self._due = (create_interval_scheduler(save_interval, include_end_of_training=at_fit_end)
                         if save_interval is not None else None)
        except (ValueError, TypeError) as e:
            problems.append(f"callbacks.hf_export.save_interval: {save_interval!r}: {e}")
        if problems:
            raise ConfigError(problems)
        self.save_folder = Path(save_folder)
        self.at_fit_end = at_fit_end
        self.format, self.dtype, self.overwrite = format, dtype, overwrite
        self._last_batch: int | None = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            choose_format(_hf_model(state).config, self.format)  # fail before training, not after
        elif event in (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT):
            if self._due is not None and self._due(state, event):
                self.export(state)
        elif event == Event.FIT_END and self.at_fit_end:
            self.export(state)

    def export(self, state: State) -> Path | None:
        """Export the current weights (every rank calls this); return the folder on rank 0."""
        from composer.utils import dist

        batch = int(state.timestamp.batch)
        if batch == self._last_batch:
            return None
        self._last_batch = batch
        weights = _full_state_dict(state.model)
        out, error = self.save_folder / f"ba{batch}", None
        if dist.get_global_rank() == 0:
            model = _hf_model(state)
            spec = ExportSpec(model.config, getattr(_composer_model(state), "tokenizer", None),
                              "the training model")
            try:
                if has_lora(model):  # a LoRA run: its adapter, as a PEFT folder
                    inner = {k.removeprefix("model."): v for k, v in weights.items()}
                    write_adapter(model, options_of(model), spec.tokenizer, out,
                                  fmt=choose_format(model.config, self.format), base=None,
                                  dtype=check_dtype(self.dtype), overwrite=self.overwrite,
                                  source=f"the model at batch {batch}", weights=inner)
                else:
                    export_weights(weights, spec, out, fmt=self.format, dtype=self.dtype,
                                   overwrite=self.overwrite, progress=False,
                                   source=f"the model at batch {batch}")
            except Exception as e:  # every rank must learn of it, or they wait forever
                error = f"{type(e).__name__}: {e}"
        errors = [error]
        dist.broadcast_object_list(errors, src=0)
        if errors[0] is not None:
            raise ExportError(f"hf_export at batch {batch} failed: {errors[0]}")
        return out if dist.get_global_rank() == 0 else None


def _composer_model(state: State) -> Any:
    """The ComposerModel, unwrapped from DDP if needed."""
    model = state.model
    return getattr(model, "module", model)


def _hf_model(state: State) -> Any:
    model = getattr(_composer_model(state), "model", None)
    if getattr(model, "config", None) is None:
        raise ExportError(f"hf_export needs a Hugging Face model (mpt_causal_lm, hf_causal_lm); "
                          f"{type(_composer_model(state)).__name__} has none")
    return model


def _full_state_dict(model: Any) -> dict[str, Any]:
    """The full state dict on rank 0's CPU (gathered from every rank under FSDP2)."""
    from composer.utils import dist
    from torch.distributed.tensor import DTensor

    model = getattr(model, "module", model)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        unpermute_full_state(model, full)  # a fused layer's rows back from TP order
        return full
    if dist.get_global_rank() != 0:
        return {}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
