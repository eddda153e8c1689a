"""``hf_causal_lm``: any Hugging Face causal LM as a Composer model.

Llama, Mistral, Qwen2, GPT-NeoX, GPT-2 and every other ``AutoModelForCausalLM`` architecture,
from a local folder or hub name (``pretrained_model_name_or_path``; weights loaded when
``pretrained: true``) or from a config dict (``config: {model_type: llama, ...}``, random
init), with ``config_overrides`` on top. Exported foundryx MPT folders load too.

The model stays plain single-device PyTorch: FSDP2 wraps each decoder block (the classes in
the model's ``_no_split_modules``) through ``fsdp_wrap_fn``, activation checkpointing uses
``activation_checkpointing_fn``, and meta-device parameters are initialised per module by
``param_init_fn`` (Composer's hooks on the wrapped model).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from packaging.version import Version
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

import foundryx.models.mpt.modeling  # noqa: F401  (registers foundryx_mpt with the Auto classes)
from foundryx.config.types import option, options_or_fields
from foundryx.errors import ConfigError
from foundryx.models.composer_base import CausalLMBase, FusedLossLM, labels_of
from foundryx.models.hf_attention import (
    HF_FLEX,
    packed_positions,
    packing_problem,
    register_hf_attention,
)
from foundryx.models.hf_source import apply_overrides, config_from_dict, override_problems
from foundryx.models.hf_tp import hf_cp_plan, hf_tp_plan
from foundryx.models.layers.loss import DEFAULT_CHUNKS, linear_cross_entropy
from foundryx.models.peft.lora_fields import LoraFields
from foundryx.runtime.hf_compat import newer_transformers_hint
from foundryx.runtime.hub import looks_like_path, nearest_folder, resolve_source

log = logging.getLogger(__name__)

NAME = "hf_causal_lm"
# model types whose causal-LM forward is ``lm_head(decoder(...).last_hidden_state)`` and a
# token-mean cross entropy: no logit scaling, soft-capping or auxiliary loss
FUSABLE = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2"})


@dataclass
class HFCausalLMOptions(LoraFields):
    """The ``hf_causal_lm`` model section."""

    pretrained_model_name_or_path: str | None = option(
        "a local folder (save_pretrained or `foundryx export` output) or a hub name", default=None)
    pretrained: bool = option("load the folder's weights (true) or only its config, with random "
                              "init", default=True)
    config: dict[str, Any] | None = option(
        "instead of a folder: a config dict with model_type (random init)", default=None)
    config_overrides: dict[str, Any] = option(
        "config attributes to change, e.g. {num_hidden_layers: 2}", default_factory=dict)
    trust_remote_code: bool = option("allow a folder's own modeling code (auto_map)", default=False)
    attn_implementation: str | None = option(
        "Hugging Face attention backend, e.g. sdpa or eager; foundryx_flex: foundryx's "
        "FlexAttention, which keeps packed documents apart without a dense mask "
        "(docs/hf.md)", default=None)
    init_device: Literal["cpu", "meta", "mixed"] = option(
        "cpu (every rank builds the whole model: tests, small models) or meta (built without "
        "memory; after FSDP2 sharding each rank reads only its own shards of the pretrained "
        "safetensors, or initialises them when pretrained: false); mixed is the old name of "
        "meta", default="cpu")
    allow_embedding_resizing: bool = option("grow the embeddings when the tokenizer is larger",
                                            default=False)
    fused_loss: bool | None = option(
        "a training step takes the loss chunk by chunk from the last hidden states and the "
        "output projection, never holding the tokens x vocab logits (null: on for the model "
        "types whose head is a plain linear layer: " + ", ".join(sorted(FUSABLE)) + ")",
        default=None)

    def problems(self) -> list[str]:
        """Combinations, and the config of a local folder or dict (no weights are read)."""
        path, config = self.pretrained_model_name_or_path, self.config
        p = self.lora_problems()
        if (path is None) == (config is None):
            p.append("pretrained_model_name_or_path: give exactly one of "
                     "pretrained_model_name_or_path (a folder or hub name) and config (a dict "
                     "with model_type)")
        if config is not None and self.pretrained:
            p.append("pretrained: a config dict has no weights; set pretrained: false")
        if p or (path is not None and not looks_like_path(path)
                 and not Path(path).expanduser().is_dir()):
            return p  # a hub name: checked when the model is built
        try:
            hf_config, _ = build_config(path, config, {}, self.trust_remote_code)
        except ConfigError as e:
            return [q.removeprefix("model.") for q in e.problems]
        return override_problems(hf_config, self.config_overrides, "config_overrides")


class ComposerHFCausalLM(FusedLossLM):
    """A Hugging Face ``AutoModelForCausalLM`` as a Composer model:
    ``ComposerHFCausalLM(tokenizer, options=HFCausalLMOptions(...))`` or with the options as
    keywords, ``ComposerHFCausalLM(tokenizer, pretrained_model_name_or_path=...)`` (see
    :class:`HFCausalLMOptions`)."""

    def __init__(self, tokenizer: Any = None, options: HFCausalLMOptions | None = None,
                 **fields: Any):
        o = options_or_fields(HFCausalLMOptions, options, fields, f"the {NAME!r} model")
        hf_config, source = build_config(o.pretrained_model_name_or_path, o.config,
                                         o.config_overrides, o.trust_remote_code)
        if tokenizer is not None and len(tokenizer) > hf_config.vocab_size \
                and not o.allow_embedding_resizing:
            raise ConfigError([
                f"model: the model's vocab_size {hf_config.vocab_size} is smaller than the "
                f"tokenizer's {len(tokenizer)} tokens; set model.allow_embedding_resizing: true, "
                f"or model.config_overrides.vocab_size >= {len(tokenizer)} with pretrained: false"
            ])
        # the dtype the source's weights are stored in (its config.json; None: not recorded, or
        # a config dict), read before building sets float32: a merged LoRA export keeps it
        stored = torch_dtype(stored_dtype(hf_config)) if source is not None else None
        model = _build_model(hf_config, source, o.pretrained, o.trust_remote_code,
                             o.attn_implementation, init_device(o.init_device))
        attach_parallel_hooks(model)
        super().__init__(
            model=model,
            tokenizer=tokenizer,
            use_logits=True,
            metrics=[LanguageCrossEntropy()],
            eval_metrics=[LanguageCrossEntropy(), LanguagePerplexity()],
            allow_embedding_resizing=o.allow_embedding_resizing,
        )
        self.n_matmul_params = matmul_params(self.model)
        self.stored_dtype = stored
        self._said_packing = False
        self.fuses_loss = fused_loss_choice(self.model, o.fused_loss)

    def _forward(self, batch: Mapping[str, Any], fused: bool):
        if batch.get("sequence_id") is not None:
            batch = self._packed(batch)
        # No KV cache in a training/eval forward: none is reused, and under activation
        # checkpointing the recomputed forward would append to it again (shapes differ).
        batch = {**batch, "use_cache": False}
        if fused:
            inputs = {k: v for k, v in batch.items()
                      if k in self.model_forward_args and k not in ("labels", "logits_to_keep")}
            # through the model's own entry (FSDP2 gathers its top-level weights, the head's
            # included, for it as for forward: parallel/parallelize.py registers it)
            shifted = batch.get("shift_labels")  # a context-parallel shard's (parallel/cp.py)
            loss = self.model.foundryx_decoder_loss(
                inputs, labels_of(batch) if shifted is None else shifted, shifted is not None)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        return CausalLMBase.forward(self, batch)  # Composer's: the model's own forward

    def _packed(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A packed batch as the model takes it (as transformers' flattening collator gives
        it): ``position_ids`` restarting at each document (padding is one of its own), no
        ``attention_mask`` and no ``sequence_id``; ConfigError when the model's attention
        cannot keep the documents apart (see :mod:`foundryx.models.hf_attention`)."""
        attn = getattr(self.model.config, "_attn_implementation", None)
        problem = packing_problem(self.model)
        if problem:
            raise ConfigError([
                f"model.attn_implementation: the batches are packed (sequence_id) and "
                f"{type(self.model).__name__} cannot keep their documents apart: {problem}; set "
                f"model.attn_implementation: {HF_FLEX} (no dense mask), or packing_ratio: null "
                "in the loader's dataset"])
        if not self._said_packing:
            self._said_packing = True
            how = ("block mask built from the documents, no dense mask" if attn == HF_FLEX
                   else "transformers reads the documents from the position ids" + (
                       f"; a dense mask of seq² per row: model.attn_implementation: {HF_FLEX} "
                       "builds none" if attn in ("sdpa", "eager") else ""))
            log.info("hf_causal_lm: packed batches: position ids restart at each document and "
                     "attention %s keeps documents apart (%s)", attn, how)
        positions = packed_positions(batch["sequence_id"], batch.get("attention_mask"))
        rest = {k: v for k, v in batch.items() if k not in ("sequence_id", "attention_mask")}
        return {**rest, "position_ids": positions}

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        """Training FLOPs of a batch: ``3 * b * (2 * N * s + 4 * n_layers * d_model * s**2)``,
        N = parameters used in matmuls (see :func:`matmul_params`), as for MPT."""
        b, s = batch["input_ids"].shape[:2]
        cfg = self.model.config
        return 3 * b * (2 * self.n_matmul_params * s + 4 * cfg.num_hidden_layers * cfg.hidden_size * s * s)


