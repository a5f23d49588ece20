"""/api/v1/tokens: admins create, list and revoke bearer tokens. A secret is shown once, at
creation; a revoked token stops working on its next request, and so do its browser sessions."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, status
from pydantic import BaseModel, ConfigDict, Field

from backend import security
from backend.deps import DB_INT_MAX, Admin, SessionDep
from backend.models import Token
from backend.security import create_token

router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"])


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=200)
    role: Literal["viewer", "member", "admin"] = "member"


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    name: str
    role: str
    created_at: datetime
    revoked_at: datetime | None


class NewToken(TokenOut):
    token: str = Field(description="the secret: shown this once, stored only as a hash")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=NewToken)
def create(body: TokenIn, session: SessionDep, _admin: Admin) -> NewToken:
    token, secret = create_token(session, body.name, body.role)
    session.commit()
    return NewToken(**TokenOut.model_validate(token).model_dump(), token=secret)


@router.get("", response_model=list[TokenOut])
def list_tokens(session: SessionDep, _admin: Admin) -> list[Token]:
    return security.list_tokens(session)


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke(token_id: Annotated[int, Path(ge=1, le=DB_INT_MAX)], session: SessionDep, admin: Admin) -> None:
    security.revoke_token(session, token_id, by=admin)
    session.commit()
