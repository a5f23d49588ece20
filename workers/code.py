"""A script workload's code on the worker: fetched from the api (with the capability the
scheduler signed, so the node needs no token), checked against its sha256, cached per node, and
unpacked into the attempt's run directory with the same rules the api checked the upload with."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from torchyard import archive
from torchyard.settings import Settings

INJECT_DIR = Path(__file__).resolve().parent / "inject"  # its sitecustomize instruments unmodified scripts
FETCH_TIMEOUT_S = 120.0


def cache_dir(settings: Settings) -> Path:
    path = settings.state_dir / "workers" / settings.node_id / "bundles"
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch(settings: Settings, bundle_id: str, capability: str | None) -> Path:
    """The bundle's archive on this node (downloaded once per node, verified every time)."""
    cached = cache_dir(settings) / f"{bundle_id}.bundle"
    if cached.exists():
        try:
            archive.verify(cached, bundle_id)
            return cached
        except archive.BadBundle:
            cached.unlink(missing_ok=True)
    url = f"{settings.api_url.rstrip('/')}/api/v1/bundles/{bundle_id}/download"
    # a header, not the query: request URLs end up in logs
    headers = {"X-Bundle-Capability": capability} if capability else {"Authorization": f"Bearer {settings.token}"}
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    try:
        with httpx.stream("GET", url, headers=headers, timeout=FETCH_TIMEOUT_S) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(
                    f"could not fetch bundle {bundle_id} from {url}: {response.status_code} {response.text[:300]}"
                )
            with partial.open("wb") as f:
                for chunk in response.iter_bytes(1 << 20):
                    f.write(chunk)
        archive.verify(partial, bundle_id)
        os.replace(partial, cached)
    finally:
        partial.unlink(missing_ok=True)
    return cached


def prepare(settings: Settings, workload: dict, capability: str | None, run_dir: Path) -> Path:
    """Fetches and unpacks the bundle into ``run_dir/code``; returns that folder (the ranks' cwd)."""
    bundle = fetch(settings, workload["bundle"], capability)
    code = run_dir / "code"
    files = archive.extract(bundle, code, settings.max_bundle_bytes * archive.UNPACKED_FACTOR)
    if workload["entry"] not in files:
        raise RuntimeError(f"bundle {workload['bundle']} has no {workload['entry']!r}")
    return code
