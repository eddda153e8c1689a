"""MDS datasets in object storage: where they are cached, and whether they can be reached.

A ``remote`` is any URL mosaicml-streaming reads (``s3://``, ``gs://``, ``oci://``,
``azure://``, ``hf://``, ...). Credentials and endpoints come from where streaming's clients
read them (for S3: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``,
``~/.aws/credentials`` and ``~/.aws/config``; ``S3_ENDPOINT_URL`` for an S3-compatible store
such as MinIO, Cloudflare R2 or Ceph); foundryx never takes them from a YAML.

Before a loader is built, :func:`fetch_index` reads the dataset's ``index.json`` (and its
foundryx manifest, when it has one), so a missing bucket, a wrong endpoint or missing
credentials is one :class:`~foundryx.errors.DataError` naming the remote and the fix instead
of a traceback from a dataloader worker half-way into the first batch.

boto3 and streaming are imported inside the functions that use them (heavy: only a run or
conversion that touches object storage loads them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from foundryx.errors import DataError

log = logging.getLogger(__name__)

INDEX = "index.json"
MANIFEST = "foundryx_manifest.json"
CACHE_ENV = "FOUNDRYX_DATA_CACHE"
SCHEMES = ("s3", "gs", "oci", "azure", "azure-dl", "hf", "dbfs", "sftp", "alipan")
CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a "
                   "profile in ~/.aws/credentials")


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL of object storage (``s3://...``) rather than a local folder."""
    return isinstance(path, str) and urllib.parse.urlparse(path).scheme in SCHEMES


def scheme_problem(remote: Any, key: str) -> str | None:
    """A problem with the ``remote`` value at YAML path ``key`` (before any network call)."""
    if not isinstance(remote, str) or "://" not in remote:
        return (f"{key}: expected the URL of an MDS dataset in object storage, e.g. "
                f"s3://bucket/path, got {remote!r}; a local folder goes in local:")
    scheme = urllib.parse.urlparse(remote).scheme
    if scheme not in SCHEMES:
        return (f"{key}: {remote!r} has the scheme {scheme!r}, which mosaicml-streaming does not "
                f"read; use one of {', '.join(s + '://' for s in SCHEMES)}")
    return None


def join(remote: str, *parts: str | None) -> str:
    """``remote`` with path parts appended (``None`` and empty parts skipped)."""
    rest = "/".join(p.strip("/") for p in parts if p)
    return f"{remote.rstrip('/')}/{rest}" if rest else remote.rstrip("/")


def cache_root() -> Path:
    """Where shards of remote datasets are cached when a loader names no ``local``:
    ``$FOUNDRYX_DATA_CACHE``, else ``~/.cache/foundryx/mds``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "foundryx" / "mds")


def default_local(remote: str, key: str) -> str:
    """The cache folder of ``remote`` (one per dataset URL); logs one line saying where."""
    parsed = urllib.parse.urlparse(remote.rstrip("/"))
    name = "-".join(p for p in [parsed.netloc, *parsed.path.strip("/").split("/")] if p)
    digest = hashlib.blake2s(remote.rstrip("/").encode(), digest_size=4).hexdigest()
    folder = cache_root() / f"{name[-80:]}-{digest}"
    log.info("%s: %s is cached in %s (no local: given; set local: or %s to choose)",
             key, remote, folder, CACHE_ENV)
    return str(folder)


def _endpoint() -> str:
    return os.environ.get("S3_ENDPOINT_URL") or "AWS S3 (S3_ENDPOINT_URL is not set)"


def _s3_client(unsigned: bool) -> Any:
    """A boto3 client as streaming's (same session, endpoint), failing fast on a bad endpoint."""
    from boto3.session import Session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(connect_timeout=10, read_timeout=60, retries={"max_attempts": 2,
                                                                  "mode": "standard"},
                    **({"signature_version": UNSIGNED} if unsigned else {}))
    return Session().client("s3", config=config, endpoint_url=os.environ.get("S3_ENDPOINT_URL"))


