"""A checkpoint save that runs out of disk: one message naming the folder and the bytes needed,
exit code 2, the previous checkpoint still the newest complete one, nothing half-written.

The disk is a real size-limited tmpfs when the test may mount one (root in a container that
allows it, as CI is); otherwise DCP's file writer is made to fail with ENOSPC once the
checkpoint files pass the same size. The test says which in its output.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from foundryx.checkpoint.layout import Manifest, complete_checkpoints
from foundryx.checkpoint.verify import verify_files
from foundryx.cli import main

QUICKSTART = str(Path(__file__).parents[1] / "yamls" / "quickstart.yaml")
TINY = ["variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        "global_train_batch_size=4", "eval_loader=null", "parallelism={}", "max_duration=8ba",
        "save_interval=4ba", "save_overwrite=false", "save_num_checkpoints_to_keep=-1",
        "console_log_interval=100ba", "progress_bar=false"]


def train(data: Path, save_folder: Path, *extra: str) -> int:
    return main(["train", QUICKSTART, f"variables.data_root={data}", f"save_folder={save_folder}",
                 "loggers={}", *TINY, *extra])


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@contextmanager
def small_disk(where: Path, size: int, kind: str, monkeypatch):
    """A folder on which at most ``size`` bytes fit: a tmpfs (skipped when mounting is not
    allowed here), or a DCP writer that raises ENOSPC past ``size`` bytes of checkpoint files."""
    where.mkdir()
    mounted = kind == "tmpfs" and os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True).returncode == 0
    if kind == "tmpfs" and not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root and a container that allows it); "
                    "the injected-ENOSPC case covers the same path")
    if kind == "injected":
        _fail_writes_past(size, monkeypatch)
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _fail_writes_past(limit: int, monkeypatch) -> None:
    from torch.distributed.checkpoint import filesystem

    written = {"n": 0}
    real = filesystem.FileSystem.create_stream

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            written["n"] += len(data)
            if written["n"] > limit:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as f:
            yield Full(f) if "w" in mode else f

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


@pytest.fixture(scope="module")
def checkpoint_bytes(quickstart_data, tmp_path_factory) -> int:
    """The size of one checkpoint of the run below."""
    probe = tmp_path_factory.mktemp("probe")
    assert train(quickstart_data, probe, "max_duration=4ba") == 0
    return folder_bytes(probe / "ep0-ba4")


@pytest.mark.parametrize("kind", ["tmpfs", "injected"])
def test_full_disk_keeps_the_previous_checkpoint(kind, checkpoint_bytes, quickstart_data, tmp_path,
                                                 monkeypatch, capsys):
    capsys.readouterr()
    disk = tmp_path / "disk"
    with small_disk(disk, int(checkpoint_bytes * 1.5) + 64 * 1024, kind, monkeypatch):
        code = train(quickstart_data, disk)
        err = capsys.readouterr().err
        assert code == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        message = [ln for ln in err.splitlines() if "could not be written" in ln]
        assert len(message) == 1, err[-3000:]
        assert f"checkpoint ep0-ba8 could not be written to {disk}" in message[0]
        assert "no space left on the device: the checkpoint needs about" in message[0]
        assert "ep0-ba4 is still the newest complete checkpoint" in message[0]

        # what autoresume would take is ep0-ba4, whole; nothing of ep0-ba8 is left
        names = sorted(p.name for p in disk.iterdir() if p.name != ".lock")
        assert names == ["ep0-ba4", "latest"], names
        (newest, manifest), = complete_checkpoints(disk)
        assert newest.name == "ep0-ba4" and not verify_files(newest, manifest)
        assert os.readlink(disk / "latest") == "ep0-ba4"
        # the same command on a disk with room continues from ep0-ba4 and finishes
        roomy = tmp_path / "roomy"
        shutil.copytree(disk, roomy, symlinks=True)
    monkeypatch.undo()
    assert train(quickstart_data, roomy) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err, err[-3000:]
    assert [p.name for p, _ in complete_checkpoints(roomy)] == ["ep0-ba8", "ep0-ba4"]
    assert Manifest.read(roomy / "ep0-ba8").batch == 8
