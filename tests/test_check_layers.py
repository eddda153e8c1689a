"""tools/check_layers.py, the project's own import-layer check (issue 53, part 4): the tree as
it is passes, and a tree that breaks a rule (absolutely, relatively, inside a function, or by
a cycle) fails naming the file, the line and the parts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
CHECK = ROOT / "tools" / "check_layers.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(root)], capture_output=True,
                          text=True, timeout=60)


def test_the_tree_passes_and_counts_its_lazy_imports():
    r = run(ROOT)
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith("0 forbidden imports, 0 part cycles, ")


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    shutil.copy(ROOT / "layers.toml", tmp_path / "layers.toml")
    for name in ("models", "data", "parallel", "builders", "errors"):
        (tmp_path / "foundryx" / name).mkdir(parents=True)
        (tmp_path / "foundryx" / name / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_tree_that_breaks_a_rule_fails_naming_file_line_and_parts(tmp_path):
    root = tree(tmp_path, {
        "foundryx/models/a.py": "import os\nfrom foundryx.data import b\n",
        "foundryx/models/c.py": "def f():\n    from ..parallel import d  # relative, in a function\n",
        "foundryx/builders/e.py": "from foundryx import models, data, parallel  # a shell: fine\n",
        "foundryx/errors/__init__.py": "from . import x\n",  # inside its own part: fine
    })
    r = run(root)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "foundryx/models/a.py:2  models -> data",
        "foundryx/models/c.py:2  models -> parallel",
        "2 forbidden imports, 0 part cycles, 1 foundryx imports inside functions",
    ]


def test_a_cycle_between_parts_fails_even_where_no_rule_names_it(tmp_path):
    (tmp_path / "foundryx" / "eval").mkdir(parents=True)
    (tmp_path / "foundryx" / "report").mkdir(parents=True)
    root = tree(tmp_path, {
        "foundryx/eval/__init__.py": "from foundryx.report import r\n",
        "foundryx/report/__init__.py": "from foundryx.eval import e\n",
    })
    r = run(root)
    assert r.returncode == 1 and "cycle: eval <-> report" in r.stdout.splitlines()


def test_a_project_without_rules_is_refused(tmp_path):
    (tmp_path / "foundryx").mkdir()
    r = run(tmp_path)
    assert r.returncode == 2 and "has no foundryx/ and layers.toml" in r.stderr


def test_graph_lists_each_parts_imports_with_their_counts(tmp_path):
    root = tree(tmp_path, {
        "foundryx/models/a.py": "from foundryx.errors import E\nfrom foundryx import errors\n",
        "foundryx/builders/e.py": "from foundryx import models, data\nimport foundryx.models.a\n",
    })
    r = subprocess.run([sys.executable, str(CHECK), str(root), "--graph"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[:2] == [
        "builders -> data (1), models (2)",
        "models -> errors (2)",
    ]
