"""Helpers of benchmarks/gpu_runbook.sh: dependency probe, environment and result tables.

    python -m benchmarks.gpu_runbook.report probe               # exit 1, naming what is missing
                                                                # or of a version foundryx refuses
    python -m benchmarks.gpu_runbook.report sites               # this Python's site-packages
    VENV/bin/python -m benchmarks.gpu_runbook.report machine-pth DIR...  # VENV sees DIR's packages
    python -m benchmarks.gpu_runbook.report env                 # the environment, markdown
    python -m benchmarks.gpu_runbook.report junit FILE          # pytest pass/fail counts, markdown
    python -m benchmarks.gpu_runbook.report throughput FILE...  # train_throughput.py JSON, table

Standard library only (torch for the GPU's description; ``packaging``, which transformers
brings, for the version checks when it imports): it runs before the dependencies are installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import platform
import re
import site
import subprocess
import sys
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the run book's steps import: the tests, the benchmarks, `foundryx train` and `eval`.
MODULES = ["torch", "triton", "torchvision", "composer", "streaming", "transformers",
           "tokenizers", "peft", "safetensors", "torchao", "omegaconf", "yaml", "tqdm", "pytest",
           "pytest_timeout"]  # fmt: skip
# Distributions whose version pyproject.toml bounds and a GPU image may hold outside the bounds
# (transformers 5 where foundryx is tested with 4.57): a version outside counts as missing.
CHECKED = ["transformers", "tokenizers", "peft", "torchao", "omegaconf", "mosaicml"]


def pyproject_requirements() -> dict[str, str]:
    """name -> requirement string of pyproject.toml's ``dependencies`` (a plain parse: this
    runs where tomllib may be absent)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    reqs = re.findall(r'"([^"]+)"', block.group(1)) if block else []
    return {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0].lower(): r for r in reqs}


def version_problems() -> list[str]:
    """``name VERSION (foundryx needs REQUIREMENT)`` for each CHECKED distribution outside
    pyproject.toml's bounds; nothing when ``packaging`` does not import."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    reqs, out = pyproject_requirements(), []
    for name in CHECKED:
        if name not in reqs:
            continue
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            continue  # its module's import says so
        req = Requirement(reqs[name])
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{name} {version} (foundryx needs {req})")
    return out


def missing() -> list[str]:
    """Modules that do not import, distributions of a version foundryx refuses, and foundryx
    when this checkout is not pip-installed (its built-in models are entry points, and the
    benchmarks' subprocesses import it by name)."""
    out = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure means "install it"
            why = "" if isinstance(e, ModuleNotFoundError) and e.name == name else \
                f" (does not import: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            out.append(name + why)
    out += version_problems()
    names = {ep.name for ep in md.entry_points(group="foundryx_models")}
    where = installed_from()  # not the import's: `python -m` puts the checkout first
    if where is None or "mpt_causal_lm" not in names:
        out.append("foundryx (not pip-installed)")
    elif not where.resolve().is_relative_to(ROOT):
        out.append(f"foundryx (installed from {where}, not this checkout)")
    return out


def installed_from() -> Path | None:
    """Where the installed foundryx distribution's code is: the folder an editable install
    points to, else its installed package; None when it is not installed."""
    try:
        dist = md.distribution("foundryx")
    except md.PackageNotFoundError:
        return None
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable") and direct.get("url", "").startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(direct["url"]).path))
    return Path(dist.locate_file("foundryx"))


PTH = "_foundryx_gpu_runbook_machine.pth"


def machine_pth(sites: list[str]) -> Path:
    """Make this Python (the run book's venv) see the packages of ``sites`` (the machine
    Python's site-packages) behind its own: a .pth file in its site-packages that adds each
    as a site directory (their own .pth files processed too). A venv made with
    --system-site-packages would see only the base interpreter's, not those of a venv or
    conda environment the machine's torch may live in."""
    import sysconfig

    pth = Path(sysconfig.get_path("purelib")) / PTH
    pth.parent.mkdir(parents=True, exist_ok=True)
    pth.write_text("".join(f"import site; site.addsitedir({s!r})\n" for s in sites))
    return pth


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception as e:  # noqa: BLE001
        return "not installed" if isinstance(e, ModuleNotFoundError) else f"does not import ({e})"


def env() -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    gpu = f"{torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.0f} GiB"
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "?")
        driver = _run(["rocm-smi", "--showdriverversion"]).splitlines()
        driver = next(
            (ln.split(":", 1)[1].strip() for ln in driver if "version" in ln.lower()), "?"
        )
        stack = f"ROCm (HIP {torch.version.hip}), arch {arch}; driver {driver}"
    else:
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = driver.splitlines()[0] if driver else "? (no nvidia-smi)"
        stack = f"CUDA {torch.version.cuda} (torch's build), sm{props.major}{props.minor}; driver {driver}"
    commit = _run(["git", "rev-parse", "HEAD"]) or "unknown (not a git checkout)"
    if _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " with uncommitted changes"
    lines = [
        f"GPU: {gpu} ({torch.cuda.device_count()} visible, device 0 used)",
        f"Stack: {stack}",
        f"torch {torch.__version__}, triton {_version('triton')}, "
        f"flash-attn {_version('flash_attn')}, composer {_version('composer')}, "
        f"Python {platform.python_version()}",
        f"foundryx commit: {commit}",
    ]
    return "\n".join(f"- {ln}" for ln in lines)


