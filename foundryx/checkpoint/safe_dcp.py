"""Reading torch.distributed.checkpoint (DCP) folders without executing pickled code.

DCP stores its ``.metadata`` with plain ``pickle`` and loads non-tensor items with
``torch.load(weights_only=False)``. Here the metadata goes through an unpickler that only
builds DCP's own metadata classes, torch sizes/dtypes/layouts and paths, and non-tensor items
go through ``torch.load(weights_only=True)``. A pickle that names anything else is refused.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint.api import CheckpointException

from foundryx.checkpoint.layout import file_and_rank
from foundryx.errors import CheckpointError

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PATH_CLASSES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes and plain torch value types."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module.startswith(_DCP_MODULES):
                obj = getattr(__import__(module, fromlist=[name]), name, None)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
            if module == "torch":
                obj = getattr(torch, name, None)
                if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                    return obj
            if module == "torch.serialization" and name == "_get_layout":
                return _layout_by_name
            if module == "pathlib" and name in _PATH_CLASSES:
                return getattr(pathlib, name)
            if module == "collections" and name == "OrderedDict":
                from collections import OrderedDict

                return OrderedDict
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def _layout_by_name(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layout


# What a DCP load raises for a damaged file: torch's CheckpointException derives from
# BaseException in torch 2.7 (so `except Exception` misses it), from Exception in later releases.
DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def dcp_error_text(e: BaseException) -> str:
    """The first informative line of a DCP error: CheckpointException wraps each rank's
    traceback; the exception line at its end says what went wrong."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if isinstance(e, CheckpointException):
        for ln in reversed(lines):
            if re.match(r"^[\w.]+(Error|Exception)\b", ln):
                return ln
    return lines[0] if lines else type(e).__name__


def read_metadata(dcp_dir: str | Path) -> Metadata:
    """The DCP metadata of ``dcp_dir``, unpickled safely; CheckpointError naming the file."""
    path = Path(dcp_dir) / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any malformed pickle: truncated, wrong content, refused global
        raise CheckpointError(f"{path}: not valid checkpoint metadata ({e})") from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{path}: not valid checkpoint metadata (holds {type(meta).__name__})")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with an allow-list. ``failed_file`` is the
    data file a failed ``read_data`` was reading (None: none failed, or before any file), so
    that an error can name it: see :meth:`where`."""

    failed_file: Path | None = None

    def read_data(self, plan, planner):
        fs, reader = self.fs, self

        class _Tracking:  # the parent opens each data file through fs.create_stream
            def __getattr__(self, name: str) -> Any:
                return getattr(fs, name)

            def create_stream(self, path: Any, mode: str) -> Any:
                reader.failed_file = Path(path)  # cleared below when every read succeeds
                return fs.create_stream(path, mode)

        self.fs = _Tracking()
        try:
            result = super().read_data(plan, planner)
        finally:
            self.fs = fs
        self.failed_file = None
        return result

    def where(self) -> str:
        """The file a failed read was reading, with the rank that wrote it; else the folder."""
        return file_and_rank(self.failed_file) if self.failed_file is not None else str(self.path)

    def read_metadata(self) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = read_metadata(self.path)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with ``torch.load(weights_only=True)``.

    The item is decoded safely first; the parent then stores a re-serialised copy that holds
    only the plain types that decoding allowed.
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r}: refused to load ({e})"
            ) from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