def s3_problem(error: Exception, url: str, unsigned: bool = False) -> str:
    """One sentence saying what went wrong reaching ``url`` and how to fix it."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    bucket = urllib.parse.urlparse(url).netloc
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)) or (
            unsigned and isinstance(error, ClientError)):
        return (f"no AWS credentials were found to read {url}, and reading it without them "
                f"(as a public bucket) failed; {CREDENTIALS_FIX}")
    if isinstance(error, (EndpointConnectionError, BotoConnectionError)):
        return (f"cannot reach the S3 endpoint {_endpoint()} for {url} ({error}); check "
                f"S3_ENDPOINT_URL (the URL of your S3-compatible store; unset it for AWS S3)")
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code"))
        if code == "NoSuchBucket":
            return (f"bucket {bucket!r} does not exist at {_endpoint()}; check the bucket "
                    f"name in {url}, or S3_ENDPOINT_URL if the bucket is in another store")
        if code in ("NoSuchKey", "404"):
            return f"{url} does not exist"
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return (f"access to {url} was refused ({code}); check the credentials "
                    f"({CREDENTIALS_FIX}) and that they may read bucket {bucket!r}")
        return f"{url}: {code} ({error})"
    return f"{url}: {type(error).__name__}: {error}"


def _download(url: str, dest: Path) -> None:
    """Download one object; an S3 failure becomes a DataError saying why, with a fix."""
    if urllib.parse.urlparse(url).scheme != "s3":
        from streaming.base.storage.download import CloudDownloader

        try:
            CloudDownloader.direct_download(url, str(dest), timeout=60)
        except FileNotFoundError:
            raise
        except Exception as e:  # any cloud SDK's error: name the remote and what it said
            raise DataError(f"could not read {url} ({type(e).__name__}: {e}); check the "
                            "URL and that this machine's credentials for it are set") from None
        return
    from boto3.session import Session
    from botocore.exceptions import BotoCoreError, ClientError

    parsed = urllib.parse.urlparse(url)
    unsigned = Session().get_credentials() is None  # streaming then tries a public bucket
    client = _s3_client(unsigned)
    try:
        client.download_file(parsed.netloc, parsed.path.lstrip("/"), str(dest))
    except (BotoCoreError, ClientError) as e:
        code = e.response.get("Error", {}).get("Code") if isinstance(e, ClientError) else None
        if code in ("NoSuchKey", "404") and not unsigned:
            try:  # a HEAD's 404 does not say whether the key or the bucket is missing
                client.head_bucket(Bucket=parsed.netloc)
            except ClientError as bucket_error:
                if str(bucket_error.response.get("Error", {}).get("Code")) in ("404",
                                                                               "NoSuchBucket"):
                    bucket_error.response["Error"]["Code"] = "NoSuchBucket"
                    raise DataError(s3_problem(bucket_error, url)) from None
            raise FileNotFoundError(url) from None
        raise DataError(s3_problem(e, url, unsigned)) from None


def fetch_index(remote: str, split: str | None, key: str) -> tuple[dict[str, Any], dict | None]:
    """``(index, manifest or None)`` of the MDS dataset at ``remote``/``split``; a DataError
    naming the remote (``key``: its YAML path) and the fix when it cannot be read."""
    url = join(remote, split)
    with tempfile.TemporaryDirectory(prefix="foundryx-index-") as tmp:
        try:
            _download(join(url, INDEX), Path(tmp) / INDEX)
        except FileNotFoundError:
            raise DataError(
                f"{key}: {join(url, INDEX)} does not exist, so there is no MDS dataset at {url}; "
                f"check the path (and split), or write one there with `foundryx data convert "
                f"... --out {remote}`") from None
        except DataError as e:
            raise DataError(f"{key}: {e}") from None
        try:
            index = json.loads((Path(tmp) / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{key}: {join(url, INDEX)} is unreadable ({e}); re-convert the "
                            "data") from None
        try:
            _download(join(url, MANIFEST), Path(tmp) / MANIFEST)
            manifest = json.loads((Path(tmp) / MANIFEST).read_text())
        except FileNotFoundError:
            manifest = None  # an MDS dataset not written by foundryx
        except (DataError, OSError, ValueError):
            manifest = None
    return index, manifest


def check_cache(local: str, split: str | None, index: dict[str, Any], remote: str,
                key: str) -> None:
    """Refuse a ``local`` cache holding another dataset than ``remote`` (streaming would read
    the cached ``index.json`` and shards instead of the remote's)."""
    cached = Path(local).expanduser() / (split or "") / INDEX
    if not cached.is_file():
        return
    try:
        same = json.loads(cached.read_text()) == index
    except (OSError, ValueError):
        same = False
    if not same:
        raise DataError(
            f"{key}: the cache {cached.parent} holds another dataset than {join(remote, split)} "
            f"(its {INDEX} differs: the remote was re-converted, or local: names another "
            f"dataset's folder); delete {cached.parent}, or set local: to an empty folder")


def fetch_dataset(remote: str, local: str, split: str | None, key: str) -> Path:
    """Download a whole MDS dataset (index and every shard) into ``local``/``split``; files
    already there with the right size are kept. Returns the local folder."""
    index, _ = fetch_index(remote, split, key)
    check_cache(local, split, index, remote, key)
    folder = Path(local).expanduser() / (split or "")
    folder.mkdir(parents=True, exist_ok=True)
    for shard in index["shards"]:
        for which in ("raw_data", "zip_data"):
            info = shard.get(which)
            if not info:
                continue
            dest = folder / info["basename"]
            if dest.is_file() and dest.stat().st_size == info["bytes"]:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
            try:
                _download(join(remote, split, info["basename"]), part)
            except FileNotFoundError:
                raise DataError(f"{key}: shard {join(remote, split, info['basename'])} is missing "
                                f"(listed in its {INDEX}); re-convert the data") from None
            os.replace(part, dest)
            break
    tmp = folder / f".{INDEX}.{os.getpid()}.part"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, folder / INDEX)  # last: the folder is a dataset only when complete
    return folder


