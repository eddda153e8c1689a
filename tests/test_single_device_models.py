"""Model code is single-device PyTorch (../shared/ARCHITECTURE.md): nothing under
foundryx/models/ runs a collective or holds a process group, device mesh or CUDA stream.
Parallelism reaches a model from outside (foundryx.parallel: plans, styles, hooks and the
vocabulary-parallel readers of vocab_rows.py), and models/ does not import foundryx.parallel.

Read from each file's syntax tree, whatever the spelling: every name an import binds is
followed to what it names (``import torch.distributed as d``, ``from torch import distributed
as dist``, ``from torch.distributed import all_reduce``, Composer's ``from composer.utils import
dist``, ``import torch as th`` then ``th.distributed...``, a relative ``from ...parallel
import``, ``importlib.import_module("torch.distributed")``), and any import or use that lands in
a distributed module, a CUDA stream or foundryx.parallel is a breach.

The one exception, named in :data:`ALLOWED`: FSDP2's tensor-subclass protocol. A low-precision
storage is a tensor subclass whose ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` methods
FSDP2 calls around the all-gather it runs itself (the hooks are handed the mesh and the gathered
outputs: they import nothing distributed and run no collective, so the reader passes them as
they are), and a storage helper must recognise a tensor-parallel weight (a ``DTensor``) to keep
its placement. So ``DTensor`` alone may be imported from ``torch.distributed.tensor``, with a
comment on the import saying why; nothing else from there (no ``Shard``, no mesh).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODELS = Path(__file__).parents[1] / "foundryx" / "models"
# what is still to move, and where: each entry must still break the rule (else remove it)
PENDING: dict[str, str] = {}  # a file that still breaks the rule, and why (none left)

# modules whose import or use under models/ breaks the rule (each with everything below it)
FORBIDDEN = ("torch.distributed", "composer.utils.dist", "foundryx.parallel",
             "torch.cuda.Stream", "torch.cuda.ExternalStream", "torch.cuda.stream",
             "torch.cuda.streams", "torch.cuda.set_stream", "torch.cuda.current_stream",
             "torch.Stream")
# The exception (module docstring): a tensor subclass or storage helper recognises a
# tensor-parallel weight to keep its placement; FSDP2's fsdp_pre/post_all_gather hooks need
# no import at all. Allowed only with a comment on the import saying why.
ALLOWED = {"torch.distributed.tensor.DTensor"}
IMPORTERS = {"importlib.import_module", "__import__"}


def forbidden(name: str) -> bool:
    """Whether the dotted ``name`` is, or is inside, one of :data:`FORBIDDEN`."""
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def _dotted(node: ast.AST) -> tuple[str, list[ast.AST]]:
    """``a.b.c`` of an attribute chain, and the nodes inside it (its Name root included)."""
    parts, inner = [], []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
        inner.append(node)
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts)), inner


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from`` import reads, a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _commented(lines: list[str], node: ast.stmt) -> bool:
    return any("#" in line for line in lines[node.lineno - 1:node.end_lineno])


def _imports(tree: ast.AST, lines: list[str], package: str, where: str
             ) -> tuple[dict[str, str], list[str]]:
    """Every name the imports bind, mapped to what it names (the exception's names left out),
    and the imports that break the rule."""
    bound: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:  # `import torch.distributed` binds `torch`
                    root = a.name.split(".")[0]
                    bound[root] = root
                if forbidden(a.name):
                    found.append(f"{where}:{node.lineno} import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            for a in node.names:
                full = f"{module}.{a.name}"
                if full in ALLOWED and _commented(lines, node):
                    continue
                bound[a.asname or a.name] = full
                if forbidden(module) or forbidden(full):
                    found.append(f"{where}:{node.lineno} from {module} import {a.name}")
    return bound, found


def _uses(tree: ast.AST, bound: dict[str, str], where: str) -> list[str]:
    """Names and attribute chains that resolve, through ``bound``, into the forbidden, and
    modules imported by name (``importlib.import_module("torch.distributed")``)."""
    found: list[str] = []
    inside: set[int] = set()
    for node in ast.walk(tree):  # outer chains come before their inner nodes
        if id(node) in inside or not isinstance(node, (ast.Attribute, ast.Name)):
            continue
        dotted, inner = _dotted(node)
        inside.update(id(n) for n in inner)
        root, _, rest = dotted.partition(".")
        if root in bound:
            resolved = bound[root] + (f".{rest}" if rest else "")
            if forbidden(resolved):
                found.append(f"{where}:{node.lineno} {dotted}"
                             + (f" ({resolved})" if resolved != dotted else ""))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func, _ = _dotted(node.func)
            root, _, rest = func.partition(".")
            func = bound.get(root, root) + (f".{rest}" if rest else "")
            if func in IMPORTERS and forbidden(str(node.args[0].value)):
                found.append(f"{where}:{node.lineno} {func}({node.args[0].value!r})")
    return found


def breaches(source: str, where: str = "<source>", package: str = "foundryx.models") -> list[str]:
    """What in ``source`` (a module of ``package``) breaks the single-device rule: imports of
    a distributed module, a CUDA stream or foundryx.parallel, and uses of the names they bind
    (or of ``torch.distributed...`` reached from ``torch`` itself), each as ``where:line what``."""
    tree = ast.parse(source)
    bound, found = _imports(tree, source.splitlines(), package, where)
    return found + _uses(tree, bound, where)


def file_breaches(path: Path) -> list[str]:
    relative = path.relative_to(MODELS.parent.parent)
    package = ".".join(relative.parent.parts)
    return breaches(path.read_text(), str(path.relative_to(MODELS)), package)


def test_model_code_runs_no_collective_and_holds_no_group_mesh_or_stream():
    by_file: dict[str, list[str]] = {}
    for path in sorted(MODELS.rglob("*.py")):
        if found := file_breaches(path):
            by_file[str(path.relative_to(MODELS))] = found
    new = {f: v for f, v in by_file.items() if f not in PENDING}
    assert not new, f"distributed code under foundryx/models/ (apply it from foundryx.parallel): {new}"
    moved = sorted(set(PENDING) - set(by_file))
    assert not moved, f"these no longer break the rule: remove them from PENDING: {moved}"


BAD = {
    "torch.distributed chain": "import torch\ndef f(t):\n    torch.distributed.all_reduce(t)\n",
    "import torch.distributed": "import torch.distributed\n",
    "import torch.distributed as d": "import torch.distributed as d\ndef f(t):\n    d.all_reduce(t)\n",
    "from torch import distributed as dist":
        "from torch import distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n",
    "from torch.distributed import all_reduce":
        "from torch.distributed import all_reduce\ndef f(t):\n    all_reduce(t)\n",
    "torch under another name": "import torch as th\ndef f(t):\n    th.distributed.broadcast(t, 0)\n",
    "a process group": "import torch.distributed as d\nGROUP = d.new_group([0, 1])\n",
    "a device mesh": "from torch.distributed.device_mesh import init_device_mesh\n"
                    "MESH = init_device_mesh('cpu', (2,))\n",
    "Composer's dist": "from composer.utils import dist\ndef f(t):\n    dist.all_reduce(t)\n",
    "Composer's dist imported whole": "import composer.utils.dist as cdist\nR = cdist.get_global_rank()\n",
    "Composer's dist by attribute": "from composer import utils\nR = utils.dist.get_global_rank()\n",
    "a function of Composer's dist": "from composer.utils.dist import all_gather_object\n",
    "DTensor without a comment": "from torch.distributed.tensor import DTensor\n",
    "a placement beside DTensor": "from torch.distributed.tensor import DTensor, Shard  # why\n",
    "a CUDA stream": "import torch\ndef f():\n    return torch.cuda.Stream()\n",
    "a stream context": "import torch\ndef f(s):\n    with torch.cuda.stream(s):\n        pass\n",
    "a stream imported": "from torch.cuda import Stream\n",
    "import foundryx.parallel": "import foundryx.parallel.tp as tp\n",
    "from foundryx.parallel": "from foundryx.parallel.offload import pack_offloaded\n",
    "from foundryx import parallel": "from foundryx import parallel\n",
    "a relative import of parallel": "from ...parallel import offload\n",
    "imported by name": "import importlib\nD = importlib.import_module('torch.distributed')\n",
}


@pytest.mark.parametrize("source", BAD.values(), ids=list(BAD))
def test_the_check_sees_each_spelling_of_a_breach(source):
    """The reader catches what it is for (a check that cannot fail is no check)."""
    assert breaches(source, "bad.py", "foundryx.models.peft"), source


def test_the_check_names_the_import_and_each_use():
    found = breaches("from torch import distributed as dist\nimport torch\n"
                     "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n",
                     "bad.py")
    assert found == ["bad.py:1 from torch import distributed",
                     "bad.py:4 dist.all_reduce (torch.distributed.all_reduce)",
                     "bad.py:5 torch.distributed.barrier"], found


GOOD = {
    "DTensor with its comment": "from torch.distributed.tensor import DTensor  # a subclass must "
                                "recognise one\ndef f(w):\n    return DTensor.from_local(w, "
                                "w.device_mesh, w.placements)\n",
    "DTensor in parentheses": "from torch.distributed.tensor import (\n    DTensor,  # so must "
                              "this one\n)\n",
    "FSDP2's tensor-subclass hooks": "import torch\nclass Part(torch.Tensor):\n"
                                     "    def fsdp_pre_all_gather(self, mesh):\n"
                                     "        return (self,), None\n"
                                     "    def fsdp_post_all_gather(self, outputs, metadata, dtype, "
                                     "*, out=None):\n        return outputs[0], outputs\n",
    "a local named dist": "def f(pos):\n    dist = pos[:, None] - pos[None, :]\n"
                          "    return dist.abs()\n",
    "plain torch": "import torch\nfrom torch import nn\nOK = torch.cuda.is_available()\n"
                   "L = nn.Linear(2, 2)\n",
    "foundryx below models": "from foundryx.config.schema import ParallelismConfig\n"
                             "from ..layers import attention\n",
}


@pytest.mark.parametrize("source", GOOD.values(), ids=list(GOOD))
def test_single_device_code_and_the_named_exception_pass(source):
    assert breaches(source, "ok.py", "foundryx.models.peft") == []
