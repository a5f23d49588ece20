"""Bearer tokens: random, shown once, stored as SHA-256 (a 256-bit random secret needs no slow
hash: there is nothing to brute-force)."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.models import Token

ROLES = ("viewer", "member", "admin")
TOKEN_PREFIX = "ty_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def create_token(session: Session, name: str, role: str, value: str | None = None) -> tuple[Token, str]:
    """Creates a token (or installs ``value``); returns the row and the secret to show once."""
    if role not in ROLES:
        raise ValueError(f"role ({role!r}) must be one of {', '.join(ROLES)}")
    value = value or new_token_value()
    existing = session.scalar(select(Token).where(Token.token_hash == hash_token(value)))
    if existing is not None:
        return existing, value
    token = Token(name=name, role=role, token_hash=hash_token(value))
    session.add(token)
    session.flush()
    return token, value


def find_token(session: Session, value: str) -> Token | None:
    token = session.scalar(select(Token).where(Token.token_hash == hash_token(value)))
    if token is None or token.revoked_at is not None:
        return None
    return token


def role_allows(role: str, needed: str) -> bool:
    return ROLES.index(role) >= ROLES.index(needed)


def ensure_admin_token(session: Session, preferred: str | None) -> str | None:
    """Installs ``preferred`` (e.g. TORCHYARD_ADMIN_TOKEN) as an admin token; without one, makes
    a new admin token only if none exists yet. Returns the secret when there is one to show."""
    if preferred:
        return create_token(session, "admin", "admin", preferred)[1]
    if session.scalar(select(Token).where(Token.role == "admin", Token.revoked_at.is_(None))) is None:
        return create_token(session, "admin", "admin")[1]
    return None