# -- writing: conversion and merge into object storage ---------------------------------------
def staging_folder(remote: str) -> Path:
    """The local folder a conversion into ``remote`` works in (its resumable ledger and each
    chunk's index; shards are deleted once uploaded)."""
    parsed = urllib.parse.urlparse(remote.rstrip("/"))
    name = "-".join(p for p in [parsed.netloc, *parsed.path.strip("/").split("/")] if p)
    digest = hashlib.blake2s(remote.rstrip("/").encode(), digest_size=4).hexdigest()
    return cache_root() / "_convert" / f"{name[-80:]}-{digest}"


def uploader(local: Path, remote: str) -> Any:
    """streaming's uploader for ``local`` → ``remote``; checks the bucket exists (S3: its
    error becomes one DataError naming the remote and the fix)."""
    from streaming.base.storage.upload import CloudUploader

    local.mkdir(parents=True, exist_ok=True)
    try:
        return CloudUploader.get((str(local), remote), keep_local=True, exist_ok=True)
    except Exception as e:  # any SDK's error: say which remote, what it said, and the fix
        raise DataError(_write_problem(e, remote)) from None


def _write_problem(error: Exception, remote: str) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    if urllib.parse.urlparse(remote).scheme == "s3" and isinstance(error, (BotoCoreError,
                                                                           ClientError)):
        if isinstance(error, ClientError) and str(error.response.get("Error", {}).get(
                "Code")) in ("404", "NoSuchBucket"):
            bucket = urllib.parse.urlparse(remote).netloc
            return (f"cannot write to {remote}: bucket {bucket!r} does not exist at "
                    f"{_endpoint()}; create it, or check the bucket name and S3_ENDPOINT_URL")
        return f"cannot write to {remote}: {s3_problem(error, remote)}"
    return (f"cannot write to {remote} ({type(error).__name__}: {error}); check the URL and "
            "this machine's credentials for it")


def upload(up: Any, names: list[str], remote: str) -> None:
    """Upload files of ``up.local`` (named relative to it) in this order."""
    for name in names:
        try:
            up.upload_file(name)
        except Exception as e:  # any SDK's error, as in uploader()
            raise DataError(_write_problem(e, remote)) from None


def list_keys(up: Any, remote: str, prefix: str = "") -> list[str]:
    """Object names under ``remote``/``prefix``, relative to ``remote``."""
    base = urllib.parse.urlparse(remote).path.strip("/")
    try:
        keys = up.list_objects(prefix) or []
    except Exception as e:  # any SDK's error, as in uploader()
        raise DataError(_write_problem(e, remote)) from None
    return [k[len(base):].lstrip("/") if base and k.startswith(base) else k for k in keys]


def delete(remote: str, name: str) -> None:
    """Delete one object (S3 only: what ``--overwrite`` of a dataset in a bucket needs)."""
    from botocore.exceptions import BotoCoreError, ClientError

    url = join(remote, name)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "s3":
        raise DataError(f"{remote} already holds a dataset and foundryx overwrites datasets "
                        f"only in s3:// storage; delete {url} yourself, or choose another --out")
    try:
        _s3_client(False).delete_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
    except (BotoCoreError, ClientError) as e:
        raise DataError(_write_problem(e, remote)) from None
