"""Code bundles: a user's own training code, uploaded as a zip or tar.gz archive and stored
content-addressed (``state_dir/bundles/<sha256>.<ext>``, with a ``.json`` of its metadata beside
it). No database row: the id *is* the content, so storing twice is free and a bundle cannot change
under a run. Workers fetch a bundle through the api with a capability the scheduler signs (HMAC of
the bundle id and an expiry with the server's secret key), so a GPU node needs no token.

Also the one home for reading archives safely: the api checks an upload and the worker extracts
it with the same rules (regular files and folders only, relative paths without ``..``, bounded
member count and unpacked size)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from torchyard.settings import Settings, secret_key
from torchyard.spec import ScriptWorkload

MAX_MEMBERS = 10_000
UNPACKED_FACTOR = 20  # an archive may unpack to at most this many times the upload limit
CAPABILITY_TTL_S = 7 * 86400  # a placement may wait long for its node; the run dir keeps the copy
CHUNK = 1 << 20


class BadBundle(ValueError):
    """Not a zip/tar.gz archive, or one with members a worker must not extract."""


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


def _members(path: Path, max_unpacked: int) -> tuple[str, list[str]]:
    """(format, the regular files' relative paths), or BadBundle saying what is wrong."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            entries = [(i.filename, i.is_dir(), _zip_is_link(i), i.file_size) for i in zf.infolist()]
        fmt = "zip"
    else:
        try:
            with tarfile.open(path, mode="r:gz") as tf:
                infos = tf.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BadBundle(f"not a zip or tar.gz archive ({exc})") from None
        for info in infos:
            if not (info.isfile() or info.isdir()):
                raise BadBundle(f"member {info.name!r} is a link or special file: only files and folders are allowed")
        entries = [(i.name, i.isdir(), False, i.size) for i in infos]
        fmt = "tar.gz"
    if len(entries) > MAX_MEMBERS:
        raise BadBundle(f"the archive has {len(entries)} members, more than {MAX_MEMBERS}")
    files, total = [], 0
    for name, is_dir, is_link, size in entries:
        check_member_name(name)
        if is_link:
            raise BadBundle(f"member {name!r} is a symbolic link: only files and folders are allowed")
        total += size
        if not is_dir:
            files.append(str(PurePosixPath(name)))
    if total > max_unpacked:
        raise BadBundle(f"the archive unpacks to {total} bytes, more than {max_unpacked}")
    if not files:
        raise BadBundle("the archive holds no files")
    return fmt, sorted(files)


def check_member_name(name: str) -> None:
    path = PurePosixPath(name.replace("\\", "/"))
    if name.startswith(("/", "\\")) or path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise BadBundle(f"member {name!r} has an absolute path")
    if ".." in path.parts:
        raise BadBundle(f"member {name!r} climbs out of the bundle with '..'")


def _zip_is_link(info: zipfile.ZipInfo) -> bool:
    return (info.external_attr >> 16) & 0o170000 == 0o120000


def store(settings: Settings, upload: IO[bytes]) -> BundleInfo:
    """Copies ``upload`` into the store (hashing as it goes), checks it is a safe archive, and
    returns its metadata. Raises :class:`BadBundle`."""
    root = bundles_dir(settings)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=root, prefix=".upload-", delete=False) as tmp:
        tmp_path = Path(tmp.name)
        size = 0
        while chunk := upload.read(CHUNK):
            size += len(chunk)
            if size > settings.max_bundle_bytes:
                tmp.close()
                tmp_path.unlink(missing_ok=True)
                raise TooLarge(settings.max_bundle_bytes)
            digest.update(chunk)
            tmp.write(chunk)
    try:
        fmt, files = _members(tmp_path, settings.max_bundle_bytes * UNPACKED_FACTOR)
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


def check_script_or_422(settings: Settings, workload: ScriptWorkload) -> None:
    """A script workload must name a bundle this api holds and a file in it (else a 422 naming the field)."""
    from backend.runs import InvalidRequest

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


# ---- the worker's side ----------------------------------------------------------------------


def verify(path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise BadBundle(f"downloaded bundle has sha256 {digest.hexdigest()}, not {sha256}")


def extract(archive: Path, dest: Path, max_unpacked: int) -> list[str]:
    """Unpacks a checked archive into ``dest`` (regular files and folders only); returns its files."""
    fmt, files = _members(archive, max_unpacked)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if fmt == "zip":
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
    else:
        with tarfile.open(archive, mode="r:gz") as tf:
            tf.extractall(tmp, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return files
