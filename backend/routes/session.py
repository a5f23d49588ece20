"""/api/v1/session and /api/v1/me: the browser's login. A token (from the link `torchyard up`
prints, or pasted) is exchanged for an HttpOnly, SameSite=Strict cookie that `current_token`
accepts like a bearer header, so the page's scripts never hold the secret."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from pydantic import BaseModel, Field

from backend.deps import SESSION_COOKIE, SessionDep, current_token
from backend.models import Token
from backend.security import find_token

router = APIRouter(prefix="/api/v1", tags=["session"])

COOKIE_MAX_AGE_S = 30 * 86400


class SessionIn(BaseModel):
    token: str = Field(..., min_length=1, max_length=500)


class MeOut(BaseModel):
    name: str
    role: str


@router.post("/session", response_model=MeOut)
def create_session(body: SessionIn, request: Request, response: Response, session: SessionDep) -> MeOut:
    token = find_token(session, body.token.strip())
    if token is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this token is unknown or revoked")
    response.set_cookie(
        SESSION_COOKIE,
        body.token.strip(),
        max_age=COOKIE_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return MeOut(name=token.name, role=token.role)


@router.delete("/session", status_code=status.HTTP_204_NO_CONTENT)
def delete_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")


@router.get("/me", response_model=MeOut)
def me(token: Annotated[Token, Depends(current_token)]) -> MeOut:
    return MeOut(name=token.name, role=token.role)
