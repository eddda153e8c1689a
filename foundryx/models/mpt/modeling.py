"""MPT decoder in plain single-device PyTorch, as Hugging Face ``PreTrainedModel`` classes.

Norms, feed-forward blocks and attention are looked up by name in ``foundryx.registry``.
The model can be built on the meta device (``init_device: meta``, or inside a
``torch.device("meta")`` context) and materialised later with ``model.to_empty(device=...)``
followed by ``model.init_weights()``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from foundryx import registry
from foundryx.models.layers.head import output_logits
from foundryx.models.layers.loss import DEFAULT_CHUNKS, causal_lm_loss, linear_cross_entropy
from foundryx.models.layers.positions import alibi_slopes, apply_rope, rope_cos_sin, token_positions
from foundryx.models.mpt.configuration import MPTConfig


def _norm(config: MPTConfig, dim: int) -> nn.Module:
    return registry.norms.get(config.norm_type)(dim, eps=config.norm_eps, bias=not config.no_bias)


class MPTAttention(nn.Module):
    """Multi-head, grouped-query (kv_n_heads < n_heads) or multi-query (1) self-attention."""

    def __init__(self, config: MPTConfig):
        super().__init__()
        a = config.attn
        # Resolved once here rather than per call: torch.compile cannot trace the registry lock.
        self.attn_fn = registry.attention_implementations.get(a.attn_impl)
        self.n_heads = config.n_heads
        self.kv_n_heads = config.kv_n_heads
        self.head_dim = config.head_dim
        self.softmax_scale = a.softmax_scale
        self.attn_pdrop = a.attn_pdrop
        self.sliding_window = a.sliding_window_size if a.sliding_window_size > 0 else None
        d, kv = config.d_model, self.kv_n_heads * self.head_dim
        bias = not config.no_bias
        self.qkv_sizes = (d, kv, kv)
        self.Wqkv = nn.Linear(d, d + 2 * kv, bias=bias)
        self.Wqkv._fused = self.qkv_sizes  # init treats the q, k, v rows as separate matrices
        self.q_ln = _norm(config, d) if a.qk_ln else None
        self.k_ln = _norm(config, kv) if a.qk_ln else None
        self.out_proj = nn.Linear(d, d, bias=bias)
        self.out_proj._is_residual = True

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        """``rope`` is (cos, sin) from ``rope_cos_sin``; ``attn_kwargs`` go to the attention
        implementation (sequence_id, alibi_slopes, key_padding_mask)."""
        batch, seq, d = x.shape
        q_rows, kv_rows = self.n_heads * self.head_dim, self.kv_n_heads * self.head_dim
        q, k, v = self.Wqkv(x).split((q_rows, kv_rows, kv_rows), dim=-1)  # this rank's, under TP
        if self.q_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        q = q.view(batch, seq, self.n_heads, self.head_dim)
        k = k.view(batch, seq, self.kv_n_heads, self.head_dim)
        v = v.view(batch, seq, self.kv_n_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.attn_fn(
            q,
            k,
            v,
            causal=True,
            softmax_scale=self.softmax_scale,
            dropout_p=self.attn_pdrop if self.training else 0.0,
            sliding_window=self.sliding_window,
            **attn_kwargs,
        )
        return self.out_proj(out.reshape(batch, seq, -1))  # -1: this rank's heads under TP


class MPTBlock(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm_1(x))``, then ``x + ffn(norm_2(x))``."""

    def __init__(self, config: MPTConfig):
        super().__init__()
        ffn_cls = registry.ffns.get(config.ffn.ffn_type)
        self.norm_1 = _norm(config, config.d_model)
        self.attn = MPTAttention(config)
        self.norm_2 = _norm(config, config.d_model)
        self.ffn = ffn_cls(config.d_model, config.ffn_hidden_size, bias=not config.no_bias)
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, **attn_kwargs: Any) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), **attn_kwargs))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class MPTPreTrainedModel(PreTrainedModel):
    """Weight init (``init_config``) shared by the MPT models."""

    config_class = MPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["MPTBlock"]

    # Policy hooks read from outside (foundryx.parallel, Composer): blocks are the FSDP2 and
    # compile units and the activation-checkpointing targets; param_init_fn initialises the
    # parameters one module owns after a meta-device model is sharded and allocated.
    def fsdp_wrap_fn(self, module: nn.Module) -> bool:
        return isinstance(module, MPTBlock)

    # LoRA's logical target names (foundryx.models.peft): name -> (linear layer, index of a
    # row slice of the fused Wqkv, or None for the whole layer).
    lora_logical_targets = {"q": ("Wqkv", 0), "k": ("Wqkv", 1), "v": ("Wqkv", 2),
                            "o": ("out_proj", None), "up": ("up_proj", None),
                            "down": ("down_proj", None), "gate": ("gate_proj", None)}

    # the fused loss and the logits read the output projection's weight; tensor parallelism
    # replaces both on the instance with their vocabulary-parallel forms (foundryx.parallel.tp,
    # the plan's vocab "readers")
    fused_loss = staticmethod(linear_cross_entropy)
    project_logits = staticmethod(output_logits)

    def activation_checkpointing_fn(self, module: nn.Module) -> bool:
        return isinstance(module, MPTBlock)

    def foundryx_tp_plan(self) -> dict[str, Any]:
        """Tensor + sequence parallelism as data (applied by foundryx.parallel.tp): heads and
        MLP columns split, norms on sequence shards, the embedding and the output projection
        (tied to it or not) split by vocabulary rows, and with them the fused loss (see
        foundryx.models.layers.head)."""
        cfg, a = self.config, self.config.attn
        unsupported = [what for what, on in (("ALiBi", a.alibi), ("qk_ln", a.qk_ln)) if on]
        prefix = "transformer." if self.base_model_prefix in dict(self.named_children()) else ""
        blocks = f"{prefix}blocks.*"
        # the head is never called as a module: forward reads its weight (fused_loss,
        # project_logits), so the plan splits that weight's rows and names those two readers
        head = {"lm_head": "vocab_rows"} if getattr(self, "lm_head", None) is not None else {}
        return {
            "vocab": {"size": cfg.vocab_size,
                      "layers": {f"{prefix}wte": "vocab_parallel_embedding", **head},
                      "readers": {"loss": "fused_loss", "logits": "project_logits"}},
            "unsupported": (f"MPT with {' and '.join(unsupported)} has no tensor-parallel plan "
                            "yet" if unsupported else None),
            "layers": {
                f"{prefix}blocks.0": "sequence_parallel_start",
                f"{blocks}.norm_1": "sequence_parallel",
                f"{blocks}.attn": "gather_sequence",
                f"{blocks}.attn.Wqkv": "colwise_fused",
                f"{blocks}.attn.out_proj": "rowwise",
                f"{blocks}.norm_2": "sequence_parallel",
                f"{blocks}.ffn": "gather_sequence",
                f"{blocks}.ffn.up_proj": "colwise",
                f"{blocks}.ffn.gate_proj": "colwise",
                f"{blocks}.ffn.down_proj": "rowwise",
                f"{prefix}norm_f": "sequence_parallel_end",
            },
            "local": {f"{blocks}.attn": ["n_heads", "kv_n_heads"]},
            "divisible": {"n_heads": cfg.n_heads, "ffn_hidden_size": cfg.ffn_hidden_size},
            # fewer kv heads than TP ranks: Wqkv replicated, each rank its q heads and kv head
            "kv_heads": {"count": cfg.kv_n_heads, "name": "kv_n_heads", "heads": cfg.n_heads,
                         "layers": [f"{blocks}.attn.Wqkv"],
                         "rank_attrs": {f"{blocks}.attn": {"kv_n_heads": "one"}}},
        }

    def foundryx_cp_plan(self) -> dict[str, Any]:
        """Context parallelism as data (applied by foundryx.parallel.cp): each attention's
        ``attn_fn`` runs on the whole sequence of a rank's heads (Ulysses), and the positions
        of the whole sequence come from ``token_positions``."""
        prefix = "transformer." if self.base_model_prefix in dict(self.named_children()) else ""
        return {"heads": self.config.n_heads, "kv_heads": self.config.kv_n_heads,
                "attention": {f"{prefix}blocks.*.attn": "attn_fn"},
                "positions": "foundryx_positions"}

    def foundryx_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           sequence_id: torch.Tensor | None) -> torch.Tensor:
        """The positions MPTModel.forward gives the tokens of a whole batch."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        uses = self.config.attn.attn_uses_sequence_id
        return token_positions(input_ids, attention_mask, sequence_id if uses else None)

    def param_init_fn(self, module: nn.Module) -> None:
        self._init_weights(module)

    def init_weights(self) -> None:
        """(Re)initialise every parameter by ``init_config``; works after ``to_empty``."""
        for module in self.modules():
            self._init_weights(module)
        self.tie_weights()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise the parameters that ``module`` itself owns.

        Linear weights follow ``init_config.name`` (rows of a fused projection one matrix at
        a time; projections marked ``_is_residual`` divided by the residual divisor), biases
        are zero; embeddings use ``emb_init_std``/``emb_init_uniform_lim`` if set; any other
        module with ``reset_parameters`` (norms) resets itself.
        """
        ic = self.config.init
        if isinstance(module, nn.Linear):
            for rows in module.weight.split(getattr(module, "_fused", module.out_features)):
                self._init_matrix(rows)
            if getattr(module, "_is_residual", False):
                module.weight.div_(self._residual_divisor())
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            if ic.emb_init_std is not None:
                module.weight.normal_(0.0, ic.emb_init_std)
            elif ic.emb_init_uniform_lim is not None:
                module.weight.uniform_(-ic.emb_init_uniform_lim, ic.emb_init_uniform_lim)
            else:
                self._init_matrix(module.weight)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    def _init_matrix(self, w: torch.Tensor) -> None:
        ic = self.config.init
        name = ic.name
        if name == "baseline_":
            w.normal_(0.0, ic.init_std)
        elif name in ("small_init_", "neox_init_"):
            w.normal_(0.0, math.sqrt(2 / (5 * self.config.d_model)))
        elif name == "kaiming_normal_":
            nn.init.kaiming_normal_(
                w, a=ic.init_gain, mode=ic.fan_mode, nonlinearity=ic.init_nonlinearity
            )
        elif name == "kaiming_uniform_":
            nn.init.kaiming_uniform_(
                w, a=ic.init_gain, mode=ic.fan_mode, nonlinearity=ic.init_nonlinearity
            )
        else:
            raise ValueError(f"init_config.name: unknown init scheme {name!r}")

    def _residual_divisor(self) -> float:
        """sqrt(2 * n_layers) by default; neox_init_ uses n_layers / sqrt(10) (GPT-NeoX)."""
        n_layers, div = self.config.n_layers, self.config.init.init_div_is_residual
        if self.config.init.name == "neox_init_":
            return n_layers / math.sqrt(10)
        if div is True:
            return math.sqrt(2 * n_layers)
        return 1.0 if div is False else float(div)


