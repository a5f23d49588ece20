"""A local S3-compatible object store for tests: moto's server (``moto_server``, an HTTP server of
its own, not an in-process mock), on a free port, with one bucket. MinIO installs from neither pip
nor Debian here; moto[server] does (pyproject's dev extra). Note: moto does not check signatures,
so a test here cannot show that a presigned GET URL refuses a PUT (AWS S3 and MinIO do)."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import httpx

from cli.wait import wait_for
from torchyard import datasets as fmt
from torchyard import stores
from torchyard.net import free_port
from torchyard.settings import Settings

ACCESS_KEY, SECRET_KEY = "torchyard-test", "torchyard-test-secret"


class MotoServer:
    def __init__(self, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> MotoServer:
        """Started and answering; RuntimeError saying why not (moto missing, or it died)."""
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"moto_server exited {self.proc.returncode}: {self.log.read_text()[-500:]}")
            return httpx.get(self.url + "/moto-api/", timeout=2).status_code == 200

        try:
            wait_for(answers, timeout, f"moto_server on port {self.port}", interval=0.1)
        except (AssertionError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(str(exc)) from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def bucket(self) -> tuple[str, Any]:
        """A new bucket's name, and a boto3 client of the store (a test's own hands on the objects)."""
        client = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )
        name = f"torchyard-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        return name, client

    def store(self, state_dir: Path) -> tuple[stores.S3Store, Any]:
        """A dataset store in a new bucket, as the platform opens it, and a client of its objects."""
        bucket, client = self.bucket()
        store = stores.open_store(Settings(state_dir=state_dir, **self.settings(bucket)))  # type: ignore[arg-type]
        assert isinstance(store, stores.S3Store)
        return store, client

    def settings(self, bucket: str, prefix: str = "datasets") -> dict[str, str]:
        """The platform's settings for a dataset store in ``bucket``."""
        return {
            "dataset_store": f"s3://{bucket}/{prefix}",
            "dataset_s3_endpoint_url": self.url,
            "dataset_s3_access_key_id": ACCESS_KEY,
            "dataset_s3_secret_access_key": SECRET_KEY,
        }


def publish(store: stores.S3Store, folder: Path, name: str) -> None:
    """A dataset folder (``torchyard.datasets.write_dataset``'s) put into ``store`` as the api puts
    one: shards and indexes, then the manifest."""
    for path in sorted(folder.iterdir()):
        if path.name != fmt.MANIFEST:
            store.put(name, path.name, path)
    store.write(name, fmt.MANIFEST, (folder / fmt.MANIFEST).read_text())
