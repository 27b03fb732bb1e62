"""The admin HTTP API's credential: one bearer token, kept in an owner-only file (`kvsched
up` writes a fresh one per run), asked of every request but the open paths (metrics,
health, leader) and compared in constant time."""

from __future__ import annotations

import argparse
import hmac
import secrets
from collections.abc import Collection
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from services.common.security.files import write_private
from services.common.serving.api_errors import ApiError


def new_admin_token(path: Path) -> str:
    """Write a fresh random token to `path` (owner-only) and return it."""
    token = secrets.token_urlsafe(32)
    write_private(path, token + "\n")
    return token


def read_admin_token(parser: argparse.ArgumentParser, path: str) -> str:
    """The token in `path` (surrounding whitespace stripped); a usage error (exit 2) when the
    file cannot be read or holds none."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"cannot read the admin token file {path}: {exc}")
    if not token:
        parser.error(f"the admin token file {path} is empty")
    return token


def bearer_required(token: str, open_paths: Collection[str]) -> Middleware:
    """aiohttp middleware: a request for any path but `open_paths` needs `Authorization:
    Bearer <token>`; otherwise 401 with OpenAI-shaped JSON and `WWW-Authenticate`."""
    expected = token.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths or _presented(request, expected):
            return await handler(request)
        error = ApiError(
            401,
            "This admin API needs the admin token: send `Authorization: Bearer TOKEN` "
            "(`kvsched up` writes it to admin-token in its run directory).",
            type_="authentication_error",
            code="invalid_admin_token",
        )
        return error.response({"WWW-Authenticate": 'Bearer realm="kvsched-admin"'})

    return middleware


def _presented(request: web.Request, expected: bytes) -> bool:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    # Bytes, so a non-ASCII header compares (unequal) instead of raising.
    given = value.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, expected)
