"""The admin HTTP token: written private, asked of every path but the open ones."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.security.admin_token import bearer_required, new_admin_token, read_admin_token


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def test_only_the_token_opens_the_closed_paths(tmp_path: Path) -> None:
    token = new_admin_token(tmp_path / "admin-token")
    assert stat.S_IMODE((tmp_path / "admin-token").stat().st_mode) == 0o600
    app = web.Application(middlewares=[bearer_required(token, {"/metrics"})])
    app.add_routes([web.get("/api/x", _ok), web.get("/metrics", _ok)])
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/metrics")).status == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": "Bearer é"},  # not ASCII: compared, not a 500
        ):
            resp = await client.get("/api/x", headers=headers)
            assert resp.status == 401
            body = await resp.json()
            assert body["error"]["type"] == "authentication_error"
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        ok = await client.get("/api/x", headers={"Authorization": f"Bearer {token}"})
        assert ok.status == 200 and await ok.json() == {"ok": True}


def test_an_unreadable_or_empty_token_file_is_a_usage_error(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(SystemExit) as exited:
            read_admin_token(parser, str(path))
        assert exited.value.code == 2
    (tmp_path / "t").write_text(" secret \n")
    assert read_admin_token(parser, str(tmp_path / "t")) == "secret"
