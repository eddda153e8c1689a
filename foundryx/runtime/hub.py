"""Hub names and local paths: is a name a folder or a Hugging Face hub id, and can the hub be
reached. A bottom module (it imports only :mod:`foundryx.errors`), shared by ``models``
(``hf_causal_lm``) and ``data`` (the ``hf`` tokenizer).

A hub name is tried only when the hub answers (or the name is in the local cache), so an
offline machine gets a clear error at once instead of a minute of retries.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from foundryx.errors import ConfigError

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 3.0


def looks_like_path(name: str) -> bool:
    """A name starting with ``.``, ``/`` or ``~`` or with two slashes is a path, not a hub id."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def hub_reachable() -> bool:
    """Whether the Hugging Face hub endpoint accepts a TCP connection within a few seconds
    (asked once per endpoint and process: the tokenizer and the model share the answer)."""
    from huggingface_hub import constants

    return _answers(constants.ENDPOINT)


@functools.cache
def _answers(endpoint: str) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def nearest_folder(name: str) -> str | None:
    """The existing folder closest to ``name`` read as a path (``models/tiny-qwen`` ->
    ``./models/tiny-qwen3``): each part that is not a folder replaced by the closest subfolder
    name of the folder above it; None when a part has no close match."""
    path = Path(name).expanduser()
    folder = Path(path.anchor) if path.is_absolute() else Path(".")
    for part in path.parts[1:] if path.is_absolute() else path.parts:
        if not (folder / part).is_dir():
            try:
                names = [d.name for d in folder.iterdir() if d.is_dir()]
            except OSError:
                return None
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            if not close:
                return None
            part = close[0]
        folder = folder / part
    if folder == Path(".") or str(folder) == str(path):
        return None
    return str(folder) if folder.is_absolute() or name.startswith("~") else f"./{folder}"


def missing_source(name: str, key: str, offline: bool) -> ConfigError:
    """The error for a name that is no local folder and cannot be had from the hub (offline
    or unreachable) or its cache: one line, with the nearest existing folder when there is
    one (a relative path without ``./`` that was mistyped looks like a hub name)."""
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is unreachable"
    near = nearest_folder(name)
    fix = (f"Did you mean {near}? Otherwise download" if near else
           f"Give a local folder as a path (./{name}), or download")
    return ConfigError([
        f"{key}: {name!r} is neither a local folder nor reachable on the Hugging Face hub "
        f"({why}, and it is not in the Hugging Face cache). {fix} it where there is network "
        f"(`huggingface-cli download {name} --local-dir DIR`) and give DIR"
    ])


def is_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (read now, not only when huggingface_hub was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in (
        "1", "true", "yes", "on")


def _local_files_only(name: str, key: str, file: str) -> bool:
    """A hub name: False when the hub answers, True when it is to be read from the cache
    (``file`` of it is there); else the ConfigError of :func:`missing_source`."""
    from huggingface_hub import try_to_load_from_cache

    offline = is_offline()
    if not offline and hub_reachable():
        return False
    try:
        cached = isinstance(try_to_load_from_cache(name, file), str)
    except ValueError:  # not a valid hub id (huggingface_hub's HFValidationError)
        cached = False
    if cached:
        return True
    raise missing_source(name, key, offline)


def hub_problem(name: str, key: str, file: str = "config.json") -> str | None:
    """For a name that is no local folder and does not look like a path: the problem when it
    can be had neither from the hub (offline or unreachable) nor from the cache, else None.
    Probes the hub (at most a few seconds); imports no torch."""
    try:
        _local_files_only(name, key, file)
    except ConfigError as e:
        return e.problems[0]
    return None


def resolve_source(name: str, key: str, file: str = "config.json") -> tuple[str, bool]:
    """``(name or folder, local_files_only)`` for ``from_pretrained``; ``key`` is the YAML path.

    A local folder is used as is. A hub name is fetched when the hub is reachable, else read
    from the Hugging Face cache (``file`` of it there; one log line says so), else a
    ConfigError says what to do.
    """
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError([f"{key}: folder {name} has no config.json; give a folder written "
                               "by save_pretrained (or `foundryx export`)"])
        return str(local), True
    if looks_like_path(name):
        raise ConfigError([f"{key}: folder {name} does not exist; give a local model folder "
                           "or a hub name such as 'meta-llama/Llama-3.2-1B'"])
    if _local_files_only(name, key, file):
        log.info("%s: using the cached copy of %r (%s)", key, name, "HF_HUB_OFFLINE is set"
                 if is_offline() else "the Hugging Face hub is unreachable")
        return name, True
    return name, False
