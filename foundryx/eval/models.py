"""Models for standalone eval: a foundryx checkpoint (rebuilt by
:func:`foundryx.checkpoint.rebuild.rebuild_model`, from its run config or its own record), a
Hugging Face causal LM, or a PEFT LoRA adapter on one, each as a Composer model with its
tokenizer. :class:`EvalModels` keeps a Hugging Face base between models that share it and
swaps their adapters in and out (PEFT's add_adapter / set_adapter / delete_adapter), so ten
adapters of one base cost one base load."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from foundryx.errors import CheckpointError
from foundryx.eval.config import EvalModelSpec

# transformers, Composer and PEFT (through foundryx.checkpoint.rebuild) are imported by the
# functions that load those models: a native model's eval (foundryx.eval.native_models) loads
# none of them, ~3 s of a small eval's command

log = logging.getLogger(__name__)

__all__ = ["EvalModels", "load_eval_model", "model_max_len", "wrap_hf_model"]


def wrap_hf_model(model: Any, tokenizer: Any) -> Any:
    """A Hugging Face causal LM as the Composer model ICL eval runs
    (:func:`foundryx.checkpoint.rebuild.wrap_hf_model`)."""
    from foundryx.checkpoint.rebuild import wrap_hf_model as wrap  # Composer: a heavy import

    return wrap(model, tokenizer)


def _from_checkpoint(spec: EvalModelSpec) -> tuple[Any, Any]:
    import foundryx.models.mpt.modeling  # noqa: F401  (lets Auto* load exported foundryx MPTs)
    from foundryx.checkpoint.rebuild import rebuild_model  # transformers, Composer: heavy

    rebuilt = rebuild_model(spec.checkpoint, run_config=spec.run_config, overrides=spec.overrides,
                            tokenizer=spec.tokenizer)
    if rebuilt.tokenizer is None:
        raise CheckpointError(f"{spec.checkpoint}: no tokenizer was saved or recorded with it; give "
                              "the model's tokenizer (a folder or hub name) as tokenizer:")
    return rebuilt.model, rebuilt.tokenizer


def _hf_base(spec: EvalModelSpec) -> tuple[nn.Module, Any]:
    """The Hugging Face model ``spec.hf`` (no adapter) and its tokenizer."""
    from transformers import AutoModelForCausalLM  # heavy: only for Hugging Face models

    import foundryx.models.mpt.modeling  # noqa: F401  (lets Auto* load exported foundryx MPTs)
    from foundryx.checkpoint.rebuild import build_tokenizer

    tokenizer = build_tokenizer(spec.tokenizer or spec.hf)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.hf)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"could not load Hugging Face model {spec.hf!r}: {str(e).splitlines()[0]}. Give a "
            f"local folder with config.json and weights, or a hub name with network access."
        ) from None
    return model, tokenizer


def _from_hf(spec: EvalModelSpec) -> tuple[Any, Any]:
    model, tokenizer = _hf_base(spec)
    return wrap_hf_model(model, tokenizer), tokenizer


def _adapter_config(folder: str) -> Any:
    from peft import LoraConfig  # a heavy optional import, used only for adapters

    from foundryx.models.peft.lora import plain_linear_dispatch

    try:
        config = LoraConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{folder}: not a PEFT LoRA adapter folder ({str(e).splitlines()[0]}); "
                              "give a folder with adapter_config.json and "
                              "adapter_model.safetensors (foundryx export output)") from None
    return plain_linear_dispatch(config)


class EvalModels:
    """Loads the models of an eval config one after another. Hugging Face models with the same
    ``hf`` and ``tokenizer`` share one loaded base: an ``adapter`` is added to it and made
    active, the previous adapter removed; a model without an adapter gets the bare base."""

    def __init__(self, specs: list[EvalModelSpec] = ()) -> None:
        # bases some model of the config puts an adapter on: one transformers base serves
        # them all, the bare base included (not the native Llama: a second load)
        self.adapter_bases = {(s.hf, s.tokenizer) for s in specs if s.hf and s.adapter}
        self.key: tuple[str, str | None] | None = None
        self.base: nn.Module | None = None  # the bare Hugging Face model
        self.peft: Any = None  # peft.PeftModel around it while an adapter is on
        self.tokenizer: Any = None
        self.base_loads = 0

    @staticmethod
    def order(specs: list[EvalModelSpec]) -> list[EvalModelSpec]:
        """``specs`` with the models of one base next to each other (first appearance order,
        the bare base first), so each base is loaded once."""
        groups: dict[Any, list[EvalModelSpec]] = {}
        for spec in specs:
            key = (spec.hf, spec.tokenizer) if spec.hf else ("checkpoint", spec.label)
            groups.setdefault(key, []).append(spec)
        return [s for group in groups.values()
                for s in sorted(group, key=lambda s: s.adapter is not None)]

    def load(self, spec: EvalModelSpec, world: int = 1) -> tuple[Any, Any]:
        """``(model, tokenizer)`` for ``spec``, in eval mode: a Composer model, or a native one
        (:mod:`foundryx.eval.native_models`) where ``spec.implementation`` allows it."""
        if spec.hf and spec.implementation != "hf":
            shared = (spec.hf, spec.tokenizer) in self.adapter_bases and not spec.adapter
            native = _native(spec, world, shared)
            if native is not None:
                self.release()
                return native
        if not spec.hf:
            self.release()
            return load_eval_model(spec)
        key = (spec.hf, spec.tokenizer)
        if key != self.key:
            self.release()
            self.base, self.tokenizer = _hf_base(spec)
            self.key, self.base_loads = key, self.base_loads + 1
        else:
            log.info("model %s: reusing the loaded base %s", spec.label, spec.hf)
        hf_model = self._with_adapter(spec)
        model = wrap_hf_model(hf_model, self.tokenizer)
        model.eval()
        log.info("model %s: %s%s (%.1fM parameters)", spec.label, spec.hf,
                 f" + adapter {spec.adapter}" if spec.adapter else "",
                 sum(p.numel() for p in model.parameters()) / 1e6)
        return model, self.tokenizer

    def _with_adapter(self, spec: EvalModelSpec) -> nn.Module:
        if spec.adapter is None:
            if self.peft is not None:
                self.base, self.peft = self.peft.unload(), None  # the adapter layers removed
            return self.base
        from peft import PeftModel  # a heavy optional import, used only for adapters
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        config = _adapter_config(spec.adapter)
        name = f"eval{self.base_loads}_{len(getattr(self.peft, 'peft_config', {}))}"
        try:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, spec.adapter, adapter_name=name,
                                                      config=config)
            else:
                previous = self.peft.active_adapter
                self.peft.add_adapter(name, config)
                set_peft_model_state_dict(self.peft, load_peft_weights(spec.adapter),
                                          adapter_name=name)
                self.peft.set_adapter(name)
                self.peft.delete_adapter(previous)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{spec.adapter}: cannot apply this adapter to {spec.hf} "
                                  f"({str(e).splitlines()[0]}); was it trained on this base?"
                                  ) from None
        return self.peft

    def release(self) -> None:
        self.key = self.base = self.peft = self.tokenizer = None


def _native(spec: EvalModelSpec, world: int, shared: bool = False) -> tuple[Any, Any] | None:
    """``spec``'s native model and tokenizer, or None where transformers runs it (said in one
    line; a CheckpointError for ``implementation: native``). ``shared``: other models of the
    config put adapters on this base (with ``auto``, transformers loads it once for all)."""
    from foundryx.eval.native_models import check_native, load_native

    checked = check_native(spec, world)
    problem = checked if isinstance(checked, str) else None
    if problem is None and shared and spec.implementation == "auto":
        problem = "other models put adapters on this base: one transformers load serves all"
    if problem is not None:
        if spec.implementation == "native":
            raise CheckpointError(f"model {spec.label}: implementation: native cannot run "
                                  f"{spec.hf} ({problem}); set implementation: hf (or auto)")
        log.info("model %s: transformers (the native Llama does not run it: %s)", spec.label,
                 problem)
        return None
    model, tokenizer = load_native(spec, checked), checked
    log.info("model %s: %s on foundryx's native Llama (%.1fM parameters; implementation: hf "
             "runs it on transformers)%s", spec.label, spec.hf,
             sum(p.numel() for p in model.parameters()) / 1e6,
             "; a multiple-choice context is computed once for its choices (share_context: "
             "false scores whole rows)" if spec.share_context else "")
    return model, tokenizer


def load_eval_model(spec: EvalModelSpec) -> tuple[Any, Any]:
    """``(composer_model, tokenizer)`` for one model of an eval config, in eval mode."""
    model, tokenizer = _from_hf(spec) if spec.hf else _from_checkpoint(spec)
    model.eval()
    log.info("model %s: %s (%.1fM parameters)", spec.label, spec.hf or spec.checkpoint,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tokenizer


def model_max_len(model: Any) -> int | None:
    """The longest sequence the model takes, from its Hugging Face config (None: unknown)."""
    cfg = getattr(getattr(model, "model", model), "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
