"""Mixing streams in the ``text`` loader: proportions, repeat/choose, the mix table, errors."""

from __future__ import annotations

import logging

import pytest
from config_checks import section_problems

from foundryx.data.convert import convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.data.text import build_text_dataloader
from foundryx.errors import ConfigError

SEQ = 16


@pytest.fixture(scope="module")
def two_streams(tmp_path_factory, tiny_tokenizer):
    """Two MDS datasets of different text (``a``: ~2x the samples of ``b``) and their rows."""
    root = tmp_path_factory.mktemp("streams")
    rows = {}
    for name, n_docs, seed in (("a", 120, 1), ("b", 60, 2)):
        src = root / f"{name}.txt"
        src.write_text("\n\n".join(generate_corpus(n_docs, seed=seed)) + "\n")
        convert_to_mds(src, root / name / "train", tiny_tokenizer, SEQ, progress=False)
        from streaming import LocalDataset

        ds = LocalDataset(str(root / name / "train"))
        rows[name] = {tuple(ds[i]["tokens"].tolist()) for i in range(len(ds))}
    assert not rows["a"] & rows["b"]
    return root, rows


def mixed_cfg(root, weights: dict[str, dict], **dataset) -> dict:
    streams = {name: {"local": str(root / name), "split": "train", **w} for name, w in weights.items()}
    ds = {"streams": streams, "max_seq_len": SEQ, "shuffle": True, "shuffle_seed": 3, **dataset}
    return {"dataset": ds, "drop_last": False}


def loader_problems(options: dict) -> list[str]:
    return section_problems("dataloaders", "text", options)


def origins(spec, rows, limit=None) -> list[str]:
    out = []
    for batch in spec.dataloader:
        for row in map(tuple, batch["input_ids"].tolist()):
            out.append("a" if row in rows["a"] else "b" if row in rows["b"] else "?")
        if limit and len(out) >= limit:
            break
    return out[:limit] if limit else out


def test_proportions_hold_within_2_percent(two_streams, tiny_tokenizer, caplog):
    root, rows = two_streams
    cfg = mixed_cfg(root, {"a": {"proportion": 0.3}, "b": {"proportion": 0.7}}, epoch_size=4000)
    with caplog.at_level(logging.INFO, logger="foundryx.data.text"):
        spec = build_text_dataloader(cfg, tiny_tokenizer, 50)
    epoch = origins(spec, rows)
    assert len(epoch) == 4000 and "?" not in epoch
    assert epoch.count("b") == 2800  # the epoch is exact ...
    first = epoch[:2000]  # ... and so is any long stretch of it, within 2%
    assert abs(first.count("b") / len(first) - 0.7) < 0.02
    table = caplog.text[caplog.text.index("data mix"):]
    assert "4000 samples per epoch" in table
    for name, n, chosen, weight in (("a", len(rows["a"]), 1200, "0.300"),
                                    ("b", len(rows["b"]), 2800, "0.700")):
        line = next(line for line in table.splitlines() if line.strip().startswith(name + " "))
        assert line.split()[1:4] == [f"{n:,}", f"{chosen:,}", weight]


def test_repeat_and_choose(two_streams, tiny_tokenizer):
    root, rows = two_streams
    spec = build_text_dataloader(mixed_cfg(root, {"a": {"repeat": 2}, "b": {"choose": 25}}),
                                 tiny_tokenizer, 10)
    epoch = origins(spec, rows)
    assert epoch.count("a") == 2 * len(rows["a"]) and epoch.count("b") == 25


def test_sequence_id_follows_eos(two_streams, tiny_tokenizer):
    root, _ = two_streams
    cfg = mixed_cfg(root, {"a": {}, "b": {}}, emit_sequence_id=True)
    eos = tiny_tokenizer.eos_token_id
    n_docs = 0
    for batch in build_text_dataloader(cfg, tiny_tokenizer, 8).dataloader:
        for ids, seq_id in zip(batch["input_ids"].tolist(), batch["sequence_id"].tolist()):
            want, doc = [], 0
            for token in ids:
                want.append(doc)
                doc += token == eos  # the eos ends (and belongs to) its document
            assert seq_id == want
            n_docs += seq_id[-1]
    assert n_docs > 50  # rows do hold several documents
    plain = build_text_dataloader(mixed_cfg(root, {"a": {}}), tiny_tokenizer, 8)
    assert "sequence_id" not in next(iter(plain.dataloader))


def test_document_ids_with_bos_only():
    import torch

    from foundryx.data.text import document_ids

    ids = torch.tensor([[5, 1, 7, 8, 1, 9], [1, 2, 3, 1, 4, 5]])
    assert document_ids(ids, None, 1).tolist() == [[0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]]
    assert document_ids(ids, 1, None).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]]


def test_stream_config_problems(two_streams, tmp_path):
    root, _ = two_streams
    bad = mixed_cfg(root, {"a": {"proportion": 0.5, "repeat": 2}, "b": {"choose": 2.5},
                           "c": {"local": str(tmp_path / "none"), "proprtion": 1}}, epoch_size=9)
    bad["dataset"]["local"] = str(root)
    problems = loader_problems(bad)
    assert "dataset.local: give either local (one dataset) or streams, not both" in problems
    assert any(p.startswith("dataset.streams.a.repeat: give only one of proportion") for p in problems)
    assert "dataset.streams.b.choose: expected an integer or null, got 2.5" in problems
    assert any(p.startswith("dataset.streams.c.proprtion: unknown option") and "proportion" in p
               for p in problems)
    assert any(p.startswith(f"dataset.streams.c.local: folder {tmp_path / 'none'} does not exist")
               for p in problems)
    assert any(p.startswith("dataset.streams: give proportion to every stream or to none")
               for p in problems)
    assert any(p.startswith("dataset.epoch_size: only with proportion") for p in problems)
    with pytest.raises(ConfigError, match="'text' dataloader"):
        build_text_dataloader(bad, None, 4)
    assert loader_problems(mixed_cfg(root, {"a": {"repeat": 0.5}, "b": {}})) == []
