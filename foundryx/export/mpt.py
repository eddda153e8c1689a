"""Any MPT as a Hugging Face folder of model_type ``foundryx_mpt``.

The folder holds the MPT's own ``config.json`` and weights plus two one-line code files that
re-export foundryx's classes, named in ``auto_map``. So, wherever foundryx is installed:

- ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads it in a
  process that never imported foundryx;
- after ``import foundryx.models.mpt.modeling`` (which registers ``foundryx_mpt`` with
  ``AutoConfig``/``AutoModelForCausalLM``) plain ``from_pretrained(folder)`` loads it, and so
  does ``hf_causal_lm``.
"""

from __future__ import annotations

from pathlib import Path

CODE_FILES = {
    "configuration_foundryx_mpt.py": (
        '"""foundryx MPT config (pip install foundryx)."""\n'
        "from foundryx.models.mpt.configuration import MPTConfig\n\n"
        '__all__ = ["MPTConfig"]\n'
    ),
    "modeling_foundryx_mpt.py": (
        '"""foundryx MPT causal LM (pip install foundryx)."""\n'
        "from foundryx.models.mpt.modeling import MPTForCausalLM\n\n"
        '__all__ = ["MPTForCausalLM"]\n'
    ),
}
AUTO_MAP = {
    "AutoConfig": "configuration_foundryx_mpt.MPTConfig",
    "AutoModelForCausalLM": "modeling_foundryx_mpt.MPTForCausalLM",
}


def prepare(model) -> None:
    """Point ``auto_map`` at the code files of :func:`write_code_files`.

    Loading a remote-code folder makes transformers mark the classes it loaded (ours, via the
    code files) for "save my source file too"; this model and config opt out, as the two
    code files are all the folder needs.
    """
    model.config.auto_map = dict(AUTO_MAP)
    model._auto_class = None
    model.config._auto_class = None


def write_code_files(folder: Path) -> None:
    """Write the two re-export files that ``AUTO_MAP`` names."""
    for name, text in CODE_FILES.items():
        (Path(folder) / name).write_text(text)
