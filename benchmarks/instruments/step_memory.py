"""Device memory of one training step by category, on fake tensors (issue 46's instrument).

:class:`CategoryTracker` is a ``TorchDispatchMode`` run inside ``FakeTensorMode``: every storage
an op creates is counted (a tensor subclass by its inner tensors: an FP8 weight is its bytes
and its scales) until it is freed (a weak reference to the storage), and is given a category
when it is created:

- ``frozen base``: the frozen linear weights (a LoRA model's base layers), in their storage;
- ``parameters``: the other frozen parameters (embeddings, output head, norms);
- ``adapters + optimizer``: trainable parameters, their gradients and the optimizer's state;
- ``activations kept``: made in the forward pass and alive at the peak (what autograd saved,
  the checkpointed blocks' inputs);
- ``recomputed block``: made by a checkpointed block's forward run again inside backward;
- ``logits + loss``: tensors whose last dimension is the vocabulary (logits, their fp32 copy,
  log-probabilities, their gradients);
- ``backward temporaries``: the other tensors made in backward (activation gradients);
- ``offload prefetch``: host-to-device copies of offloaded frozen weights;
- ``FSDP2 all-gather``: unsharded parameters (0 on one process: foundryx does not wrap one
  rank in FSDP2);
- ``other``: the rest (inputs, optimizer-step temporaries).

Host memory is not device memory: tensors made under the ``host`` tag (offloaded activation
checkpoints' host copies, which are CPU tensors like every fake tensor here) are counted apart,
in :attr:`host_total` and its peak :attr:`host_peak`, and never in the device's peak.

At each new peak the running totals are kept, so the categories of the peak add up to the
peak exactly. ``torch.distributed._tools.mem_tracker.MemTracker`` (torch's own tracker)
counts the same storages in its own way; the tests hold the two peaks equal.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("frozen base", "parameters", "adapters + optimizer", "activations kept",
              "recomputed block", "logits + loss", "backward temporaries", "offload prefetch",
              "FSDP2 all-gather", "other")
GiB = 2**30
HOST = "host"  # the tag of host-memory tensors: counted apart from the device's


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes (a subclass's inner tensors, recursively)."""
    t = getattr(t, "_local_tensor", t)  # a DTensor's local part
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor \
            and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from inner_tensors(getattr(t, n))
    else:
        yield t


class CategoryTracker(TorchDispatchMode):
    """Live bytes by category over a step; :attr:`peak` and :attr:`at_peak` (bytes by category
    when the total was highest)."""

    def __init__(self, vocab_size: int, grads_of: Iterable[nn.Parameter] = ()) -> None:
        super().__init__()
        self.vocab = vocab_size
        self.live: dict[int, tuple[int, str]] = {}  # storage key -> (bytes, category)
        self.totals: dict[str, int] = defaultdict(int)
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.phase = "forward"
        self.module_depth = 0  # > 0 while a module's forward runs (recompute in backward)
        self.tag: str | None = None  # a category forced by the caller (offload copies)
        self.trainable = list(grads_of)
        self.host_total = self.host_peak = 0  # bytes tagged HOST: host memory, not the device's

    # -- registering storages ------------------------------------------------------------
    def add(self, t: torch.Tensor, category: str) -> None:
        for leaf in inner_tensors(t):
            if leaf.device.type == "meta":
                continue
            st = leaf.untyped_storage()
            key = id(st)
            if key in self.live:
                continue
            nbytes = st.nbytes()
            self.live[key] = (nbytes, category)
            weakref.finalize(st, self._free, key)
            if category == HOST:
                self.host_total += nbytes
                self.host_peak = max(self.host_peak, self.host_total)
                continue
            self.totals[category] += nbytes
            self.total += nbytes
        self._maybe_peak()

    def _free(self, key: int) -> None:
        nbytes, category = self.live.pop(key, (0, "other"))
        if category == HOST:
            self.host_total -= nbytes
            return
        self.totals[category] -= nbytes
        self.total -= nbytes

    def _maybe_peak(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            snap = dict(self.totals)
            # gradients are made by backward ops: at the peak they count with the adapters
            moved = 0
            for p in self.trainable:
                if p.grad is not None:
                    for leaf in inner_tensors(p.grad):
                        entry = self.live.get(id(leaf.untyped_storage()))
                        if entry is not None and entry[1] != "adapters + optimizer":
                            snap[entry[1]] -= entry[0]
                            moved += entry[0]
            snap["adapters + optimizer"] = snap.get("adapters + optimizer", 0) + moved
            self.at_peak = snap

    def register_model(self, model: nn.Module, frozen_linear: set[int]) -> None:
        """The parameters and buffers there before the step: ``frozen_linear``, the ids of the
        frozen linear weights (the base), counted as ``frozen base``."""
        for p in model.parameters():
            cat = ("adapters + optimizer" if p.requires_grad
                   else "frozen base" if id(p) in frozen_linear else "parameters")
            self.add(p, cat)
        for b in model.buffers():
            self.add(b, "parameters")

    # -- categories of new tensors ----------------------------------------------------------
    def category(self, t: torch.Tensor) -> str:
        if self.tag is not None:
            return self.tag
        if t.dim() and t.shape[-1] == self.vocab:
            return "logits + loss"
        if self.phase == "forward":
            return "activations kept"
        if self.phase == "backward":
            return "recomputed block" if self.module_depth > 0 else "backward temporaries"
        if self.phase == "optimizer":
            return "adapters + optimizer"
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in _VIEWS:
            return out
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.add(t, self.category(t))
        return out

    # -- phases ---------------------------------------------------------------------------
    def in_phase(self, phase: str) -> contextlib.AbstractContextManager:
        return setting(self, "phase", phase)

    def tagged(self, category: str) -> contextlib.AbstractContextManager:
        return setting(self, "tag", category)

    def watching_modules(self) -> contextlib.AbstractContextManager:
        """Count module forwards (a checkpointed block's recompute runs them in backward)."""

        def pre(module, args):  # noqa: ANN001, ANN202
            self.module_depth += 1

        def post(module, args, out):  # noqa: ANN001, ANN202
            self.module_depth -= 1

        return module_hooks(pre, post)

    def report(self) -> dict:
        """``{"peak_gib": x, "categories": {name: gib}}`` at the peak (every category named)."""
        cats = {c: self.at_peak.get(c, 0) / GiB for c in CATEGORIES}
        extra = {c: v / GiB for c, v in self.at_peak.items() if c not in CATEGORIES}
        out = {"peak_gib": self.peak / GiB, "categories": {**cats, **extra}}
        if self.host_peak:
            out["host_peak_gib"] = self.host_peak / GiB
        return out


@contextlib.contextmanager
def setting(obj: object, attr: str, value: object) -> Iterator[None]:
    """``obj.attr`` set to ``value`` for a while."""
    before = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, before)


@contextlib.contextmanager
def module_hooks(pre, post) -> Iterator[None]:  # noqa: ANN001
    """Global forward pre- and post-hooks on every module (``post`` runs even when the
    forward raises) for a while."""
    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


_VIEWS = {torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.t,
          torch.ops.aten.transpose, torch.ops.aten.permute, torch.ops.aten.expand,
          torch.ops.aten.slice, torch.ops.aten.select, torch.ops.aten.unsqueeze,
          torch.ops.aten.squeeze, torch.ops.aten.detach, torch.ops.aten.alias,
          torch.ops.aten.as_strided, torch.ops.aten.split, torch.ops.aten.chunk,
          torch.ops.aten.unbind, torch.ops.aten.reshape}
