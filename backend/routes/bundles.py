"""/api/v1/bundles: upload a user's code (zip or tar.gz), read its metadata, and download it
(workers: with the capability the scheduler put in their task; people: with a token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Header, HTTPException, Path, Query, Request, UploadFile, status
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from backend import bundles
from backend.deps import REQUIRED_ROLE, Member, SessionDep, Viewer, current_caller
from backend.errors import InvalidRequest, NotFound
from backend.schemas import BundleOut
from torchyard import archive
from torchyard.settings import get_settings
from torchyard.spec import BUNDLE_ID

router = APIRouter(prefix="/api/v1/bundles", tags=["bundles"])
BundleId = Annotated[str, Path(pattern=BUNDLE_ID, description="the bundle's sha256")]
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers around the file
# Bodies up to twice the limit are read, so the 413 can say why; beyond that Starlette's own 413
# stops the upload early (from its Content-Length) or mid-stream.
UPLOAD_BODY_LIMIT = 2 * get_settings().max_bundle_bytes + MULTIPART_OVERHEAD


def _out(info: bundles.BundleInfo) -> BundleOut:
    return BundleOut(id=info.id, size=info.size, format=info.format, files=info.files)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, str(bundles.TooLarge(limit)))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=BundleOut,
    max_body_size=UPLOAD_BODY_LIMIT,
)
async def upload_bundle(
    file: Annotated[UploadFile, File(description="a zip or tar.gz archive of the code")],
    _member: Member,
) -> BundleOut:
    """Stores the archive under its sha256 (the same bytes twice are one bundle) after checking it
    is a zip or tar.gz whose members are plain files and folders under relative paths."""
    settings = get_settings()
    if file.size is not None and file.size > settings.max_bundle_bytes:
        raise _too_large(settings.max_bundle_bytes)
    try:
        info = await run_in_threadpool(bundles.store, settings, file.file)
    except bundles.TooLarge:
        raise _too_large(settings.max_bundle_bytes) from None
    except archive.BadBundle as exc:
        raise InvalidRequest(["body", "file"], f"{file.filename or 'the upload'}: {exc}", file.filename) from None
    return _out(info)


def _bundle_or_404(bundle_id: str) -> bundles.BundleInfo:
    info = bundles.get(get_settings(), bundle_id)
    if info is None:
        raise NotFound(f"bundle {bundle_id} not found")
    return info


@router.get("/{bundle_id}", response_model=BundleOut)
def get_bundle(bundle_id: BundleId, _viewer: Viewer) -> BundleOut:
    return _out(_bundle_or_404(bundle_id))


def _token_or_capability(
    bundle_id: BundleId,
    request: Request,
    session: SessionDep,
    cap: Annotated[str | None, Query(description="a capability the scheduler signed (workers)")] = None,
    cap_header: Annotated[str | None, Header(alias="X-Bundle-Capability", description="the same, as a header")] = None,
) -> None:
    cap = cap_header or cap
    if cap is None:
        current_caller(request, session)  # 401 without a valid token
    elif not bundles.capability_allows(get_settings(), bundle_id, cap):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the capability is invalid or expired for this bundle")


REQUIRED_ROLE[_token_or_capability] = "viewer"


@router.get("/{bundle_id}/download", response_class=FileResponse, dependencies=[Depends(_token_or_capability)])
def download_bundle(bundle_id: BundleId) -> FileResponse:
    """The archive itself, for a bearer token (any role) or a valid capability for this bundle."""
    info = _bundle_or_404(bundle_id)
    return FileResponse(
        bundles.bundles_dir(get_settings()) / info.filename,
        media_type="application/octet-stream",
        filename=info.filename,
    )
