"""The ICL accuracy rules, apart from how their rows are stored.

Each rule (:class:`LanguageModelingRule`, :class:`MultipleChoiceRule`, :class:`LMEvalRule`,
:class:`GenerationRule`) turns a batch and the model's outputs into rows of state
(``update``) and the rows into one outcome per example (``outcomes``). Rows are kept with
their example id, category and a ``primary`` flag, and grouped only in ``outcomes``, so the
result does not depend on the batch size or on how batches are split. A task's score is the
mean over its categories of the per-category accuracy (LLM Foundry's gauntlet convention);
without categories that is the plain accuracy.

Two stores hold the rows: torchmetrics' ``Metric`` (:mod:`foundryx.eval.metrics`, the
``metrics`` registry's classes, which Composer's evaluators and a multi-process eval use: its
states are gathered across ranks) and :class:`LocalRows` here, plain lists in one process,
which ``foundryx eval`` uses on one process so that it need not import torchmetrics (2 s of
imports, its text metrics import transformers). Both run the same rule code.
"""

from __future__ import annotations

import contextlib
import re
import string
from collections.abc import Iterator
from typing import Any

import torch


class RowRule:
    """Base of the rules: ``extra_states`` beyond (example_id, category, primary), and the
    per-example grouping. A store provides ``_add(batch, **values)`` and ``_rows()``."""

    extra_states: tuple[str, ...] = ("correct",)

    def _add(self, batch: dict[str, Any], **values: torch.Tensor) -> None:
        raise NotImplementedError

    def _rows(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def outcomes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(example ids, correct, category) with one entry per example, sorted by id (this
        process's rows; see :meth:`category_scores`)."""
        rows = self._rows()
        order = torch.argsort(rows["example_id"], stable=True)
        return rows["example_id"][order], rows["correct"][order].bool(), rows["category"][order]

    def category_scores(self) -> dict[int, float]:
        """Accuracy per category id. Like :meth:`outcomes`, it reads this process's rows; call
        it inside ``with metric.sync_context():`` to see every process's."""
        _, correct, category = self.outcomes()
        return {int(c): correct[category == c].double().mean().item() for c in category.unique()}


def macro_average(category_scores: dict[int, float]) -> float:
    """A task's score: the mean of its category accuracies (NaN without examples)."""
    scores = list(category_scores.values())
    return sum(scores) / len(scores) if scores else float("nan")


def keep_primary(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows of primary examples (padding rows of a multi-process split are not)."""
    keep = rows.pop("primary").bool()
    return {n: v[keep] for n, v in rows.items()}


def _span_mask(batch: dict[str, Any], width: int) -> torch.Tensor:
    """(rows, width - 1): True where position t predicts a continuation token t + 1."""
    pos = torch.arange(width - 1, device=batch["input_ids"].device)
    return (pos >= batch["cont_start"][:, None] - 1) & (pos < batch["cont_end"][:, None] - 1)


class LanguageModelingRule(RowRule):
    """Correct when every continuation token is the model's argmax."""

    def update(self, batch: dict[str, Any], outputs: torch.Tensor, labels: Any = None) -> None:
        mask = _span_mask(batch, outputs.shape[1])
        pred = outputs[:, :-1][mask].argmax(-1)
        hit = pred == batch["input_ids"][:, 1:][mask]
        rows = mask.nonzero()[:, 0]
        misses = torch.zeros(len(mask), device=hit.device).index_add_(0, rows, (~hit).float())
        correct = misses == 0
        self._add(batch, correct=correct)
        self.last_update = {"correct": correct.tolist(), "predicted": _split(pred, rows, len(mask))}


class MultipleChoiceRule(RowRule):
    """The row (choice or context option) with the lowest mean per-token loss of the
    continuation wins; ties go to the lowest index."""

    extra_states = ("choice", "gold", "loss")

    def update(self, batch: dict[str, Any], outputs: torch.Tensor, labels: Any = None) -> None:
        mask = _span_mask(batch, outputs.shape[1])
        logits = outputs[:, :-1][mask].float()
        token_loss = torch.nn.functional.cross_entropy(
            logits, batch["input_ids"][:, 1:][mask], reduction="none")
        rows = mask.nonzero()[:, 0]
        n = len(mask)
        total = torch.zeros(n, device=logits.device, dtype=torch.float64).index_add_(
            0, rows, token_loss.double())
        count = torch.zeros(n, device=logits.device, dtype=torch.float64).index_add_(
            0, rows, torch.ones_like(token_loss, dtype=torch.float64))
        loss = total / count
        self._add(batch, choice=batch["choice"], gold=batch["gold"], loss=loss)
        self.last_update = {"loss": loss.tolist(), "tokens": count.long().tolist()}

    def outcomes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self._rows()
        ids, inverse = torch.unique(r["example_id"], return_inverse=True)
        n = len(ids)
        best = torch.full((n,), float("inf"), dtype=r["loss"].dtype, device=ids.device)
        best = best.scatter_reduce(0, inverse, r["loss"], reduce="amin")
        winner = torch.where(r["loss"] == best[inverse], r["choice"], torch.iinfo(torch.long).max)
        chosen = torch.full((n,), torch.iinfo(torch.long).max, device=ids.device).scatter_reduce(
            0, inverse, winner.long(), reduce="amin")
        gold = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(0, inverse, r["gold"].long())
        category = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(
            0, inverse, r["category"].long())
        return ids, chosen == gold, category


class LMEvalRule(RowRule):
    """lm-eval-harness's multiple-choice metrics (``scoring: lm_eval``): ``acc``, the row with
    the highest sum of the continuation's log-probabilities wins; ``acc_norm``, the highest sum
    divided by the choice's length (lm-eval's ``len(choice)``: characters). Ties go to the
    lowest index, as numpy's argmax gives them. ``compute`` gives ``acc``."""

    extra_states = ("choice", "gold", "loglik", "norm_len")

    def update(self, batch: dict[str, Any], outputs: torch.Tensor, labels: Any = None) -> None:
        mask = _span_mask(batch, outputs.shape[1])
        logprobs = torch.log_softmax(outputs[:, :-1][mask].float(), dim=-1)
        token_lp = logprobs.gather(1, batch["input_ids"][:, 1:][mask][:, None])[:, 0]
        rows = mask.nonzero()[:, 0]
        n = len(mask)
        loglik = torch.zeros(n, device=token_lp.device, dtype=torch.float64).index_add_(
            0, rows, token_lp.double())
        self._add(batch, choice=batch["choice"], gold=batch["gold"], loglik=loglik,
                  norm_len=batch["norm_len"].double())
        self.last_update = {"loglik": loglik.tolist()}

    def _winners(self, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self._rows()
        ids, inverse = torch.unique(r["example_id"], return_inverse=True)
        n = len(ids)
        best = torch.full((n,), -float("inf"), dtype=score.dtype, device=ids.device)
        best = best.scatter_reduce(0, inverse, score, reduce="amax")
        big = torch.iinfo(torch.long).max
        winner = torch.where(score == best[inverse], r["choice"].long(), big)
        chosen = torch.full((n,), big, device=ids.device).scatter_reduce(0, inverse, winner,
                                                                           reduce="amin")
        gold = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(0, inverse, r["gold"].long())
        category = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(
            0, inverse, r["category"].long())
        return ids, chosen == gold, category

    def outcomes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._winners(self._rows()["loglik"])

    def norm_outcomes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :meth:`outcomes`, for ``acc_norm``."""
        r = self._rows()
        return self._winners(r["loglik"] / r["norm_len"])

    def acc_norm(self) -> float:
        _, correct, _ = self.norm_outcomes()
        return correct.double().mean().item() if len(correct) else float("nan")


_PUNCTUATION = set(string.punctuation + "‘’´`")


def normalize_answer(text: str) -> str:
    """Lower-case; punctuation and underscores to spaces; drop a, an, the; collapse spaces."""
    text = "".join(" " if ch in _PUNCTUATION else ch for ch in text.replace("_", " ").lower())
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def clean_output(text: str, options: dict[str, Any]) -> str:
    """A generation cut at the first stop sequence, after the last cot delimiter, normalised
    (or just stripped)."""
    for stop in options["stop_sequences"]:
        text = text.split(stop)[0]
    if options["cot_delimiter"]:
        text = text.split(options["cot_delimiter"])[-1]
    return normalize_answer(text) if options["do_normalization"] else text.strip()


class GenerationRule(RowRule):
    """Correct when the cleaned greedy output starts with the cleaned answer or an alias."""

    def update(self, batch: dict[str, Any], outputs: list[str], labels: Any = None) -> None:
        opts = batch["icl_options"]
        norm = normalize_answer if opts["do_normalization"] else str.strip
        cleaned = [clean_output(o, opts) for o in outputs]
        correct = [any(c.startswith(a) for a in map(norm, answers) if a)
                   for c, answers in zip(cleaned, batch["answers"])]
        self._add(batch, correct=torch.tensor(correct, device=batch["example_id"].device))
        self.last_update = {"output": list(outputs), "cleaned": cleaned, "correct": correct}


def _split(values: torch.Tensor, rows: torch.Tensor, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for r, v in zip(rows.tolist(), values.tolist()):
        out[r].append(v)
    return out


class LocalRows(RowRule):
    """A rule's rows in plain lists of tensors, for an eval in one process: the calls the
    runner makes on a torchmetrics ``Metric`` (``update``, ``last_update``, ``sync_context``,
    ``compute``, ``to``), without torchmetrics. ``sync_context`` has no other process to
    gather from."""

    needs_batch = True  # Composer's update_metric passes the batch (a model's fallback path)

    def __init__(self) -> None:
        self.last_update: dict[str, list] = {}  # per-row details of the last update (for dumps)
        self._lists: dict[str, list[torch.Tensor]] = {
            n: [] for n in ("example_id", "category", "primary", *self.extra_states)}
        self.device = torch.device("cpu")

    def to(self, device: Any) -> LocalRows:
        self.device = torch.device(device)  # where the batches are; each row stays where it is
        return self

    def _add(self, batch: dict[str, Any], **values: torch.Tensor) -> None:
        for name in ("example_id", "category", "primary"):
            self._lists[name].append(batch[name].detach())
        for name, v in values.items():
            self._lists[name].append(v.detach())

    def _rows(self) -> dict[str, torch.Tensor]:
        rows = {n: torch.cat(v) if v else torch.zeros(0) for n, v in self._lists.items()}
        return keep_primary(rows)

    @contextlib.contextmanager
    def sync_context(self) -> Iterator[None]:
        yield

    def compute(self) -> torch.Tensor:
        return torch.tensor(macro_average(self.category_scores()), dtype=torch.float64)


class LanguageModelingRows(LanguageModelingRule, LocalRows):
    pass


class MultipleChoiceRows(MultipleChoiceRule, LocalRows):
    pass


class LMEvalRows(LMEvalRule, LocalRows):
    pass


class GenerationRows(GenerationRule, LocalRows):
    pass
