"""Tensor and sequence parallelism from the plan a model declares as data.

A model (the ComposerModel or one of its direct children, as for the FSDP hooks of
:mod:`foundryx.parallel.policy`) offers ``foundryx_tp_plan()``, which returns plain data::

    {"layers": {"<module-name pattern>": "<style>", ...},   # fnmatch patterns, relative
     "local": {"<pattern>": ["n_heads", ...]},              # int (or tuple) attributes that
                                                            # become per-rank: divided by tp
     "divisible": {"n_heads": 8, "kv_n_heads": 2, ...},     # numbers tp must divide
     "kv_heads": {...},                                     # optional: kv heads replicated
                                                            # when fewer than tp (tp_kv.py)
     "vocab": {"size": 50368,                               # optional: the embedding and head
               "layers": {"<pattern>": "<style>", ...},     # split by vocabulary, when tp
               "loss_parallel": "loss_function",            # divides its size (FSDP2 refuses an
               "readers": {"loss": "fused_loss", ...}}}     # uneven TP split); loss_parallel
                                                            # (optional): the owner's attribute
                                                            # holding its loss callable, called
                                                            # as fn(logits=, labels=, ...), run
                                                            # vocabulary-parallel on split logits;
                                                            # readers (optional): the owner's
                                                            # functions that read the split
                                                            # weight, replaced by their
                                                            # vocabulary-parallel forms
                                                            # (vocab_rows.py)

The styles (torch.distributed.tensor.parallel underneath, in torchtitan's manner):

- ``colwise`` / ``rowwise``: the linear layer's output / input features split over the TP
  ranks; ``rowwise`` hands back a sequence shard (sequence parallel between the two).
- ``colwise_fused``: a fused projection (MPT's ``Wqkv``) whose ``_fused`` row sizes name its
  logical parts: each part is split by heads, and the rows reordered so that each rank's block
  is its q, k and v heads (a plain column split of the raw rows would be wrong).
- ``colwise_gather``: column-wise with the output gathered (the LM head: full logits).
- ``colwise_loss_parallel``: the LM head column-wise with its logits left split by vocabulary
  in training (a DTensor, for the loss named by the vocab's ``loss_parallel``), gathered whole in
  eval (metrics, ICL).
- ``vocab_parallel_embedding``: an embedding split by vocabulary rows, its output summed whole.
- ``vocab_rows``: a head whose weight the model reads (never calling the module) split by
  vocabulary rows: the plan's vocab ``readers`` (MPT's fused loss and logits) are replaced by
  their vocabulary-parallel forms (vocab_rows.py); calling the module would fail loudly (a
  DTensor weight).
- ``sequence_parallel``: a norm run on the rank's sequence shard (weights replicated).
- ``head_norm``: a norm over each head's features on a rank's own heads (Qwen3's and Gemma 3's
  q/k norms): weights replicated, their gradient summed over the TP ranks (head_norm.py).
- ``sequence_parallel_local``: as ``sequence_parallel``, its output a plain tensor (a norm whose
  output is added to the residual, as Gemma 3's post-attention and post-MLP norms are).
- ``sequence_parallel_start``: a block whose full-sequence input becomes the rank's shard.
- ``sequence_parallel_end``: a final norm on the shard, its output gathered back whole.
- ``gather_sequence`` / ``gather_sequence(<kwarg>)``: a module (attention, MLP) whose first
  positional input (or the named keyword input) is all-gathered from sequence shards.

This module imports no model class: it matches names and applies styles. Its parts: the plan's
checks (tp_plan.py), the styles (tp_styles.py), LoRA on split layers (tp_lora.py), offloaded
layers (tp_offload.py), fused rows in full state dicts (tp_fused.py), kv heads (tp_kv.py),
readers of a vocabulary-split weight (vocab_rows.py).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundryx.errors import ConfigError
from foundryx.parallel.loss_parallel import loss_parallel, whole_logits
from foundryx.parallel.tp_kv import kv_rank_attrs, replicate_kv_projection, replicates_kv
from foundryx.parallel.tp_lora import apply_lora
from foundryx.parallel.tp_offload import KV_REPLICATED, offload_group, split_offloaded
from foundryx.parallel.tp_plan import find_plan, missing_op_error, plan_problems
from foundryx.parallel.tp_styles import cut_params, reorder_fused_rows, styles_for
from foundryx.parallel.vocab_rows import READERS

log = logging.getLogger(__name__)

__all__ = ["apply_tensor_parallel", "missing_op_error", "plan_problems"]


def _localise(module: nn.Module, attrs: list[str], tp: int) -> None:
    for a in attrs:
        v = getattr(module, a)
        setattr(module, a, tuple(x // tp for x in v) if isinstance(v, (tuple, list)) else v // tp)


def _split_vocabulary(vocab: dict[str, Any] | None, layers: dict[str, str], tp: int,
                      model_name: str, owner: nn.Module) -> str | None:
    """Add the plan's vocabulary-parallel styles to ``layers`` when ``tp`` divides the
    vocabulary (FSDP2 cannot shard an uneven TP split), saying so when it does not, and give
    the model the vocabulary-parallel forms of the readers of the split weight it names
    (vocab_rows.py); returns the attribute of the loss to run on split logits (None: none)."""
    if not vocab:
        return None
    if vocab["size"] % tp:
        log.info("parallelism.tp: %d does not divide the vocabulary of %s (%d): its embedding "
                 "and output projection stay whole on every TP rank (FSDP2 still shards them); a "
                 "vocabulary padded to a multiple of %d would split them", tp, model_name,
                 vocab["size"], tp)
        return None
    layers.update(vocab["layers"])
    for kind, attr in vocab.get("readers", {}).items():
        setattr(owner, attr, READERS[kind](getattr(owner, attr)))
    return vocab.get("loss_parallel")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                          model_name: str = "the model", *, world_mesh: DeviceMesh) -> int:
    """Apply the model's plan over ``tp_mesh`` (the ``tp`` dimension of ``world_mesh``);
    returns how many modules it touched."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    offloaded = any(getattr(m, "offload", None) is not None for m in model.modules())
    group = offload_group(world_mesh) if offloaded else None
    problems = plan_problems(model, tp, model_name)
    if problems:
        raise ConfigError(problems)
    prefix, owner, plan = find_plan(model)
    layers: dict[str, str] = dict(plan["layers"])
    local: dict[str, list[str]] = plan.get("local", {})
    kv = plan.get("kv_heads")
    rank_attrs: dict[str, dict[str, int]] = {}
    if replicates_kv(kv, tp):  # fewer kv heads than ranks: k and v replicated (tp_kv.py)
        layers.update(dict.fromkeys(kv["layers"], KV_REPLICATED))
        rank_attrs = kv_rank_attrs(kv, tp)
        log.info("parallelism.tp: %d: %s has %d kv heads, fewer than the TP ranks: k and v are "
                 "replicated over them, each rank using its q heads' kv head", tp, model_name,
                 kv["count"])
    loss_attr = _split_vocabulary(plan.get("vocab"), layers, tp, model_name, owner)
    touched, split_logits = 0, False
    for name, module in list(model.named_modules()):
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix):]
        for pattern, attrs in local.items():
            if fnmatch.fnmatchcase(rel, pattern):
                _localise(module, attrs, tp)
        for pattern, attrs in rank_attrs.items():  # the rank's q heads share its one kv head
            if fnmatch.fnmatchcase(rel, pattern):
                for attr, value in attrs.items():
                    setattr(module, attr, value)
        for pattern, style in layers.items():
            if not fnmatch.fnmatchcase(rel, pattern):
                continue
            trainable = {n: p.requires_grad for n, p in module.named_parameters()}
            if getattr(module, "one_pass", False):  # its adapters become DTensors (split or
                module.one_pass = False  # replicated): PEFT's forward runs them (said below)
            if style == KV_REPLICATED:  # the LoRA layer as a whole, when there is one
                replicate_kv_projection(module, tp_mesh, kv["count"],
                                        partial(cut_params, defaultdict(Replicate)))
            elif hasattr(module, "base_layer"):  # a LoRA layer (peft's, or a fused one)
                apply_lora(module, style, tp_mesh, model_name)
            else:
                split_logits |= style == "colwise_loss_parallel"
                if style == "colwise_fused":
                    reorder_fused_rows(module, tp)
                for s in styles_for(style, module):
                    parallelize_module(module, tp_mesh, s)
            base = getattr(module, "base_layer", module)
            if getattr(base, "offload", None) is not None:
                split_offloaded(base, style, tp_mesh, group)
            for n, p in module.named_parameters():  # TP styles make new nn.Parameters
                p.requires_grad_(trainable[n])
            touched += 1
    if any(getattr(m, "one_pass", None) is False for m in model.modules()):
        log.info("parallelism.tp: the LoRA layers split by tensor parallelism run PEFT's own "
                 "adapter forward (the one-pass adapter path takes whole adapters)")
    if split_logits and loss_attr:
        setattr(owner, loss_attr, loss_parallel(getattr(owner, loss_attr)))
        if callable(getattr(model, "eval_forward", None)):  # Composer's train metrics reuse
            model.eval_forward = whole_logits(model.eval_forward)  # the training outputs
    if not touched:
        raise ConfigError([f"parallelism.tp: the tensor-parallel plan of {model_name} matches no "
                           f"module (patterns {sorted(layers)[:3]} ...); the plan and the model "
                           "disagree"])
    return touched


def unfuse_loss_without_reader(model: nn.Module, model_name: str = "the model") -> bool:
    """After tensor parallelism: a model whose training step fuses its loss with the output
    head (``fuses_loss``) keeps it only when its plan names a fused-loss reader that knows
    the head's rows are split (MPT's ``readers: {loss: ...}``); otherwise the model's own loss
    runs (under loss_parallel where the head's logits stay split), said in one line. Returns
    whether it turned the fused loss off. Under FSDP2 alone the loss stays fused
    (fsdp.register_forward_methods)."""
    found = find_plan(model)
    readers = ((found[2].get("vocab") or {}).get("readers", {})) if found else {}
    if not getattr(model, "fuses_loss", False) or "loss" in readers:
        return False
    model.fuses_loss = False
    log.info("fused loss: off under tensor parallelism: %s's plan names no fused-loss reader "
             "for a TP-split output head, so the model's own loss runs (the whole logits of "
             "each TP rank's tokens; under loss_parallel where the head's logits stay split)",
             model_name)
    return True
