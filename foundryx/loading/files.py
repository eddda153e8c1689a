"""The safetensors files of a pretrained Hugging Face folder, checked before anything is read.

A folder holds ``model.safetensors`` or ``model.safetensors.index.json`` and the files its
``weight_map`` names. Every file's header (8 bytes of little-endian length, then JSON naming
each tensor's dtype, shape and byte range) is parsed here, without reading any tensor data, so
that a missing file, an index naming a file that is not there, a truncated or corrupt header,
or a tensor whose bytes run past the end of its file is one clear message naming the file and
tensor, before any rank starts a collective.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from foundryx.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header's size

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    **({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
       if hasattr(torch, "float8_e4m3fn") else {}),
}

CONVERT = (
    "convert it to safetensors once, e.g.:\n"
    "    from transformers import AutoModelForCausalLM\n"
    "    m = AutoModelForCausalLM.from_pretrained('{folder}', torch_dtype='auto')\n"
    "    m.save_pretrained('{folder}-safetensors', safe_serialization=True)\n"
    "then point pretrained_model_name_or_path at {folder}-safetensors"
)


class PretrainedLoadError(CheckpointError):
    """A pretrained folder's weights are missing, unreadable or do not match the model."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header; PretrainedLoadError naming the
    file for anything that is not a whole, well-formed safetensors file."""
    def bad(why: str) -> PretrainedLoadError:
        return PretrainedLoadError(f"{file}: {why}; the file is truncated or not a safetensors "
                                   "file (download or save it again)")

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise bad(f"its header claims {n} bytes but the file has {size}")
            raw = f.read(n)
    except OSError as e:
        raise PretrainedLoadError(f"{file}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    start = 8 + n
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed entry {info!r}") from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if e - b != nbytes or b < 0:
            raise bad(f"tensor {name!r}: {e - b} bytes for shape {list(shape)} {info['dtype']}")
        if start + e > size:
            raise bad(f"tensor {name!r} ends at byte {start + e} but the file has {size}")
        out[name] = Entry(file, dtype, shape, start + b, start + e)
    return out


def checkpoint_entries(folder: str | os.PathLike) -> dict[str, Entry]:
    """Every tensor of the folder's safetensors checkpoint (one file or an index and its
    files), keyed by its name; PretrainedLoadError for a folder without one."""
    folder = Path(folder)
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PretrainedLoadError(f"{index}: not a safetensors index (a JSON object with a "
                                      f"weight_map): {e}") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise PretrainedLoadError(
                f"{index} names {len(missing)} file(s) that are not in {folder}: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; the download "
                "is incomplete: fetch the missing files (or the whole folder) again")
        entries: dict[str, Entry] = {}
        for f in files:
            entries.update(read_header(folder / f))
        absent = [k for k, f in weight_map.items() if k not in entries]
        if absent:
            raise PretrainedLoadError(
                f"{index} says {absent[0]!r} is in {weight_map[absent[0]]}, but that file's "
                f"header has no such tensor ({len(absent)} such); the index and the files do "
                "not belong together")
        return entries
    if single.is_file():
        return read_header(single)
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        raise PretrainedLoadError(
            f"{folder}: has pickle weights ({', '.join(pickles[:3])}) but no safetensors; "
            "foundryx reads pretrained weights shard by shard only from safetensors (pickle "
            "files cannot be read in slices, and loading them runs pickled code); "
            + CONVERT.format(folder=folder))
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    raise PretrainedLoadError(
        f"{folder}: no {SINGLE} or {INDEX}"
        + (f" (it has {', '.join(others[:3])}: name the single file {SINGLE} or add an index)"
           if others else "; is this the folder the weights were saved to?"))
