"""/api/v1/session and /api/v1/me: the browser's login. A token (from the link `torchyard up`
prints, or pasted) is exchanged for an opaque session id in an HttpOnly, SameSite=Strict cookie
that `current_caller` accepts like a bearer header. The page's scripts never hold the secret and
the cookie never holds the token: logout, expiry or revoking the token ends the session."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from pydantic import BaseModel, Field

from backend.deps import SESSION_COOKIE, CallerDep, SessionDep, current_token, same_origin
from backend.models import BrowserSession, Token, utcnow
from backend.security import SESSION_TTL, find_token, start_session

router = APIRouter(prefix="/api/v1", tags=["session"])


class SessionIn(BaseModel):
    token: str = Field(..., min_length=1, max_length=500)


class MeOut(BaseModel):
    name: str
    role: str


@router.post("/session", response_model=MeOut)
def create_session(body: SessionIn, request: Request, response: Response, session: SessionDep) -> MeOut:
    # A browser says where the page came from: another site must not log us in as someone else.
    if ("origin" in request.headers or "sec-fetch-site" in request.headers) and not same_origin(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin login refused: sign in from this site's own page")
    token = find_token(session, body.token.strip())
    if token is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this token is unknown or revoked")
    session_id = start_session(session, token)
    session.commit()
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=int(SESSION_TTL.total_seconds()),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return MeOut(name=token.name, role=token.role)


@router.delete("/session", status_code=status.HTTP_204_NO_CONTENT)
def delete_session(caller: CallerDep, response: Response, session: SessionDep) -> None:
    """Ends the browser session the cookie names (server-side: the cookie stops working even if
    kept); with a bearer header there is none to end."""
    if caller.session_hash is not None:
        row = session.get(BrowserSession, caller.session_hash)
        if row is not None:
            row.ended_at = utcnow()
            session.commit()
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")


@router.get("/me", response_model=MeOut)
def me(token: Annotated[Token, Depends(current_token)]) -> MeOut:
    return MeOut(name=token.name, role=token.role)
