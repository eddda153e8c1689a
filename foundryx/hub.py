"""Hub names and local paths: is a name a folder or a Hugging Face hub id, and can the hub be
reached. A bottom module (it imports only :mod:`foundryx.errors`), shared by ``models``
(``hf_causal_lm``) and ``data`` (the ``hf`` tokenizer).

A hub name is tried only when the hub answers (or the name is in the local cache), so an
offline machine gets a clear error at once instead of a minute of retries.
"""

from __future__ import annotations

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
    """Whether the Hugging Face hub endpoint accepts a TCP connection within a few seconds."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def resolve_source(name: str, key: str) -> tuple[str, bool]:
    """``(name or folder, local_files_only)`` for ``from_pretrained``; ``key`` is the YAML path.

    A local folder is used as is. A hub name is fetched when the hub is reachable, else read
    from the Hugging Face cache (one log line says so), else a ConfigError says what to do.
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
    from huggingface_hub import constants, try_to_load_from_cache

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE") == "1"
    cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    if not offline and hub_reachable():
        return name, False
    if cached:
        log.info("%s: using the cached copy of %r (%s)", key, name,
                 "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is unreachable")
        return name, True
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is unreachable"
    raise ConfigError([
        f"{key}: {name!r} is not a local folder, {why}, and it is not in the Hugging Face "
        f"cache; download it where there is network (`huggingface-cli download {name} "
        f"--local-dir DIR`) and give DIR instead (write a local folder as ./{name})"
    ])
