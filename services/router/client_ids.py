"""The ids a client gives its requests: a request's session (the first session header, else
what the body names) and the key the Conductor and the engines know it by, scoped by tenant;
and the client's own request id (`X-Request-Id`). Checked before a request is placed, so a
bad one binds nothing.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from services.common.inference_api.openai_api import bad_request

_SESSION_SAFE: Final = "-._~:@!$&'()*+,;=/"  # kept as they are (no '%', no space)
MAX_REQUEST_ID_CHARS: Final = 128
# Headers that name a request's session, first found first: ours, then what agent CLIs send
# on every call of a session (Claude Code's; Codex's `session_id` and `conversation_id`,
# which OpenCode's session-cache plugin sends too). Over any session the body names.
SESSION_HEADERS: Final = (
    "x-session-id", "x-claude-code-session-id", "session_id", "x-codex-session-id",
    "conversation_id",
)  # fmt: skip


def client_request_id(request: web.Request) -> str | None:
    """The client's own `X-Request-Id`, where it is one a header may carry on (printable
    ASCII, at most `MAX_REQUEST_ID_CHARS`): the engine gets it as its request id, and the
    client gets it back."""
    rid = request.headers.get("x-request-id", "")
    if 0 < len(rid) <= MAX_REQUEST_ID_CHARS and rid.isascii() and rid.isprintable():
        return rid
    return None


def check_session_id(session: str, max_bytes: int, param: str) -> None:
    """Raise a 400 for a session id over `max_bytes` UTF-8 bytes (before it is placed, so
    nothing is bound to it). Any character may be in one: `session_key` makes it a valid
    header value."""
    size = len(session.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise bad_request(
            f"The session id is {size} bytes long (UTF-8); at most {max_bytes} are allowed.",
            param,
        )


def session_header(request: web.Request) -> tuple[str, str]:
    """The first of `SESSION_HEADERS` the request carries, and its value; ("", "") for
    none."""
    for name in SESSION_HEADERS:
        value = request.headers.get(name)
        if value:
            return name, value
    return "", ""


def session_param(body: dict[str, Any]) -> str:
    """Where in the body the request's session id came from, as the error's `param`."""
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return "metadata.session_id"
    return "prompt_cache_key" if body.get("prompt_cache_key") else "user"


def session_key(tenant: str, session: str) -> str:
    """The session id the Conductor and the engine see: scoped by tenant (two tenants' "s1"
    are different sessions), and percent-encoded where it is not a plain token, so it is a
    valid header value (`x-session-id` to the engine) equal to what the Conductor is sent."""
    return f"{_quote(tenant)}/{_quote(session)}"


def _quote(text: str) -> str:
    return quote(text, safe=_SESSION_SAFE, errors="surrogatepass")
