"""The ``text`` dataloader over MDS shards: batches, order, validation and two ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from config_checks import section_problems

from foundryx import registry
from foundryx.data.convert import convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.data.text import build_text_dataloader
from foundryx.errors import ConfigError, DataError

SEQ = 32


@pytest.fixture
def mds_root(tmp_path, tiny_tokenizer) -> Path:
    """``<tmp>/mds/train``: 64 docs as sequences of 32 tokens; each test gets its own folder,
    so streaming's shared memory (keyed by local folder) never collides across tests."""
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(generate_corpus(64, seed=4)) + "\n")
    convert_to_mds(src, tmp_path / "mds" / "train", tiny_tokenizer, SEQ, progress=False)
    return tmp_path / "mds"


def loader_cfg(root, **dataset) -> dict:
    ds = {"local": str(root), "split": "train", "max_seq_len": SEQ, **dataset}
    return {"dataset": ds, "drop_last": False, "num_workers": 0}


def loader_problems(options: dict) -> list[str]:
    return section_problems("dataloaders", "text", options)


def stored_rows(root: Path) -> list[tuple[int, ...]]:
    from streaming import LocalDataset

    ds = LocalDataset(str(root / "train"))
    return [tuple(ds[i]["tokens"].tolist()) for i in range(len(ds))]


def all_rows(spec) -> list[tuple[int, ...]]:
    return [tuple(row) for batch in spec.dataloader for row in batch["input_ids"].tolist()]


def test_registered_by_entry_point():
    assert registry.dataloaders.get("text") is build_text_dataloader
    assert registry.dataloaders.entry("text").package == "foundryx"


def test_batches_shapes_and_dtype(mds_root, tiny_tokenizer):
    spec = build_text_dataloader(loader_cfg(mds_root), tiny_tokenizer, 4)
    batch = next(iter(spec.dataloader))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    for value in batch.values():
        assert value.shape == (4, SEQ) and value.dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert bool((batch["attention_mask"] == 1).all())
    assert spec.get_num_tokens_in_batch(batch) == 4 * SEQ
    assert sorted(all_rows(spec)) == sorted(stored_rows(mds_root))


def test_shorter_max_seq_len_truncates(mds_root, tiny_tokenizer):
    spec = build_text_dataloader(loader_cfg(mds_root, max_seq_len=10), tiny_tokenizer, 8)
    rows = all_rows(spec)
    assert {len(r) for r in rows} == {10}
    assert sorted(rows) == sorted(r[:10] for r in stored_rows(mds_root))


def test_shuffle_order_is_deterministic_for_a_seed(mds_root, tiny_tokenizer, tmp_path):
    copies = []
    for name in ("a", "b", "c"):  # one folder per dataset: streaming keys shared memory by it
        shutil.copytree(mds_root, tmp_path / name)
        copies.append(tmp_path / name)
    orders = [
        all_rows(build_text_dataloader(loader_cfg(root, shuffle=True, shuffle_seed=seed),
                                       tiny_tokenizer, 4))
        for root, seed in zip(copies, (5, 5, 6))
    ]
    assert orders[0] == orders[1]
    assert orders[0] != orders[2]
    assert sorted(orders[0]) == sorted(orders[2]) == sorted(stored_rows(mds_root))


def test_missing_folder_and_split(tmp_path, mds_root, tiny_tokenizer):
    missing = tmp_path / "nowhere"
    problems = loader_problems(loader_cfg(missing))
    assert len(problems) == 1
    assert problems[0].startswith(f"dataset.local: folder {missing} does not exist")
    assert "foundryx data convert" in problems[0] and "make data" in problems[0]
    with pytest.raises(ConfigError, match=f"{missing} does not exist"):
        build_text_dataloader(loader_cfg(missing), tiny_tokenizer, 4)

    [problem] = loader_problems(loader_cfg(mds_root, split="val"))
    assert problem.startswith(f"dataset.split: folder {mds_root / 'val'} does not exist")
    assert "subfolders of" in problem and "train" in problem

    (tmp_path / "not_mds").mkdir()
    [problem] = loader_problems(loader_cfg(tmp_path, split="not_mds"))
    assert "has no index.json" in problem