def junit(path: Path) -> tuple[str, bool]:
    """Pass/fail counts of a pytest --junitxml report, the failing tests, and whether all passed."""
    if not path.is_file():
        return "No test report: pytest stopped before running the tests.", False
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    text = (f"**{passed} passed, {n['failures']} failed, {n['errors']} errors, "
            f"{n['skipped']} skipped** ({seconds:.0f} s)")  # fmt: skip
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]  # fmt: skip
    if bad:
        text += "\n\nFailing:\n\n" + "\n".join(f"- `{b}`" for b in bad[:30])
        text += f"\n- ... and {len(bad) - 30} more" if len(bad) > 30 else ""
    return text, n["tests"] > 0 and not bad


def throughput(paths: list[Path]) -> str:
    """One table of train_throughput.py's JSON files (one file per model)."""
    import json

    if not paths:
        return "No model finished."
    lines = ["| model | setting | tokens/s | vs first setting | MFU |", "|---|---|---:|---:|---:|"]
    for path in paths:
        rows = json.loads(path.read_text())
        base = rows[0]["tokens_per_sec"] if rows else float("nan")
        for r in rows:
            model, _, setting = r["case"].partition(", ")
            tps, mfu = r["tokens_per_sec"], r["mfu"]
            lines.append(
                f"| {model} | {setting} | {'n/a' if math.isnan(tps) else f'{tps:,.0f}'} | "
                f"{'n/a' if math.isnan(tps / base) else f'{tps / base:.2f}x'} | "
                f"{'n/a' if math.isnan(mfu) else f'{100 * mfu:.1f}%'} |"
            )
    failed = [f"- {r['case']} failed: {r['error']}" for path in paths
              for r in json.loads(path.read_text()) if "error" in r]
    return "\n".join(lines + ([""] + failed if failed else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe")
    sub.add_parser("sites")
    sub.add_parser("machine-pth").add_argument("sites", nargs="*")
    sub.add_parser("env")
    sub.add_parser("junit").add_argument("file", type=Path)
    sub.add_parser("throughput").add_argument("files", type=Path, nargs="*")
    args = p.parse_args(argv)
    if args.cmd == "probe":
        gone = missing()
        print(", ".join(gone) if gone else "all import")
        return 1 if gone else 0
    if args.cmd == "machine-pth":
        print(machine_pth(args.sites))
    elif args.cmd == "sites":  # what the run book's venv adds behind its own packages
        sites = site.getsitepackages()
        if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
            sites.append(site.getusersitepackages())
        print("\n".join(dict.fromkeys(sites)))
    elif args.cmd == "env":
        print(env())
    elif args.cmd == "junit":
        text, ok = junit(args.file)
        print(text)
        return 0 if ok else 1
    else:
        print(throughput(args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
