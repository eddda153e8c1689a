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
               "loss_parallel": "loss_function"}}           # divides its size (FSDP2 refuses an
                                                            # uneven TP split); loss_parallel
                                                            # (optional): the owner's attribute
                                                            # holding its loss callable, called
                                                            # as fn(logits=, labels=, ...), run
                                                            # vocabulary-parallel on split logits

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
  vocabulary rows: the model's loss and logits take such a weight (MPT's fused loss runs
  vocabulary-parallel on it); calling the module would fail loudly (a DTensor weight).
- ``sequence_parallel``: a norm run on the rank's sequence shard (weights replicated).
- ``head_norm``: a norm over each head's features on a rank's own heads (Qwen3's and Gemma 3's
  q/k norms): weights replicated, their gradient summed over the TP ranks (head_norm.py).
- ``sequence_parallel_local``: as ``sequence_parallel``, its output a plain tensor (a norm whose
  output is added to the residual, as Gemma 3's post-attention and post-MLP norms are).
- ``sequence_parallel_start``: a block whose full-sequence input becomes the rank's shard.
- ``sequence_parallel_end``: a final norm on the shard, its output gathered back whole.
- ``gather_sequence`` / ``gather_sequence(<kwarg>)``: a module (attention, MLP) whose first
  positional input (or the named keyword input) is all-gathered from sequence shards.

This module imports no model class: it matches names and applies styles.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from foundryx.errors import ConfigError
from foundryx.parallel.head_norm import HeadNorm
from foundryx.parallel.loss_parallel import SplitLogits, loss_parallel, whole_logits
from foundryx.parallel.materialize import TP_ROWS_ATTR as ROWS_ATTR
from foundryx.parallel.tp_kv import (
    kv_problem,
    kv_rank_attrs,
    replicate_kv_projection,
    replicates_kv,
)

log = logging.getLogger(__name__)

LINEAR_STYLES = ("colwise", "colwise_fused", "colwise_gather", "colwise_loss_parallel", "rowwise")
KV_REPLICATED = "kv_replicated"  # a k or v projection replicated over the TP ranks (tp_kv.py)
PLAN_HOOK = "foundryx_tp_plan"  # HF models have a tp_plan of their own
# The models that declare a plan (said when a model without one asks for tp).
MODELS_WITH_PLANS = ("mpt_causal_lm (MPT)",
                     "hf_causal_lm with a Llama, Mistral/Ministral, Qwen2, Qwen3 or Gemma 3 "
                     "model")


def find_plan(model: nn.Module) -> tuple[str, nn.Module, dict[str, Any]] | None:
    """``(prefix, owner, plan)`` of the first owner (the model, then its direct children)
    that declares a plan; None when none does (or its plan is None)."""
    for name, owner in (("", model), *model.named_children()):
        fn = getattr(owner, PLAN_HOOK, None)
        if callable(fn):
            plan = fn()
            if plan is not None:
                return (f"{name}." if name else ""), owner, plan
    return None


def valid_degrees(numbers: dict[str, int]) -> list[int]:
    g = 0
    for v in numbers.values():
        g = math.gcd(g, int(v))
    return [d for d in range(1, g + 1) if g % d == 0] if g else [1]


def plan_problems(model: nn.Module, tp: int, model_name: str = "the model") -> list[str]:
    """What stops ``model`` from running at tensor-parallel degree ``tp`` (empty: nothing)."""
    if tp == 1:
        return []
    found = find_plan(model)
    if found is None:
        return [f"parallelism.tp: {tp}, but {model_name} declares no tensor-parallel plan; "
                f"models with one: {', '.join(MODELS_WITH_PLANS)} (or set tp: 1)"]
    plan = found[2]
    if plan.get("unsupported"):
        return [f"parallelism.tp: {tp}: {plan['unsupported']} (or set tp: 1)"]
    divisible, kv = plan.get("divisible", {}), plan.get("kv_heads")
    bad = {k: v for k, v in divisible.items() if int(v) % tp}
    if not bad and kv_problem(kv, tp) is None:
        return []
    degrees = [d for d in valid_degrees(divisible) if kv_problem(kv, d) is None]
    nearest = min(degrees, key=lambda d: (abs(d - tp), -d))
    valid = f"valid degrees: {', '.join(map(str, degrees))} (nearest: {nearest})"
    if not bad:
        return [f"{kv_problem(kv, tp)}; {valid}"]
    numbers = ", ".join(f"{k}={v}" for k, v in divisible.items())
    return [f"parallelism.tp: {tp} does not divide {', '.join(bad)} of the model ({numbers}); "
            f"{valid}"]


def interleaved_rows(sizes: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row order of a fused layer with parts of ``sizes`` rows such that the i-th of ``tp``
    equal blocks holds the i-th slice of every part (q_0 k_0 v_0 q_1 k_1 v_1 ...)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order: list[int] = []
    for r in range(tp):
        for start, n in zip(starts, sizes):
            c = n // tp
            order.extend(range(start + r * c, start + (r + 1) * c))
    return torch.tensor(order)


def _reorder_rows(module: nn.Module, tp: int) -> None:
    order = interleaved_rows(tuple(module._fused), tp)
    setattr(module, ROWS_ATTR, order)
    if callable(getattr(module, "reorder_rows", None)):  # a low-precision layer reorders its own
        module.reorder_rows(order)
        return
    with torch.no_grad():
        for p in (module.weight, getattr(module, "bias", None)):
            if p is not None and not p.is_meta:
                p.copy_(p[order])


def _cut(p: torch.Tensor, mesh: DeviceMesh, placement: Any, part: Any = None) -> torch.Tensor:
    """This rank's part of ``p`` as a DTensor, cut with ``narrow`` or, given, with ``part(dim,
    start, stop)`` (a low-precision layer's own cut: the weight keeps its storage, as a TP part
    when replicated too; every rank holds the same ``p``, so nothing is sent)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.detach()
    if isinstance(placement, Shard):
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, [placement])
        d = placement.dim
        local = (part(d, offset[d], offset[d] + shape[d]) if part is not None
                 else local.narrow(d, offset[d], shape[d]).clone())
    elif part is not None:
        local = part(0, 0, p.shape[0])
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=p.shape,
                              stride=p.stride())


def _cut_params(layout: dict[str, Any], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    part = getattr(module, "tp_part", None)  # a low-precision layer's cut of its weight
    for pname, p in list(module.named_parameters(recurse=False)):
        if p is not None:
            cut = _cut(p, mesh, layout[pname], part if pname == "weight" else None)
            module.register_parameter(pname, nn.Parameter(cut, requires_grad=p.requires_grad))


def _any_linear(style_cls: type, layout: dict[str, Any], input_layouts: tuple[Any, ...] | None):
    """``style_cls`` (torch's ColwiseParallel or RowwiseParallel) for a linear layer that is
    not an ``nn.Linear`` (a frozen low-precision layer: ``weight`` [out, in] in a storage
    subclass, dequantized when it runs): its parameters cut as ``layout`` says."""
    from functools import partial

    from torch.distributed.tensor.parallel.style import distribute_module

    class AnyLinear(style_cls):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            if input_layouts is not None:
                self.desired_input_layouts = input_layouts
            return distribute_module(
                module, device_mesh, partial(_cut_params, layout),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return AnyLinear


def _styles(style: str, module: nn.Module | None = None) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if module is not None and not isinstance(module, nn.Linear) and style in LINEAR_STYLES:
        colwise = _any_linear(ColwiseParallel, {"weight": Shard(0), "bias": Shard(0)}, None)
        rowwise = _any_linear(RowwiseParallel, {"weight": Shard(1), "bias": Replicate()},
                              (Shard(-1),))
    else:
        colwise, rowwise = ColwiseParallel, RowwiseParallel
    if style in ("colwise", "colwise_fused"):
        return [colwise()]
    if style == "colwise_loss_parallel":
        return [colwise(output_layouts=Shard(-1), use_local_output=False), SplitLogits()]
    if style == "vocab_parallel_embedding":
        return [rowwise(input_layouts=Replicate(), output_layouts=Replicate())]
    if style == "vocab_rows":
        return [_VocabRows()]
    if style == "colwise_gather":
        return [colwise(output_layouts=Replicate())]
    if style == "rowwise":
        return [rowwise(output_layouts=Shard(1))]
    if style == "sequence_parallel":
        return [SequenceParallel()]
    if style == "sequence_parallel_local":
        return [SequenceParallel(use_local_output=True)]
    if style == "head_norm":
        return [HeadNorm()]
    if style == "sequence_parallel_start":
        return [PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True)]
    if style == "sequence_parallel_end":
        return [SequenceParallel(),
                PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                    use_local_output=True)]
    if style == "gather_sequence":
        return [PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True)]
    if style.startswith("gather_sequence(") and style.endswith(")"):
        kw = style[len("gather_sequence("):-1]
        return [PrepareModuleInput(input_layouts=(), desired_input_layouts=(),
                                   input_kwarg_layouts={kw: Shard(1)},
                                   desired_input_kwarg_layouts={kw: Replicate()},
                                   use_local_output=True)]
    raise ValueError(f"tensor-parallel plan: unknown style {style!r}")


class _VocabRows(ParallelStyle):
    """A parallel style that only cuts a weight by rows (``Shard(0)``) and adds no hooks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel.style import distribute_module

        return distribute_module(module, device_mesh,
                                 partial(_cut_params, {"weight": Shard(0), "bias": Shard(0)}))


def _localise(module: nn.Module, attrs: list[str], tp: int) -> None:
    for a in attrs:
        v = getattr(module, a)
        setattr(module, a, tuple(x // tp for x in v) if isinstance(v, (tuple, list)) else v // tp)


def _apply_lora(module: nn.Module, style: str, tp_mesh: DeviceMesh, model_name: str) -> None:
    """torchtitan's rule for LoRA adapters on a split linear layer: column-wise base (a fused
    one's slices too) -> ``lora_A`` replicated, ``lora_B`` split by output rows (Shard(0));
    row-wise base -> ``lora_A`` split by input columns (Shard(1)), ``lora_B`` replicated (on
    the whole sequence; its output then cut to this rank's sequence shard, as the base
    layer's is)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    if style == "colwise_loss_parallel":  # the adapters' output would have to stay split too
        log.info("parallelism.tp: %s has LoRA adapters on the output projection; its logits "
                 "are gathered whole for the loss (no loss parallel)", model_name)
        style = "colwise_gather"
    if style == "colwise_fused":  # LoRA on slices of a fused layer (MPT's q, k, v of Wqkv):
        # its rows reordered as without LoRA, each slice's lora_B split like the slice's rows
        tp = tp_mesh.size()
        _reorder_rows(module.base_layer, tp)
        module.slice_sizes = tuple(n // tp for n in module.slice_sizes)
    for s in _styles(style, module.base_layer):
        parallelize_module(module.base_layer, tp_mesh, s)
    for key in module.lora_A:
        a, b = module.lora_A[key], module.lora_B[key]
        if style == "rowwise":
            # A's rank-r output summed whole (small), B on it, then this rank's sequence shard
            # (a Linear on a sequence-sharded DTensor would gather it anyway)
            parallelize_module(a, tp_mesh, RowwiseParallel(output_layouts=Replicate()))
            parallelize_module(b, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
        else:
            out = Replicate() if style == "colwise_gather" else Shard(-1)
            parallelize_module(b, tp_mesh, ColwiseParallel(output_layouts=out))


def _split_vocabulary(vocab: dict[str, Any] | None, layers: dict[str, str], tp: int,
                      model_name: str) -> str | None:
    """Add the plan's vocabulary-parallel styles to ``layers`` when ``tp`` divides the
    vocabulary (FSDP2 cannot shard an uneven TP split), saying so when it does not; returns
    the attribute of the loss to run vocabulary-parallel (None: none)."""
    if not vocab:
        return None
    if vocab["size"] % tp:
        log.info("parallelism.tp: %d does not divide the vocabulary of %s (%d): its embedding "
                 "and output projection stay whole on every TP rank (FSDP2 still shards them); a "
                 "vocabulary padded to a multiple of %d would split them", tp, model_name,
                 vocab["size"], tp)
        return None
    layers.update(vocab["layers"])
    return vocab.get("loss_parallel")


def _offload_group(world_mesh: DeviceMesh) -> Any:
    """The process group of the ranks that hold this rank's tensor-parallel block (the same
    ``tp`` coordinate, ``tp`` the last mesh dimension): an offloaded layer's rows are split
    over them. Every rank creates every group, as ``new_group`` asks."""
    import torch.distributed as tdist

    grid = world_mesh.mesh.reshape(-1, world_mesh.mesh.shape[-1])
    mine = None
    for j in range(grid.shape[1]):
        ranks = grid[:, j].tolist()
        group = tdist.new_group(ranks)
        if tdist.get_rank() in ranks:
            mine = group
    return mine


def _split_offloaded(module: nn.Module, style: str, tp_mesh: DeviceMesh, group: Any) -> None:
    """An offloaded frozen layer (its weight in host memory, not a parameter TP's styles cut)
    keeps its TP block, as the style cuts a weight (fused rows in TP's order; a replicated
    kv projection all of it)."""
    from torch.distributed.tensor import Replicate, Shard

    placement = (Shard(1) if style == "rowwise" else Replicate() if style == KV_REPLICATED
                 else Shard(0))
    module.offload.split_for_tp(tp_mesh, placement, group, getattr(module, ROWS_ATTR, None))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, model_name: str = "the model",
                          world_mesh: DeviceMesh | None = None) -> int:
    """Apply the model's plan over ``tp_mesh`` (the ``tp`` dimension of ``world_mesh``; None:
    tp is the whole world); returns how many modules it touched."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    offloaded = any(getattr(m, "offload", None) is not None for m in model.modules())
    group = _offload_group(world_mesh or tp_mesh) if offloaded else None
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
    loss_attr = _split_vocabulary(plan.get("vocab"), layers, tp, model_name)
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
            if style == KV_REPLICATED:  # the LoRA layer as a whole, when there is one
                replicate_kv_projection(module, tp_mesh, kv["count"],
                                        partial(_cut_params, defaultdict(Replicate)))
            elif hasattr(module, "base_layer"):  # a LoRA layer (peft's, or a fused one)
                _apply_lora(module, style, tp_mesh, model_name)
            else:
                split_logits |= style == "colwise_loss_parallel"
                if style == "colwise_fused":
                    _reorder_rows(module, tp)
                for s in _styles(style, module):
                    parallelize_module(module, tp_mesh, s)
            base = getattr(module, "base_layer", module)
            if getattr(base, "offload", None) is not None:
                _split_offloaded(base, style, tp_mesh, group)
            for n, p in module.named_parameters():  # TP styles make new nn.Parameters
                p.requires_grad_(trainable[n])
            touched += 1
    if split_logits and loss_attr:
        setattr(owner, loss_attr, loss_parallel(getattr(owner, loss_attr)))
        if callable(getattr(model, "eval_forward", None)):  # Composer's train metrics reuse
            model.eval_forward = whole_logits(model.eval_forward)  # the training outputs
    if not touched:
        raise ConfigError([f"parallelism.tp: the tensor-parallel plan of {model_name} matches no "
                           f"module (patterns {sorted(layers)[:3]} ...); the plan and the model "
                           "disagree"])
    return touched


TESTED_TORCH = ("2.7.0", "2.15.0")  # the two legs of make test; tests/test_tp.py runs on both
_MISSING_OP = re.compile(r"Operator (\S+) does not have a sharding strategy registered")


def missing_op_error(err: BaseException, tp: int) -> ConfigError | None:
    """The error to show for ``err`` when it is DTensor saying that this torch has no
    tensor-parallel rule for an operator the model runs (None: it is something else)."""
    found = _MISSING_OP.search(str(err))
    if tp == 1 or found is None:
        return None
    return ConfigError([
        f"parallelism.tp: {tp}: torch {torch.__version__} has no tensor-parallel (DTensor) rule "
        f"for {found.group(1)}, which this model runs; foundryx's tensor parallelism is tested "
        f"on torch {' and '.join(TESTED_TORCH)} (make install-modern installs "
        f"{TESTED_TORCH[-1]}); use one of those, or tp: 1"])


def fused_row_orders(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{state-dict key: row order}`` of the parameters TP reordered (a fused layer's weight
    and bias): the parameter's rows are its logical rows taken in that order. (foundryx's
    checkpointing and compile wrap no module, so module names are the state dict's.)"""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        order = getattr(module, ROWS_ATTR, None)
        if order is None:
            continue
        for p in ("weight", "bias"):
            if getattr(module, p, None) is not None:
                out[f"{name}.{p}" if name else p] = order
    return out


def permute_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Reorder a full (unsharded) state dict's fused rows as TP reordered the model's."""
    for key, order in fused_row_orders(model).items():
        if full.get(key) is not None:
            full[key] = full[key][order]


def unpermute_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`permute_full_state`: a full state dict of the TP model with its
    fused rows back in their logical order (what a model at tp 1 holds)."""
    for key, order in fused_row_orders(model).items():
        if full.get(key) is not None:
            full[key] = full[key][torch.argsort(order)]