class MPTModel(MPTPreTrainedModel):
    """Token (and learned position) embeddings, ``n_layers`` MPTBlocks, final norm."""

    def __init__(self, config: MPTConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = (
            nn.Embedding(config.max_seq_len, config.d_model) if config.learned_pos_emb else None
        )
        self.emb_drop = nn.Dropout(config.emb_pdrop)
        self.blocks = nn.ModuleList(MPTBlock(config) for _ in range(config.n_layers))
        self.norm_f = _norm(config, config.d_model)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
    ) -> BaseModelOutputWithPast:
        """Hidden states after the final norm.

        ``attention_mask`` (batch, seq), 1 = token, 0 = padding: padding keys are masked and
        not counted in positions. ``sequence_id`` (batch, seq): tokens attend only within
        their document and positions restart at 0 in each document. ``position_ids`` (batch,
        seq): the tokens' positions, when not those (a shard of a longer sequence).
        """
        cfg, a = self.config, self.config.attn
        seq = input_ids.shape[1]
        if seq > cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {cfg.max_seq_len}")
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: keep the unmasked fast path
        positions = (token_positions(input_ids, attention_mask, sequence_id)
                     if position_ids is None else position_ids)
        x = self.wte(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        x = self.emb_drop(x)
        rope = (
            rope_cos_sin(positions, cfg.head_dim, a.rope_theta, x.dtype) if a.rope else None
        )
        slopes = alibi_slopes(cfg.n_heads, a.alibi_bias_max, x.device) if a.alibi else None
        for block in self.blocks:
            x = block(
                x,
                rope=rope,
                sequence_id=sequence_id,
                alibi_slopes=slopes,
                key_padding_mask=attention_mask,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm_f(x))


class MPTForCausalLM(MPTPreTrainedModel, GenerationMixin):
    """MPTModel plus the LM head: tied to ``wte`` (default) or a separate ``lm_head``.

    ``generate`` works without a KV cache (each step re-reads the whole prefix).
    """

    def __init__(self, config: MPTConfig):
        super().__init__(config)
        on_meta = config.init_device == "meta"
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            self.transformer = MPTModel(config)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.d_model, config.vocab_size, bias=False)
            )
        scale = config.logit_scale
        self.logit_scale = 1 / math.sqrt(config.d_model) if scale == "inv_sqrt_d_model" else scale
        self.loss_chunks = DEFAULT_CHUNKS  # the fused loss's chunk sizes (layers.loss.LossChunks)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        return_logits: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        position_ids: torch.LongTensor | None = None,
        shift_labels: torch.LongTensor | None = None,
    ) -> CausalLMOutputWithPast:
        """Logits (batch, seq, vocab) and, given ``labels`` aligned with ``input_ids``, the
        next-token loss (see :func:`causal_lm_loss`). With labels and ``return_logits=False``
        the loss is fused with the output projection (:func:`linear_cross_entropy`: the
        vocabulary logits are never held whole) and ``logits`` is None. ``return_dict`` is
        accepted for Hugging Face callers; the result is always a ``CausalLMOutputWithPast``.
        ``logits_to_keep`` (as Hugging Face models take it): N > 0 keeps the last N positions'
        logits, a tensor of positions keeps those (without labels). ``shift_labels`` (with
        ``return_logits=False``, instead of labels): the target of each position, already
        shifted (a shard of a sequence, whose last position's target is the next shard's)."""
        h = self.transformer(input_ids, attention_mask, sequence_id, position_ids).last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor) or logits_to_keep:
            if labels is not None:
                raise ValueError("logits_to_keep and labels together: the loss needs every position")
            h = h[:, logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else h[:, -logits_to_keep:]
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        if shift_labels is not None and not return_logits:
            loss = self.fused_loss(h, weight, shift_labels, self.logit_scale)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        if labels is not None and not return_logits:
            loss = self.fused_loss(h[:, :-1], weight, labels[:, 1:], self.logit_scale,
                                   chunks=self.loss_chunks)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        logits = self.project_logits(h, weight, self.logit_scale)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> dict[str, Any]:
        """The whole prefix at every step (no KV cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}


# With this module imported, plain `AutoConfig` / `AutoModelForCausalLM.from_pretrained` load
# folders of model_type "foundryx_mpt" (exported MPT models; see docs/hf.md).
AutoConfig.register(MPTConfig.model_type, MPTConfig, exist_ok=True)
AutoModelForCausalLM.register(MPTConfig, MPTForCausalLM, exist_ok=True)
