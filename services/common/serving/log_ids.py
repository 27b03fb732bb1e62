"""Users' session ids as logs name them: a short hash, never the id itself."""

from __future__ import annotations

import hashlib

SESSION_TAG_HEX_DIGITS = 12


def session_tag(session_id: str) -> str:
    """The first 12 hex digits of the id's SHA-256. The same id always gets the same tag, so
    an operator who holds an id can find its lines; the id itself (which a client may derive
    from a user or a conversation) stays out of logs that others may read."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:SESSION_TAG_HEX_DIGITS]
