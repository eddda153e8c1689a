"""The prefetch chain of offloaded layers: each layer, when its weight is taken, starts the
copy of the weight wanted next (the next layer's in a forward pass, the previous one's in
backward), and takes its own from the copy started for it. A copy started inside backward
that nothing took is dropped when that backward ends, so none waits through the optimizer
step. What a copy is, is the source's (:meth:`PrefetchLink._copy`)."""

from __future__ import annotations

import torch


class PrefetchLink:
    """One link of the chain: ``next`` and ``prev`` (forward order), the copy started ahead of
    use (``pending``: its device, tensor and event) and the backward pass that last took the
    weight. A subclass makes the copies (:meth:`_copy`)."""

    def __init__(self) -> None:
        self.next: PrefetchLink | None = None
        self.prev: PrefetchLink | None = None
        self.backward_task = -1  # the autograd graph task whose backward last took the weight
        self.pending: tuple[torch.device, torch.Tensor, object] | None = None
        self.prefetches = 0  # copies started ahead of use (numbers them)

    def _copy(self, device: torch.device) -> tuple[torch.Tensor, object]:
        """The weight copied to ``device`` and the event the copy is done at (None: done)."""
        raise NotImplementedError

    def prefetch(self, device: torch.device) -> None:
        """Start the copy :meth:`claim` will use. One started inside backward is dropped when
        that backward ends if nothing took it (the first layer's weight, whose backward needs
        no input gradient): no copy waits through the optimizer step."""
        if self.pending is not None:
            return
        self.pending = (device, *self._copy(device))
        self.prefetches += 1
        if torch._C._current_graph_task_id() != -1:
            # the callback names the copy by its number: a closure holding the copy itself
            # would keep every copy made in backward alive until backward ends (the flagship
            # estimate saw it: all offloaded weights on the device at once)
            number = self.prefetches
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._drop(number))

    def _drop(self, number: int) -> None:
        if self.pending is not None and self.prefetches == number:
            self.pending = None

    def claim(self, device: torch.device, backward: bool) -> tuple[torch.Tensor, object]:
        """The copy on ``device`` prefetched for this layer, else a fresh one, and its event;
        in ``backward``, the pass is noted (:meth:`following` reads it)."""
        if self.pending is not None and self.pending[0] == device:
            _, w, event = self.pending
        else:
            w, event = self._copy(device)
        self.pending = None
        if backward:
            self.backward_task = torch._C._current_graph_task_id()
        return w, event

    def following(self, backward: bool) -> PrefetchLink | None:
        """The layer whose weight is wanted next, to prefetch: backward runs the layers
        reversed (``prev``); a forward runs them in order (``next``). A checkpointed block's
        forward run again inside backward (a recompute) wants ``next`` only when that layer's
        backward has not run yet in this backward pass: a layer with nothing saved for
        backward (a frozen layer without an adapter) runs its backward before the block is
        recomputed, and the blocks after this one are done."""
        if backward:
            return self.prev
        task = torch._C._current_graph_task_id()
        if task == -1:  # a forward pass proper
            return self.next
        return self.next if self.next is not None and self.next.backward_task != task else None


def chain(links: list[PrefetchLink]) -> None:
    """Link ``links`` (in forward order) into one chain."""
    for a, b in zip(links, links[1:]):
        a.next, b.prev = b, a