def fuses_loss(model: nn.Module, asked: bool | None) -> bool:
    """Whether a training step of the Hugging Face ``model`` fuses the loss with the output
    projection: ``asked``, or (None) for the model types in FUSABLE with a bias-free linear
    head and a ``get_decoder``. ConfigError when asked for where the model cannot."""
    head = model.get_output_embeddings()
    can = (isinstance(head, nn.Linear) and head.bias is None
           and callable(getattr(model, "get_decoder", None)))
    if asked and not can:
        raise ConfigError([f"model.fused_loss: true, but {type(model).__name__}'s output head "
                           "is not a bias-free linear layer after a get_decoder(); set "
                           "fused_loss: false"])
    return can and getattr(model.config, "model_type", "?") in FUSABLE if asked is None else asked


def fused_loss_choice(model: nn.Module, asked: bool | None) -> bool:
    """:func:`fuses_loss`, said in one line when foundryx chose."""
    model_type = getattr(model.config, "model_type", "?")
    fused = fuses_loss(model, asked)
    if asked is None:
        log.info("hf_causal_lm: fused loss %s (model_type %s%s; model.fused_loss sets it)",
                 "on" if fused else "off", model_type,
                 ": the training loss is taken chunk by chunk, never holding the whole logits"
                 if fused else ": not one whose head is known to be a plain linear layer")
    return fused


