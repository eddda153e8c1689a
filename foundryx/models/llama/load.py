"""A Hugging Face Llama folder (``config.json`` + ``model.safetensors`` or a
``model.safetensors.index.json`` and its shards) as a :class:`~foundryx.models.llama.model.LlamaLM`.

The module is built on the meta device (no parameter is allocated or initialized) and the
checkpoint's tensors are assigned to it as they are read (cast once where ``dtype`` asks for
another): loading costs reading the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from foundryx.errors import CheckpointError
from foundryx.models.llama.model import LlamaLM, rope_inv_freq
from foundryx.models.llama.spec import spec_from_hf_config, unsupported

__all__ = ["load_hf_llama", "native_problem", "read_hf_config"]

# tensors old conversions carry that transformers ignores on load (recomputed, not weights)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(folder: str | Path) -> dict:
    """``folder``'s config.json as a dict; a CheckpointError naming the file where it is
    missing or not JSON."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; give a Hugging Face model folder (config.json "
                              "and model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from None


def _weight_files(folder: Path) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        shards = [folder / name for name in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: listed in {index.name} but missing; copy the "
                                      "whole model folder again")
        return shards
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json; save "
                          "the model with save_pretrained (safetensors weights)")


def _read(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in files:
        try:
            part = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        for name, tensor in part.items():
            if not name.endswith(_IGNORED_SUFFIXES):
                tensors[name], origin[name] = tensor, path
    return tensors, origin


def native_problem(folder: str | Path) -> str | None:
    """Why :func:`load_hf_llama` would not load the Hugging Face folder ``folder`` (a one-line
    reason: not a local folder, no readable config.json, a config :func:`unsupported` refuses,
    no safetensors weights); None: it would (its tensors are checked when it loads)."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} is not a local folder"
    try:
        reason = unsupported(read_hf_config(folder))
    except CheckpointError as e:
        return str(e)
    if reason is not None:
        return reason
    if not any((folder / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json")):
        return "no safetensors weights (model.safetensors or model.safetensors.index.json)"
    return None


def load_hf_llama(folder: str | Path, dtype: torch.dtype | str | None = None,
                  device: str | torch.device = "cpu") -> LlamaLM:
    """The Llama of Hugging Face folder ``folder`` in eval mode, its parameters in ``dtype`` on
    ``device``. ``dtype`` None: torch's default (float32), as transformers 4.57's
    ``from_pretrained`` without a dtype; "auto": the dtype config.json declares, else the
    weights' own, as ``from_pretrained(dtype="auto")`` (transformers 5's default). A
    CheckpointError (naming the file and the fix) for a missing or unreadable file, a config
    :func:`unsupported` refuses, a missing or unexpected tensor, or a tensor of the wrong
    shape."""
    folder = Path(folder)
    config = read_hf_config(folder)
    reason = unsupported(config)
    if reason is not None:
        raise CheckpointError(f"{folder / 'config.json'}: not a model the native Llama reproduces "
                              f"({reason}); load it with transformers instead")
    spec = spec_from_hf_config(config)
    files = _weight_files(folder)
    tensors, origin = _read(files)
    if dtype == "auto":
        floating = (t.dtype for t in tensors.values() if t.is_floating_point())
        dtype = spec.dtype or next(floating, None)
    elif isinstance(dtype, str):
        raise ValueError(f"dtype {dtype!r}: give a torch.dtype, 'auto' or None")
    dtype = dtype or torch.get_default_dtype()
    with torch.device("meta"):
        model = LlamaLM(spec)
    expected = dict(model.state_dict(keep_vars=True))
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)  # transformers ties it to the embeddings regardless
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    where = files[0] if len(files) == 1 else folder / "model.safetensors.index.json"
    if missing:
        raise CheckpointError(f"{where}: missing tensors {_few(missing)} for a {spec.num_hidden_layers}"
                              f"-layer Llama; is config.json the one these weights were saved with?")
    if extra:
        raise CheckpointError(f"{where}: unexpected tensors {_few(extra)}; config.json describes "
                              "a different model than these weights (or not a Llama)")
    state = {}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{origin[name]}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {tuple(expected[name].shape)}; is config.json "
                                  "the one these weights were saved with?")
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(spec).to(device)
    model.requires_grad_(False)
    return model.eval()


def _few(names: list[str], n: int = 4) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
