"""Shared fixtures. Everything is built locally: no network, no hub."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch  # first: this process's OpenMP threads are set as it loads (see below)

# No test may reach a hub: fail fast instead of retrying for a minute.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# compile.enabled defaults to auto (on where supported): each training run would spend its first
# seconds compiling. Tests turn the default off (runs say so in their log) and test compile
# where they mean to: tests/test_compile_default.py, test_fsdp.py.
os.environ.setdefault("FOUNDRYX_COMPILE", "0")


def _no_gpu() -> bool:
    return not torch.cuda.is_available()


# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads the variable when a
# kernel is decorated, i.e. when foundryx.kernels.* is first imported (lazily, at first use), so
# it is set here before any test runs. With a GPU the kernels are compiled and tested for real.
if "TRITON_INTERPRET" not in os.environ and _no_gpu():
    os.environ["TRITON_INTERPRET"] = "1"

# The processes tests start (ranks, CLI runs) get one OpenMP thread each unless the caller set
# OMP_NUM_THREADS: two or four ranks on a 2-core machine, each with torch's default of a thread
# per core, oversubscribe the cores and OpenMP's threads spin at every barrier (a 2-rank
# quickstart of 12 batches took 1.3-2.2x as long without it on the loaded 2-core VM, 2026-11-29;
# torchrun sets the same). This process keeps its own: its OpenMP runtime read the variable
# when torch loaded, at the top of this file.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).parents[1]
SHARED = ROOT.parent / "shared"

# ---------------------------------------------------------------------------------------
# The slow set is split between the two torch legs so each stays well under 30 minutes:
# `make test` runs the fast set plus the pinned leg's share on torch 2.7, then the fast set plus
# the modern leg's share on torch 2.15 (`--slow-leg`). A slow test file not named here runs on
# the pinned leg, except its cases marked `modern_leg`; the files of BOTH_LEGS_SLOW_FILES run on
# each (what one transformers major writes, the other reads), but for their cases marked
# `modern_leg`. `--slow-leg all` (the default, and
# `make test-all`) runs every slow test. The `long` tests, the long form of a check that make
# test makes in short (more random moments, more rank combinations), run on neither leg:
# `make test-long` runs them, and `make test-all`. The files of PINNED_LEG_FILES run on the
# pinned leg only, fast tests included (they check the GPU run book's bash and files, not torch).
# ---------------------------------------------------------------------------------------
MODERN_LEG_SLOW_FILES = {
    "test_triton_attention.py",
    "test_export_e2e.py",
    "test_icl_invariance.py",
    "test_guards_e2e.py",
    "test_remote_checkpoint.py",
    "test_quickstart_e2e.py",
    "test_plugin_model.py",
    "test_walkthrough.py",
    "test_lora_second_run.py",
    "test_export_standard_use.py",
    "test_tp_docs.py",
    "test_cp.py",
}
BOTH_LEGS_SLOW_FILES = {"test_hf_families.py"}
PINNED_LEG_FILES = {"test_gpu_runbook.py"}


def pytest_addoption(parser):
    parser.addoption(
        "--slow-leg",
        choices=("all", "pinned", "modern"),
        default="all",
        help="run only this torch leg's share of the slow tests (fast tests always run)",
    )


def pytest_collection_modifyitems(config, items):
    leg = config.getoption("--slow-leg")
    if leg == "all":
        return
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("long") is not None:  # make test-long and make test-all only
            drop.append(item)
            continue
        if item.path.name in PINNED_LEG_FILES and leg != "pinned":
            drop.append(item)
            continue
        marked = item.get_closest_marker("modern_leg") is not None  # one case of a file
        if item.get_closest_marker("slow") is None or (
                item.path.name in BOTH_LEGS_SLOW_FILES and not marked):
            keep.append(item)
            continue
        item_leg = "modern" if marked or item.path.name in MODERN_LEG_SLOW_FILES else "pinned"
        (keep if item_leg == leg else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _fresh_logging():
    """Each test starts with foundryx's and Composer's loggers as a new process has them: an
    in-process CLI call sets their level and handler, which would otherwise leak into the
    next test's captured output."""
    import logging

    yield
    for name in ("foundryx", "composer"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)
        lg.propagate = True


@pytest.fixture
def one_thread():
    """torch on one thread for the test (small tensors: threads cost more than they give, and
    results do not depend on the machine's core count); a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def quickstart_data(tmp_path_factory) -> Path:
    """The quickstart's generated corpus, tokenizer and MDS shards, built once per session."""
    from foundryx.data.quickstart import prepare_quickstart

    return prepare_quickstart(tmp_path_factory.mktemp("quickstart"), progress=False)


@pytest.fixture
def shared_dir() -> Path:
    """../shared beside the checkout (real corpora and eval data); skip when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"needs {SHARED} (real corpus and eval data), which is absent")
    return SHARED


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE (vocab 400) trained on a small synthetic corpus, once per session."""
    from foundryx.data.synthetic import generate_corpus
    from foundryx.data.tokenizers import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    return train_bpe_tokenizer(generate_corpus(300, seed=1), vocab_size=400, out_dir=out)


@pytest.fixture(scope="session")
def _s3_server():
    from s3 import start_server

    server, endpoint_url = start_server()
    yield endpoint_url
    server.stop()


@pytest.fixture
def s3(_s3_server, monkeypatch):
    """A real S3 API server on localhost (moto), shared by the session; this test's environment
    points every S3 client at it (`S3_ENDPOINT_URL`, fake credentials). `s3.bucket()` makes a
    fresh bucket; pass `s3.env` to subprocesses."""
    from s3 import S3Server

    server = S3Server(_s3_server)
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    return server