def build_config(
    path: str | None, config: Mapping[str, Any] | None, overrides: Mapping[str, Any],
    trust_remote_code: bool = False,
) -> tuple[Any, tuple[str, bool] | None]:
    """``(PretrainedConfig, (source, local_files_only) or None)`` from a folder/hub name or a
    config dict, with ``overrides`` applied."""
    from transformers import AutoConfig

    if config is not None:
        return apply_overrides(config_from_dict(config, "model.config"), overrides,
                               "model.config_overrides"), None
    source = resolve_source(path, "model.pretrained_model_name_or_path")
    try:
        hf_config = AutoConfig.from_pretrained(
            source[0], local_files_only=source[1], trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as e:
        local = Path(source[0]).is_dir()
        newer = newer_transformers_hint(e, source[0]) if local else None
        near = None if local else nearest_folder(path)
        hint = f"; {newer}" if newer else f"; did you mean {near}?" if near else ""
        raise ConfigError([f"model.pretrained_model_name_or_path: cannot load the config of "
                           f"{path!r}: {_first_line(e)}{hint}"]) from None
    return apply_overrides(hf_config, overrides, "model.config_overrides"), source


def init_device(value: str) -> str:
    """``mixed`` (rank 0 loaded the whole model and broadcast it) is now ``meta``: every rank
    reads its own shards; said in one warning line."""
    if value == "mixed":
        log.warning("model.init_device: mixed is deprecated and now means meta (every rank "
                    "builds on the meta device and reads only its own shards of the "
                    "safetensors after FSDP2 sharding); write init_device: meta")
        return "meta"
    return value


def stored_dtype(hf_config: Any) -> Any:
    """The weights' dtype as the config records it. transformers >= 4.56 calls the attribute
    ``dtype`` (``torch_dtype`` is a property there that warns it is deprecated), older ones
    ``torch_dtype``; read from the instance, so neither warns."""
    own = vars(hf_config)
    return own.get("dtype", own.get("torch_dtype"))


def torch_dtype(value: Any) -> torch.dtype | None:
    """A config's dtype (``"bfloat16"``, a torch.dtype or None) as a torch floating dtype, or
    None."""
    value = getattr(torch, value, None) if isinstance(value, str) else value
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def dtype_argument() -> str:
    """The keyword ``from_pretrained``/``from_config`` take the weights' dtype as: ``dtype`` on
    transformers >= 4.56 (where ``torch_dtype`` warns that it is deprecated), else
    ``torch_dtype``."""
    import transformers  # heavy: imported where used, as _build_model does

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


def weights_dtype_note(hf_config: Any) -> None:
    """The one dtype rule, said once when the checkpoint's differs: every rank builds float32
    parameters (the checkpoint's values converted exactly, shard by shard when loaded on
    meta): trainable weights need float32, and torch 2.7's FSDP2 needs one dtype per unit."""
    stored = torch_dtype(stored_dtype(hf_config))
    if stored is not None and stored != torch.float32:
        log.info("hf_causal_lm: the weights are stored as %s; the model holds float32 parameters "
                 "(trainable weights train in float32 and each FSDP2 unit has one dtype); with "
                 "LoRA, frozen_base {dtype: bf16, fp8, int8 or nf4} keeps the frozen linear "
                 "weights small", str(stored).removeprefix("torch."))


def local_folder(source: tuple[str, bool]) -> str:
    """The local folder of a pretrained source (a hub name: its cached snapshot)."""
    if Path(source[0]).expanduser().is_dir():
        return str(Path(source[0]).expanduser())
    from huggingface_hub import snapshot_download  # only for a hub name

    try:
        return snapshot_download(source[0], local_files_only=source[1],
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:  # noqa: BLE001  (hub errors have many types)
        raise ConfigError([f"model.pretrained_model_name_or_path: cannot get {source[0]!r} "
                           f"from the hub: {_first_line(e)}; download it to a folder "
                           "(huggingface-cli download NAME --local-dir DIR) and give that "
                           "folder"]) from None


def _build_model(hf_config: Any, source: tuple[str, bool] | None, pretrained: bool,
                 trust_remote_code: bool, attn_implementation: str | None, init_device: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"trust_remote_code": trust_remote_code, dtype_argument(): torch.float32}
    register_hf_attention()  # transformers then takes attn_implementation: foundryx_flex
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    if pretrained:
        weights_dtype_note(hf_config)
    if init_device == "meta":
        from accelerate import init_empty_weights  # (peft's requirement) heavy: only here

        # parameters on meta; buffers (rotary frequencies, computed, not stored) built for real
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(hf_config, **kw)
        # a meta build skips Hugging Face's weight init, and with it tie_weights: tie here, so
        # lm_head and embed_tokens are one Parameter before LoRA, FSDP2 (which then manages it
        # once, in the unit that holds both) and shard-on-read (which reads it once)
        model.tie_weights()
        if pretrained and source is not None:  # foundryx.loading reads it after sharding
            model.pretrained_weights_folder = local_folder(source)
        return model
    if not pretrained:
        return AutoModelForCausalLM.from_config(hf_config, **kw)
    try:
        return AutoModelForCausalLM.from_pretrained(
            source[0], config=hf_config, local_files_only=source[1], **kw
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError([
            f"model.pretrained_model_name_or_path: cannot load the weights of {source[0]!r}: "
            f"{_first_line(e)} (config_overrides that change weight shapes need pretrained: false)"
        ]) from None


def block_classes(model: nn.Module) -> tuple[type, ...]:
    """The decoder block classes of ``model``, from its ``_no_split_modules`` names."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def decoder_loss(model: nn.Module, inputs: Mapping[str, Any], labels: torch.Tensor,
                 shifted: bool = False) -> torch.Tensor:
    """The next-token loss of a Hugging Face causal LM from its decoder's last hidden states,
    fused with the output projection (``linear_cross_entropy``, in the model's
    ``foundryx_loss_chunks``): no logits are made. ``shifted``: ``labels`` are already each
    position's target (a context-parallel shard's)."""
    hidden = model.get_decoder()(**inputs).last_hidden_state
    weight = model.get_output_embeddings().weight
    if not shifted:  # position i predicts label i + 1
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    return linear_cross_entropy(hidden, weight, labels, chunks=model.foundryx_loss_chunks)


def attach_parallel_hooks(model: nn.Module) -> None:
    """Composer's per-model hooks: FSDP2 wraps and checkpoints each decoder block; meta
    parameters are initialised with the model's own ``_init_weights``."""
    blocks = block_classes(model)
    if not blocks:
        log.info("%s has no _no_split_modules: FSDP2 shards it as one unit and activation "
                 "checkpointing has no blocks to wrap", type(model).__name__)

    def is_block(module: nn.Module) -> bool:
        return isinstance(module, blocks)

    model.fsdp_wrap_fn = is_block
    model.activation_checkpointing_fn = is_block
    model.param_init_fn = model._init_weights
    model.foundryx_tp_plan = lambda: hf_tp_plan(model)
    model.foundryx_cp_plan = lambda: hf_cp_plan(model)
    # the fused loss reads the head's weight outside the head's forward: a forward method of
    # the model, which FSDP2 gathers the model's own (top-level) weights for, as for forward
    model.foundryx_decoder_loss = partial(decoder_loss, model)
    model.foundryx_loss_chunks = DEFAULT_CHUNKS  # its chunk sizes (layers.loss.LossChunks)
    model.foundryx_forward_methods = ("foundryx_decoder_loss",)


def matmul_params(model: nn.Module) -> int:
    """Parameters used in matmuls: all but embedding tables; a tied output projection counts."""
    total = sum(p.numel() for p in model.parameters())
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    return total - tables + (out.weight.numel() if tied else 0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
