"""``foundryx launch`` gives each rank ``OMP_NUM_THREADS`` = cores / local ranks unless the
user set it, and says so in one line (foundryx.cli.launch.rank_threads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundryx.cli.launch import rank_threads

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("nproc,cores,want", [(2, 2, "1"), (2, 16, "8"), (4, 16, "4"),
                                              (3, 16, "5"), (8, 4, "1")])
def test_each_rank_gets_its_share_of_the_cores(nproc, cores, want):
    value, line = rank_threads({}, nproc, cores)
    assert value == want
    assert f"OMP_NUM_THREADS={want} in each of the {nproc} ranks ({cores} cores / {nproc} " \
           f"ranks" in line and "set OMP_NUM_THREADS to choose" in line


def test_the_users_setting_and_one_rank_are_left_alone():
    assert rank_threads({"OMP_NUM_THREADS": "3"}, 2, 16) == (None, None)
    assert rank_threads({}, 1, 16) == (None, None)


@pytest.mark.slow
def test_the_ranks_start_with_it(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text("import os\nimport foundryx  # noqa: F401\n"
                      "import torch\n"
                      "print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = len(os.sched_getaffinity(0))
    want = max(1, cores // 2)
    r = subprocess.run([sys.executable, "-m", "foundryx.cli", "launch", "-n", "2",
                        "--stdout", f"{tmp_path}/rank{{rank}}.txt", str(script)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"foundryx: launch: OMP_NUM_THREADS={want} in each of the 2 ranks" in r.stderr
    # rank 0 prints to the launcher's console (Composer's launcher), the other to its file
    assert r.stdout.split() == [str(want), str(want)]
    assert (tmp_path / "rank1.txt").read_text().split() == [str(want), str(want)]
