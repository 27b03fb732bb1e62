"""vLLM's own request fields that its Anthropic Messages and OpenAI Responses models share,
checked as both conversions (`anthropic_messages`, `responses_input`) need them: `cache_salt`
as the chat request vLLM makes of either body checks it, `vllm_xargs`' shape, and the unset
values of a `chat_template_kwargs` entry."""

from __future__ import annotations

from typing import Final

from services.common.serving.api_errors import bad_request

_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_MAX_CACHE_SALT: Final = 128


def check_cache_salt(value: object) -> None:
    """Raise vLLM's 400 for a `cache_salt` the chat request it makes of a Messages or a
    Responses body would refuse: at most 128 characters, none of '@', '/', '\\' or NUL
    (the Messages model alone takes 1 to 1024); None passes."""
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_CACHE_SALT
        or any(c in _CACHE_SALT_FORBIDDEN for c in value)
    ):
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
            "without '@', '/', '\\' or NUL.",
            "cache_salt",
        )


def is_vllm_xargs(value: object) -> bool:
    """Whether `value` has `vllm_xargs`' shape: an object of strings, numbers or lists of them
    (a boolean is no number)."""

    def scalar(v: object) -> bool:
        return isinstance(v, str | int | float) and not isinstance(v, bool)

    return isinstance(value, dict) and all(
        scalar(v) or (isinstance(v, list) and all(scalar(x) for x in v)) for v in value.values()
    )


def is_unset_template_argument(value: object) -> bool:
    """Whether a `chat_template_kwargs` entry counts as unset: vLLM's merge of template
    arguments lets None and "auto" stand for unset."""
    return value is None or value == "auto"
