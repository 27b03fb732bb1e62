"""Serving an aiohttp application on a `host:port` address."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def start_site(
    app: web.Application,
    listen: str,
    *,
    backlog: int = 128,
    runner_class: type[web.AppRunner] = web.AppRunner,
    **runner_options: Any,
) -> tuple[web.AppRunner, int]:
    """Serve `app` on `listen` (port 0: any free one), without access logs; returns the
    runner (to clean up) and the bound port. `runner_options` go to `runner_class` (e.g.
    `http_errors.JsonErrorRunner`)."""
    host, _, port = listen.rpartition(":")
    runner = runner_class(app, access_log=None, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, host, int(port), backlog=backlog)
    await site.start()
    server = site._server  # the bound socket tells the port when 0 was asked for
    sockets = getattr(server, "sockets", None) or []
    return runner, int(sockets[0].getsockname()[1]) if sockets else int(port)
