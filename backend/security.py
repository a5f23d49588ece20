"""Bearer tokens and browser sessions: random, shown once, stored as SHA-256 (a 256-bit random
secret needs no slow hash: there is nothing to brute-force)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from backend.errors import Conflict, NotFound
from backend.models import BrowserSession, Token, utcnow

ROLES = ("viewer", "member", "admin")
TOKEN_PREFIX = "ty_"
SESSION_TTL = timedelta(days=7)
MAX_SESSIONS_PER_TOKEN = 50  # live logins of one token; the oldest ends beyond this


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


def start_session(session: Session, token: Token) -> str:
    """A new browser session for ``token``; returns its id (for the cookie; only its hash is
    stored). Rows of expired and ended sessions are deleted here, so the table stays bounded by
    live sessions, and those by MAX_SESSIONS_PER_TOKEN per token."""
    now = utcnow()
    session.execute(
        delete(BrowserSession).where(or_(BrowserSession.expires_at <= now, BrowserSession.ended_at.is_not(None)))
    )
    oldest = session.scalars(
        select(BrowserSession.id_hash)
        .where(BrowserSession.token_id == token.id)
        .order_by(BrowserSession.created_at.desc())
        .offset(MAX_SESSIONS_PER_TOKEN - 1)
    ).all()
    if oldest:  # room for the new one
        session.execute(delete(BrowserSession).where(BrowserSession.id_hash.in_(oldest)))
    value = secrets.token_urlsafe(32)
    session.add(
        BrowserSession(id_hash=hash_token(value), token_id=token.id, created_at=now, expires_at=now + SESSION_TTL)
    )
    session.flush()
    return value


def find_session(session: Session, value: str) -> BrowserSession | None:
    """The live session with this id: not ended, not expired, its token not revoked."""
    return live_session(session, hash_token(value))


def live_session(session: Session, id_hash: str) -> BrowserSession | None:
    row = session.get(BrowserSession, id_hash)
    if row is None or row.ended_at is not None or row.expires_at <= utcnow() or row.token.revoked_at is not None:
        return None
    return row


def end_sessions(session: Session, token_id: int) -> None:
    """Ends every session of a token (it was revoked)."""
    session.execute(
        update(BrowserSession)
        .where(BrowserSession.token_id == token_id, BrowserSession.ended_at.is_(None))
        .values(ended_at=utcnow())
    )


def list_tokens(session: Session) -> list[Token]:
    return list(session.scalars(select(Token).order_by(Token.id)))


def revoke_token(session: Session, token_id: int, by: Token) -> Token:
    """Revokes the token and ends its browser sessions (their live streams close within ~2 s).
    Raises NotFound, or Conflict when it is already revoked or it is the caller's own."""
    token = session.get(Token, token_id)
    if token is None:
        raise NotFound(f"token {token_id} not found")
    if token.revoked_at is not None:
        raise Conflict(f"token {token_id} was already revoked at {token.revoked_at}")
    if token.id == by.id:
        raise Conflict("you cannot revoke the token you are using")
    token.revoked_at = utcnow()
    end_sessions(session, token.id)
    return token
