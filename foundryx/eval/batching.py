"""How many rows a batch of a generation task holds (``generation_batch_size``).

A scored row holds its ``max_seq_len x vocabulary`` float32 logits; a generation row holds its
KV cache (``2 x layers x kv heads x head dim`` values a token) and one row of logits a step.
So in the memory a scoring batch takes, many more generation rows fit, and each decoding step
(one forward of every running row) then serves more of them: the decoding steps of a task,
which are most of an ICL suite's time, fall with the batch. ``auto`` (the default) sizes the
generation batch so that its KV caches at ``max_seq_len`` take no more than a scoring batch's
logits, at least ``device_eval_batch_size`` rows and at most :data:`AUTO_CAP`; a number sets
it; each run says in one line what it picked and why.
"""

from __future__ import annotations

from typing import Any

from foundryx.eval.generate import generation_model
from foundryx.runtime.hf_compat import cache_argument

AUTO_CAP = 32  # rows: past this a CPU's decoding step grows about as fast as its rows


def kv_row_bytes(model: Any, tokens: int) -> int | None:
    """One row's KV cache at ``tokens`` tokens, from the model's Hugging Face config and
    parameter dtype; None when the model keeps no KV cache foundryx can size (foundryx's MPT
    generates without one)."""
    hf = generation_model(model)
    cfg = getattr(hf, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if getattr(hf, "native", False):  # foundryx's own Llama: its KVCache, as transformers'
        caches = True
    else:
        from foundryx.eval.kv_cache import new_cache  # transformers' cache classes: HF only

        caches = cache_argument(hf) is not None and new_cache(hf) is not None
    if cfg is None or not caches or not layers or not heads:
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    width = next(hf.parameters()).element_size()
    return 2 * layers * kv * head_dim * tokens * width


def generation_rows(setting: int | str | None, scoring_rows: int, model: Any, tokens: int,
                    vocab: int) -> tuple[int, str]:
    """``(rows, why)``: the rows of a generation batch for ``generation_batch_size`` =
    ``setting`` (a number: itself; None: ``scoring_rows``; ``auto``: see the module doc), with
    ``scoring_rows`` = ``device_eval_batch_size`` and rows of ``tokens`` tokens."""
    if setting is None:
        return scoring_rows, (f"generation tasks take {scoring_rows} rows a batch, as scoring "
                              "tasks do (generation_batch_size: null)")
    if isinstance(setting, int):
        return setting, f"generation tasks take {setting} rows a batch (generation_batch_size)"
    per_row = kv_row_bytes(model, tokens)
    if per_row is None:
        return scoring_rows, (f"generation tasks take {scoring_rows} rows a batch, as scoring "
                              "tasks do (generation_batch_size: auto: the model keeps no KV cache "
                              "to size a generation row by)")
    logits = scoring_rows * tokens * vocab * 4
    rows = max(scoring_rows, min(AUTO_CAP, logits // (per_row + vocab * 4)))
    return rows, (f"generation tasks take {rows} rows a batch (generation_batch_size: auto): a "
                  f"row's KV cache at {tokens} tokens is {_size(per_row)}, a scoring "
                  f"batch of {scoring_rows} holds {_size(logits)} of logits; at least "
                  f"device_eval_batch_size, at most {AUTO_CAP} rows; set generation_batch_size "
                  "to choose")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"
