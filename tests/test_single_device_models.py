"""Model code is single-device PyTorch (../shared/ARCHITECTURE.md): nothing under
foundryx/models/ runs a collective or holds a process group, device mesh or CUDA stream.
Parallelism reaches a model from outside (foundryx.parallel: plans, styles, hooks and the
vocabulary-parallel readers of vocab_rows.py).

Read from the source: any import from ``torch.distributed`` and any use of
``torch.distributed.*`` or ``torch.cuda.Stream`` / ``torch.cuda.stream``. One import is
allowed: ``DTensor`` alone, in a tensor subclass or storage helper that must recognise one, with
a comment on its line saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path

MODELS = Path(__file__).parents[1] / "foundryx" / "models"
# what is still to move, and where: each entry must still break the rule (else remove it)
PENDING: dict[str, str] = {}  # a file that still breaks the rule, and why (none left)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def breaches(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{path.relative_to(MODELS)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            names = [a.name for a in node.names]
            dtensor_only = node.module == "torch.distributed.tensor" and names == ["DTensor"]
            said = any("#" in line for line in lines[node.lineno - 1:node.end_lineno])
            if not (dtensor_only and said):
                found.append(f"{where} from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name.startswith("torch.distributed") or name in ("torch.cuda.Stream",
                                                                 "torch.cuda.stream"):
                found.append(f"{where} {name}")
    return found


def test_model_code_runs_no_collective_and_holds_no_group_mesh_or_stream():
    by_file: dict[str, list[str]] = {}
    for path in sorted(MODELS.rglob("*.py")):
        if found := breaches(path):
            by_file[str(path.relative_to(MODELS))] = found
    new = {f: v for f, v in by_file.items() if f not in PENDING}
    assert not new, f"distributed code under foundryx/models/ (apply it from foundryx.parallel): {new}"
    moved = sorted(set(PENDING) - set(by_file))
    assert not moved, f"these no longer break the rule: remove them from PENDING: {moved}"


def test_the_check_sees_each_kind_of_breach(tmp_path, monkeypatch):
    """The reader catches what it is for (a check that cannot fail is no check)."""
    monkeypatch.setattr(__import__(__name__), "MODELS", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nimport torch.distributed as dist\n"
                   "from torch.distributed.device_mesh import DeviceMesh\n"
                   "from torch.distributed.tensor import DTensor\n"
                   "def f(t):\n    torch.distributed.all_reduce(t)\n"
                   "    return torch.cuda.Stream()\n")
    found = breaches(bad)
    kinds = " ".join(found)
    for what in ("import torch.distributed", "DeviceMesh", "import DTensor",
                 "torch.distributed.all_reduce", "torch.cuda.Stream"):
        assert what in kinds, (what, found)
    ok = tmp_path / "ok.py"
    ok.write_text("from torch.distributed.tensor import DTensor  # a subclass must recognise one\n"
                  "from torch.distributed.tensor import (\n    DTensor,  # so must this one\n)\n")
    assert breaches(ok) == []
