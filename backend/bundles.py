"""Code bundles: a user's own training code, uploaded as a zip or tar.gz archive and stored
content-addressed (``state_dir/bundles/<sha256>.<ext>``, with a ``.json`` of its metadata beside
it). No database row: the id *is* the content, so storing twice is free and a bundle cannot change
under a run. Workers fetch a bundle through the api with a capability the scheduler signs (HMAC of
the bundle id and an expiry with the server's secret key), so a GPU node needs no token.

The rules an archive must meet (checked here at upload, again by the worker at extraction) live in
``torchyard/archive.py``."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from backend.errors import InvalidRequest
from torchyard import archive
from torchyard.settings import Settings, secret_key
from torchyard.spec import ScriptConfig

CAPABILITY_TTL_S = 7 * 86400  # a share may wait long for its node; the run dir keeps the copy


@dataclass
class BundleInfo:
    id: str
    size: int
    format: str  # zip | tar.gz
    files: list[str]

    @property
    def filename(self) -> str:
        return f"{self.id}.{self.format}"


def bundles_dir(settings: Settings) -> Path:
    path = settings.state_dir / "bundles"
    path.mkdir(parents=True, exist_ok=True)
    return path


def store(settings: Settings, upload: IO[bytes]) -> BundleInfo:
    """Copies ``upload`` into the store (hashing as it goes), checks it is a safe archive, and
    returns its metadata. Raises :class:`BadBundle`."""
    root = bundles_dir(settings)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=root, prefix=".upload-", delete=False) as tmp:
        tmp_path = Path(tmp.name)
        size = 0
        while chunk := upload.read(archive.CHUNK):
            size += len(chunk)
            if size > settings.max_bundle_bytes:
                tmp.close()
                tmp_path.unlink(missing_ok=True)
                raise TooLarge(settings.max_bundle_bytes)
            digest.update(chunk)
            tmp.write(chunk)
    try:
        fmt, files = archive.members(tmp_path, settings.max_bundle_bytes * archive.UNPACKED_FACTOR)
        info = BundleInfo(digest.hexdigest(), size, fmt, files)
        (root / f"{info.id}.json").write_text(json.dumps(asdict(info)))
        os.replace(tmp_path, root / info.filename)
    finally:
        tmp_path.unlink(missing_ok=True)
    return info


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the bundle is larger than {limit} bytes ({limit / 2**20:.0f} MiB), the most an upload may be "
            "(TORCHYARD_MAX_BUNDLE_BYTES): leave data sets and checkpoints out of it"
        )


def get(settings: Settings, bundle_id: str) -> BundleInfo | None:
    if len(bundle_id) != 64 or any(c not in "0123456789abcdef" for c in bundle_id):
        return None
    try:
        data = json.loads((bundles_dir(settings) / f"{bundle_id}.json").read_text())
    except (OSError, ValueError):
        return None
    info = BundleInfo(**data)
    return info if (bundles_dir(settings) / info.filename).exists() else None


def check_script_workload(settings: Settings, workload: ScriptConfig) -> None:
    """A script workload must name a bundle this api holds and a file in it (else a 422 naming the field)."""
    info = get(settings, workload.bundle)
    if info is None:
        raise InvalidRequest(
            ["body", "workload", "bundle"],
            f"workload.bundle ({workload.bundle}) is not an uploaded bundle: upload it with POST /api/v1/bundles",
            workload.bundle,
        )
    if workload.entry not in info.files:
        shown = ", ".join(f for f in info.files if f.endswith(".py"))[:500] or "no .py files"
        raise InvalidRequest(
            ["body", "workload", "entry"],
            f"workload.entry ({workload.entry!r}) is not a file in bundle {workload.bundle[:12]}: it has {shown}",
            workload.entry,
        )


# ---- capabilities ---------------------------------------------------------------------------


def capability(settings: Settings, bundle_id: str, ttl_s: float = CAPABILITY_TTL_S) -> str:
    """``<expiry>.<hmac>``: lets its holder download this one bundle until the expiry."""
    expires = int(time.time() + ttl_s)
    return f"{expires}.{_mac(settings, bundle_id, expires)}"


def capability_allows(settings: Settings, bundle_id: str, cap: str) -> bool:
    expires, _, mac = cap.partition(".")
    if not expires.isdigit() or int(expires) < time.time():
        return False
    return hmac.compare_digest(mac, _mac(settings, bundle_id, int(expires)))


def _mac(settings: Settings, bundle_id: str, expires: int) -> str:
    return hmac.new(secret_key(settings), f"bundle:{bundle_id}:{expires}".encode(), hashlib.sha256).hexdigest()
