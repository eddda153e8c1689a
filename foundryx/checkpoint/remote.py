"""Checkpoints in object storage (``save_folder: s3://bucket/run``): the remote layout, finding
the newest complete checkpoint in a bucket, downloading one, deleting and tidying.

::

    s3://bucket/run/
      ep0-ba8/...             the same files as a local checkpoint (layout.py), uploaded by the
      ep0-ba8/manifest.json   ranks that wrote them; the manifest is uploaded last, by rank 0,
                              only when every file it lists is in the bucket with its size

A remote checkpoint is *complete* when its ``manifest.json`` is there and every file the
manifest lists is there with the listed size; a download then checks every sha256. A kill
mid-upload leaves files without a manifest, which are never taken as a checkpoint and are
deleted when the next run on the save_folder starts (see :func:`tidy`).

The S3 client is boto3's, configured like Composer's and mosaicml-streaming's: the endpoint
from ``S3_ENDPOINT_URL`` (any S3-compatible store), credentials from the standard AWS chain.
Local copies live under ``$FOUNDRYX_CHECKPOINT_CACHE`` (default
``~/.cache/foundryx/checkpoints``), see
:func:`cache_folder`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.checkpoint.layout import MANIFEST, TMP_PREFIX, Manifest
from foundryx.checkpoint.verify import file_problems
from foundryx.errors import CheckpointError

log = logging.getLogger(__name__)

SCHEMES = ("s3://",)
PROBE = ".foundryx-write-probe"
CACHE_ENV = "FOUNDRYX_CHECKPOINT_CACHE"


def is_remote(path: str | os.PathLike | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


@dataclass(frozen=True)
class RemoteFolder:
    """``s3://bucket/prefix`` split in two; ``key(rel)`` is the object key of a path under it."""

    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, url: str) -> RemoteFolder:
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{url}: no bucket; write s3://BUCKET/PATH")
        return cls(bucket, prefix.strip("/"))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def rel(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key


def cache_folder(url: str, kind: str = "staging") -> Path:
    """The local folder for ``url``'s checkpoints: ``<cache>/<kind>/<bucket>/<prefix>``, where
    the cache is ``$FOUNDRYX_CHECKPOINT_CACHE`` (default ``~/.cache/foundryx/checkpoints``) and
    ``kind`` is ``staging`` (a training run's saves in flight, and its resume download) or
    ``downloads`` (``load_path``, ``foundryx export``, ``foundryx eval``)."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "foundryx" / "checkpoints")
    r = RemoteFolder.parse(url)
    return root / kind / r.bucket / (r.prefix or "_root")


def client(connect_timeout: float = 10, attempts: int = 3) -> Any:
    """A boto3 S3 client for ``S3_ENDPOINT_URL`` (unset: AWS) with standard retries."""
    import boto3  # heavy: only when a remote folder is used
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None,
        config=Config(connect_timeout=connect_timeout, read_timeout=60,
                      retries={"max_attempts": attempts, "mode": "standard"}),
    )


def describe_error(e: BaseException) -> str:
    """One line for a boto3/botocore error: the service's code and message, or the cause."""
    response = getattr(e, "response", None)
    if isinstance(response, dict) and response.get("Error"):
        err = response["Error"]
        return f"{err.get('Code', '?')}: {err.get('Message') or type(e).__name__}"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def check_access(url: str, write: bool = True) -> str | None:
    """None when ``url``'s bucket can be listed (and written, with ``write``), else one line
    saying what is wrong and how to fix it: missing bucket, wrong endpoint, no credentials."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    r = RemoteFolder.parse(url)
    endpoint = os.environ.get("S3_ENDPOINT_URL") or "AWS (S3_ENDPOINT_URL is not set)"
    try:
        s3 = client(connect_timeout=5, attempts=2)
        s3.list_objects_v2(Bucket=r.bucket, Prefix=r.key(""), MaxKeys=1)
        if write:
            probe = r.key(f"{PROBE}-{socket.gethostname()}-{os.getpid()}")
            s3.put_object(Bucket=r.bucket, Key=probe, Body=b"")
            s3.delete_object(Bucket=r.bucket, Key=probe)
        return None
    except NoCredentialsError:
        return (f"{url}: no S3 credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for the bucket's store")
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "404"):
            return (f"{url}: bucket {r.bucket!r} does not exist at {endpoint}; create it or fix "
                    "the bucket name (or S3_ENDPOINT_URL)")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            what = "write to" if write else "read"
            return (f"{url}: access denied ({describe_error(e)}); the credentials cannot {what} "
                    f"bucket {r.bucket!r}: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        return f"{url}: the bucket cannot be used ({describe_error(e)})"
    except (BotoCoreError, OSError) as e:
        return (f"{url}: cannot reach the object store at {endpoint} ({describe_error(e)}); "
                "check S3_ENDPOINT_URL and the network")


def require_access(url: str, write: bool = True) -> None:
    problem = check_access(url, write)
    if problem is not None:
        raise CheckpointError(problem)


# -- what is in the bucket ----------------------------------------------------------------
def list_objects(s3: Any, remote: RemoteFolder) -> dict[str, int]:
    """``{path relative to the folder: size}`` of every object under ``remote``."""
    out: dict[str, int] = {}
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=remote.bucket, Prefix=remote.key(""))
    for page in pages:
        for obj in page.get("Contents", []):
            out[remote.rel(obj["Key"])] = int(obj["Size"])
    return out


def read_manifest(s3: Any, remote: RemoteFolder, name: str) -> Manifest:
    """The manifest of ``name``, read and validated like a local one."""
    body = s3.get_object(Bucket=remote.bucket, Key=remote.key(f"{name}/{MANIFEST}"))["Body"].read()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / MANIFEST).write_bytes(body)
        try:
            return Manifest.read(Path(tmp))
        except CheckpointError as e:
            raise CheckpointError(str(e).replace(str(Path(tmp)), f"{remote.url}/{name}")) from None


def checkpoints(s3: Any, remote: RemoteFolder) -> tuple[list[tuple[str, Manifest]], list[str], list[str]]:
    """``(complete, incomplete, unfinished)`` under ``remote``: complete checkpoints newest first
    with their manifests; names whose manifest lists files that are missing or of another size
    (or cannot be read), with why; names of uploads that never got a manifest."""
    objects = list_objects(s3, remote)
    names: dict[str, dict[str, int]] = {}
    for rel, size in objects.items():
        head, sep, tail = rel.partition("/")
        if sep:
            names.setdefault(head, {})[tail] = size
    complete, incomplete, unfinished = [], [], []
    for name, files in names.items():
        if MANIFEST not in files:
            unfinished.append(name)
            continue
        try:
            m = read_manifest(s3, remote, name)
        except CheckpointError as e:
            incomplete.append(f"{remote.url}/{name}: {e}")
            continue
        missing = [rel for rel, want in m.files.items() if files.get(rel) != want["size"]]
        if missing:
            incomplete.append(f"{remote.url}/{name}: {len(missing)} listed file(s) missing or of "
                              f"another size, e.g. {missing[0]}")
            continue
        complete.append((name, m))
    complete.sort(key=lambda t: (t[1].batch, t[1].epoch, t[0]), reverse=True)
    return complete, sorted(incomplete), sorted(unfinished)


def delete_checkpoint(s3: Any, remote: RemoteFolder, name: str) -> None:
    """Delete ``name``'s objects, the manifest first: a delete cut short leaves an unfinished
    upload (no manifest), never a checkpoint that looks complete."""
    s3.delete_object(Bucket=remote.bucket, Key=remote.key(f"{name}/{MANIFEST}"))
    keys = [remote.key(f"{name}/{rel}") for rel in list_objects(s3, RemoteFolder(remote.bucket, remote.key(name)))]
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=remote.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                        "Quiet": True})


def tidy(s3: Any, remote: RemoteFolder, unfinished: list[str]) -> None:
    """Delete uploads that never got a manifest (a run killed mid-upload); call only while no
    run is uploading to ``remote`` (see docs/storage.md on the lock)."""
    for name in unfinished:
        delete_checkpoint(s3, remote, name)
    if unfinished:
        log.info("removed %d unfinished upload(s) from %s: %s", len(unfinished), remote.url,
                 ", ".join(unfinished))


# -- downloading ------------------------------------------------------------------------------
def download(s3: Any, remote: RemoteFolder, name: str, manifest: Manifest, into: Path) -> Path:
    """Download checkpoint ``name`` to ``into/name`` (temp folder, every sha256 checked, then
    renamed into place); an existing verified copy there is reused. CheckpointError naming the
    object when a file differs from the manifest."""
    final = into / name
    if (final / MANIFEST).is_file() and not file_problems(final, manifest.files, sorted(manifest.files)):
        log.info("using the local copy %s of %s/%s", final, remote.url, name)
        return final
    tmp = into / f"{TMP_PREFIX}download-{name}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    total = sum(int(f["size"]) for f in manifest.files.values())
    log.info("downloading %s/%s (%d files, %.1f MB) to %s", remote.url, name,
             len(manifest.files) + 1, total / 2**20, final)
    for rel in sorted(manifest.files) + [MANIFEST]:
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(remote.bucket, remote.key(f"{name}/{rel}"), str(dest))
    problems = file_problems(tmp, manifest.files, sorted(manifest.files))
    if problems:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("\n".join(
            [f"{remote.url}/{name}: the downloaded files differ from its manifest:"]
            + [f"  - {p.replace(str(tmp), f'{remote.url}/{name}')}" for p in problems]))
    if final.exists():
        shutil.rmtree(final)
    try:
        os.replace(tmp, final)
    except OSError:  # another node sharing this cache put a verified copy there first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fetch(url: str, into: Path | None = None) -> Path:
    """A local, verified copy of the checkpoint at ``url`` (a checkpoint's folder, its
    ``manifest.json``, or a save_folder: its newest complete checkpoint), for one process
    (``foundryx export``, ``foundryx eval``, ``load_path``)."""
    s3 = client()
    require_access(url, write=False)
    url = url.rstrip("/")
    if url.endswith("/" + MANIFEST):
        url = url[: -len(MANIFEST) - 1]
    r = RemoteFolder.parse(url)
    parent = RemoteFolder(r.bucket, r.prefix.rpartition("/")[0])
    name = r.prefix.rpartition("/")[2]
    objects = list_objects(s3, r)
    if MANIFEST in objects:  # a checkpoint folder
        complete, incomplete, _ = checkpoints(s3, parent)
        found = [(n, m) for n, m in complete if n == name]
        if not found:
            bad = [p for p in incomplete if p.startswith(f"{parent.url}/{name}:")]
            raise CheckpointError(bad[0] if bad else f"{url}: not a complete checkpoint")
        remote, (name, manifest) = parent, found[0]
    else:  # a save_folder
        complete, incomplete, unfinished = checkpoints(s3, r)
        if not complete:
            raise CheckpointError(
                f"{url}: no complete checkpoint there (no folder with every file its {MANIFEST} "
                f"lists){'; ' + incomplete[0] if incomplete else ''}; give a checkpoint folder "
                "or a save_folder that has one")
        remote, (name, manifest) = r, complete[0]
    into = into or cache_folder(remote.url, "downloads")
    into.mkdir(parents=True, exist_ok=True)
    return download(s3, remote, name, manifest, into)
