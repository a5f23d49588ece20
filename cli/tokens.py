"""``torchyard token``: bearer tokens (admin)."""

from __future__ import annotations

import click

from cli.client import Api, with_api


@click.group()
def token() -> None:
    """Manage bearer tokens (admin)."""


@token.command("create")
@click.option("--name", required=True, help="who or what the token is for")
@click.option("--role", type=click.Choice(["viewer", "member", "admin"]), default="member", show_default=True)
@with_api
def token_create(name: str, role: str, api_url: str | None, token: str | None) -> None:
    """Create a token; its secret is printed once."""
    created = Api(api_url, token).call("POST", "/api/v1/tokens", json={"name": name, "role": role})
    click.echo(f"token {created['id']} ({created['role']}) for {created['name']}: {created['token']}")


@token.command("list")
@with_api
def token_list(api_url: str | None, token: str | None) -> None:
    """List tokens (never their secrets)."""
    for t in Api(api_url, token).call("GET", "/api/v1/tokens"):
        state = f"revoked {t['revoked_at']}" if t["revoked_at"] else "active"
        click.echo(f"{t['id']:>4}  {t['role']:<7} {state:<10} {t['name']}")


@token.command("revoke")
@click.argument("which")
@with_api
def token_revoke(which: str, api_url: str | None, token: str | None) -> None:
    """Revoke a token, by id or by the name it was created with: it stops working at once."""
    api = Api(api_url, token)
    if which.isdigit():
        token_id = int(which)
    else:
        named = [t for t in api.call("GET", "/api/v1/tokens") if t["name"] == which and not t["revoked_at"]]
        if len(named) != 1:
            found = f"{len(named)} active tokens are named {which!r}" + (
                f" (ids {', '.join(str(t['id']) for t in named)}): give the id" if named else ""
            )
            raise click.ClickException(found)
        token_id = named[0]["id"]
    api.call("DELETE", f"/api/v1/tokens/{token_id}")
    click.echo(f"token {token_id} revoked")
