"""The rules a code bundle's archive must meet, in one place: the api checks an upload with them
and the worker checks again while it extracts (regular files and folders only, relative paths
without ``..``, a bounded member count and unpacked size)."""

from __future__ import annotations

import hashlib
import shutil
import struct
import tarfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

MAX_MEMBERS = 10_000
UNPACKED_FACTOR = 20  # an archive may unpack to at most this many times the upload limit
CHUNK = 1 << 20
EOCD_SEARCH = 22 + 65_535  # the end record and the longest comment a zip may carry after it


class BadBundle(ValueError):
    """Not a zip/tar.gz archive, or one with members a worker must not extract."""


def members(path: Path, max_unpacked: int) -> tuple[str, list[str]]:
    """(format, the regular files' relative paths), or BadBundle saying what is wrong. The member
    count and the unpacked size are checked while the archive is read, so a hostile one (300,000
    empty members in 2 MB) is refused after MAX_MEMBERS + 1 of them, not after all."""
    if zipfile.is_zipfile(path):
        declared = _zip_entry_count(path)  # before ZipFile parses (and holds) every entry
        if declared > MAX_MEMBERS:
            raise BadBundle(f"the archive has more than {MAX_MEMBERS} members")  # 65535: zip64, maybe far more
        with zipfile.ZipFile(path) as zf:
            entries = ((i.filename, i.is_dir(), _zip_is_link(i), i.file_size) for i in zf.infolist())
            return "zip", _checked(entries, max_unpacked)
    try:
        with tarfile.open(path, mode="r:gz") as tf:
            return "tar.gz", _checked(_tar_entries(tf), max_unpacked)  # iterating reads one header at a time
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BadBundle(f"not a zip or tar.gz archive ({exc})") from None


def _tar_entries(tf: tarfile.TarFile) -> Iterator[tuple[str, bool, bool, int]]:
    for info in tf:
        if not (info.isfile() or info.isdir()):
            raise BadBundle(f"member {info.name!r} is a link or special file: only files and folders are allowed")
        yield info.name, info.isdir(), False, info.size


def _checked(entries: Iterable[tuple[str, bool, bool, int]], max_unpacked: int) -> list[str]:
    """The files among ``entries`` (name, is_dir, is_link, size), stopping at the first bound broken."""
    files, total = [], 0
    for count, (name, is_dir, is_link, size) in enumerate(entries, 1):
        if count > MAX_MEMBERS:
            raise BadBundle(f"the archive has more than {MAX_MEMBERS} members")
        check_member_name(name)
        if is_link:
            raise BadBundle(f"member {name!r} is a symbolic link: only files and folders are allowed")
        total += size
        if total > max_unpacked:
            raise BadBundle(f"the archive unpacks to more than {max_unpacked} bytes")
        if not is_dir:
            files.append(str(PurePosixPath(name)))
    if not files:
        raise BadBundle("the archive holds no files")
    return sorted(files)


def _zip_entry_count(path: Path) -> int:
    """The entry count a zip's end-of-central-directory record declares (65535 and up: zip64)."""
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - EOCD_SEARCH))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise BadBundle("not a zip or tar.gz archive (no zip end-of-central-directory record)")
    return int(struct.unpack_from("<H", tail, at + 10)[0])  # total entries in the central directory


def check_member_name(name: str) -> None:
    """BadBundle when an archive member's name could land outside where it is unpacked or read:
    absolute (POSIX, Windows drive or backslash) or climbing with ``..``. Bundles and dataset shards alike."""
    path = PurePosixPath(name.replace("\\", "/"))
    if name.startswith(("/", "\\")) or path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise BadBundle(f"member {name!r} has an absolute path")
    if ".." in path.parts:
        raise BadBundle(f"member {name!r} climbs out of the archive with '..'")


def _zip_is_link(info: zipfile.ZipInfo) -> bool:
    return (info.external_attr >> 16) & 0o170000 == 0o120000


def verify(path: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise BadBundle(f"downloaded bundle has sha256 {digest.hexdigest()}, not {sha256}")


def extract(archive: Path, dest: Path, max_unpacked: int) -> list[str]:
    """Unpacks a checked archive into ``dest`` (regular files and folders only); returns its files."""
    fmt, files = members(archive, max_unpacked)
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