def test_max_seq_len_longer_than_stored(mds_root, tiny_tokenizer):
    cfg = loader_cfg(mds_root, max_seq_len=SEQ + 1)
    [problem] = loader_problems(cfg)
    assert problem.startswith(f"dataset.max_seq_len: {SEQ + 1} is longer")
    with pytest.raises(ConfigError, match=f"longer than the sequences stored.*{SEQ} tokens"):
        build_text_dataloader(cfg, tiny_tokenizer, 4)
    (mds_root / "train" / "foundryx_manifest.json").unlink()  # a plain MDS dataset
    assert loader_problems(cfg) == []
    with pytest.raises(DataError, match=f"longer than the sequences stored.*{SEQ} tokens"):
        build_text_dataloader(cfg, tiny_tokenizer, 4)


def test_option_problems_without_a_dataset(tmp_path):
    cfg = loader_cfg(tmp_path / "x", shuffle="yes", shufle_seed=3, max_seq_len=0)
    cfg.update(num_workers=-1, drop_lst=True)
    problems = loader_problems(cfg)
    assert "drop_lst: unknown option of the 'text' dataloader (did you mean 'drop_last'?)" \
        in problems
    assert any(p.startswith("dataset.shufle_seed: unknown option") and "shuffle_seed" in p
               for p in problems)
    assert "dataset.shuffle: expected true/false, got 'yes'" in problems
    assert "num_workers: expected an integer >= 0, got -1" in problems
    assert "dataset.max_seq_len: expected an integer > 0, got 0" in problems
    assert loader_problems({})[0].startswith("dataset: missing")


def test_registered_loader_declares_its_options(mds_root):
    from foundryx.config.components import options_parameter
    from foundryx.data.text import TextLoaderOptions

    assert options_parameter(registry.dataloaders.get("text")) == ("options", TextLoaderOptions)
    assert loader_problems(loader_cfg(mds_root)) == []


def test_other_tokenizer_is_refused(mds_root, tiny_tokenizer, tmp_path):
    from foundryx.data.tokenizers import train_bpe_tokenizer

    other = train_bpe_tokenizer(["completely different text"] * 20, 300, tmp_path / "other")
    with pytest.raises(DataError, match="vocabulary differs from the run's tokenizer"):
        build_text_dataloader(loader_cfg(mds_root), other, 4)


RANK_SCRIPT = """
import json, sys, torch.distributed as dist
from transformers import AutoTokenizer
from foundryx.data.text import build_text_dataloader
dist.init_process_group("gloo")
cfg, tok_dir, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = build_text_dataloader(cfg, AutoTokenizer.from_pretrained(tok_dir), 4)
json.dump([batch["input_ids"].tolist() for batch in spec.dataloader], open(out, "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_see_the_one_rank_order(mds_root, tiny_tokenizer, tmp_path):
    """Global batch i (8 samples) of one rank = rank 0's batch i + rank 1's batch i (4 each)."""
    n = len(stored_rows(mds_root))
    cfg = loader_cfg(mds_root, shuffle=True, shuffle_seed=1)
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29_500 + os.getpid() % 1000)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, json.dumps(cfg), tiny_tokenizer.name_or_path,
             str(tmp_path / f"rank{rank}.json")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    one = [b["input_ids"].tolist() for b in build_text_dataloader(cfg, tiny_tokenizer, 8).dataloader]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(one) == len(r0) == len(r1) == -(-n // 8)
    for step, (batch, b0, b1) in enumerate(zip(one[:-1], r0, r1)):  # the last one is padded
        assert b0 == batch[0::2] and b1 == batch[1::2], step
    seen = {tuple(row) for batches in (r0, r1) for batch in batches for row in batch}
    assert seen == set(stored_rows(mds_root))


@pytest.mark.parametrize("damage", ["truncate", "delete", "index", "flipped"])
def test_corrupt_shard_is_refused(mds_root, tiny_tokenizer, damage):
    folder = mds_root / "train"
    shard = folder / json.loads((folder / "index.json").read_text())["shards"][0]["raw_data"][
        "basename"]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
        match = rf"bad shard\(s\) in {folder}: shard {shard} has \d+ of \d+ bytes"
    elif damage == "delete":
        shard.unlink()
        match = f"shard {shard} is missing"
    elif damage == "flipped":  # the right size, other bytes: only the recorded hash sees it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        match = (rf"shard {shard}: its xxh3_64 differs from index.json \(damaged.*re-convert "
                 r"the data \(`foundryx data convert ... --overwrite`\)")
    else:
        (folder / "index.json").write_text('{"shards": [')
        match = "index.json: unreadable"
    with pytest.raises(DataError, match=match):
        build_text_dataloader(loader_cfg(mds_root), tiny_tokenizer, 4)
