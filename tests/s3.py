"""A real S3 API on localhost for object-storage tests: moto's server in a thread of the test
process. Child processes (gloo ranks, CLI subprocesses) reach it over HTTP like any S3-compatible
store, through the standard variables: `S3_ENDPOINT_URL` and the AWS credential variables.

Use the `s3` fixture (tests/conftest.py): it yields an `S3Server` whose `bucket()` makes a fresh
bucket per call, and sets the environment for this process and every process it starts.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

# The variables every S3 client (boto3, mosaicml-streaming, Composer) reads. Fake credentials:
# moto accepts any, and a test must never find real ones in the user's ~/.aws.
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "foundryx-test",
    "AWS_SECRET_ACCESS_KEY": "foundryx-test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


_BUCKETS = itertools.count()  # one count per session: every test's buckets are new


@dataclass
class S3Server:
    endpoint_url: str

    @property
    def env(self) -> dict[str, str]:
        """The environment a process needs to reach this server (give it to subprocesses)."""
        return {**S3_TEST_ENV, "S3_ENDPOINT_URL": self.endpoint_url}

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_TEST_ENV["AWS_DEFAULT_REGION"],
        )

    def bucket(self, prefix: str = "test") -> str:
        """Create a new, empty bucket and return its name."""
        name = f"{prefix}-{os.getpid()}-{next(_BUCKETS)}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under prefix, sorted."""
        paginator = self.client().get_paginator("list_objects_v2")
        return sorted(
            obj["Key"]
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix)
            for obj in page.get("Contents", [])
        )


def start_server():
    """Start moto's S3 server on a free port of 127.0.0.1; returns (server, endpoint_url)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"
