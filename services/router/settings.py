"""Router settings: command-line flags, each with an environment variable default
(`KVSCHED_ROUTER_<FLAG>`); tracing from `OTEL_*` (see `services.common.telemetry`).

A Router refuses to start without tenants: either `--api-keys PATH` (see `auth`) or an
explicit `--no-auth` (one anonymous tenant with an empty salt).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import get_args

from services.common.inference_api.chat_content_format import ContentFormatOption
from services.common.inference_api.chat_prompt import load_chat_template
from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.common.security.tls import ClientTls, ServerTls
from services.common.security.tls_flags import (
    ClientTlsFlags,
    ServerTlsFlags,
    add_insecure,
    require_secure,
)
from services.common.serving.flags import env_flags, otlp_endpoint, pairs, process_id
from services.common.serving.logs import LogSettings, add_log_flags, read_log_settings
from services.dataplane import BlockHashes, add_block_hash_flags, block_hashes_from_args
from services.router.lora import LoraModule, parse_lora_modules

ENV = "KVSCHED_ROUTER_"
_flag = env_flags(ENV)
CONDUCTOR_TLS = ClientTlsFlags("conductor-", "the Conductors")
GRPC_TLS = ServerTlsFlags("grpc-tls-")  # its admin gRPC server (RouterService, health)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything a Router process is configured with."""

    router_id: str = field(default_factory=process_id)
    listen: str = "127.0.0.1:8000"
    grpc_listen: str = "127.0.0.1:50061"
    conductors: tuple[str, ...] = ("127.0.0.1:50051",)
    conductor_tls: ClientTls | None = None
    grpc_tls: ServerTls | None = None  # its admin gRPC server's
    api_keys: str | None = None  # path of the tenants file; None needs `no_auth`
    no_auth: bool = False
    tokenizer: str | None = None  # tokenizer directory or tokenizer.json; None: the demo one
    chat_template: str | None = None  # the template's text, in place of the tokenizer's
    chat_template_content_format: ContentFormatOption = "auto"
    block_size: int = 16
    block_hashes: BlockHashes = field(default_factory=BlockHashes)  # how engines name blocks
    model: str = DEFAULT_MODEL  # the served model a request naming none asks for
    # Other names clients may use, each standing for a name the engines serve.
    model_aliases: tuple[tuple[str, str], ...] = ()
    # The other served models, each with its tokenizer directory (`model` has `tokenizer`).
    model_tokenizers: tuple[tuple[str, str], ...] = ()
    lora_modules: tuple[LoraModule, ...] = ()  # the LoRA adapters the engines may load
    max_model_len: int = 131_072
    placement_timeout_s: float = 0.25
    transfer_wait_s: float = 60.0  # longest wait for a KV transfer a request needs
    instances_refresh_s: float = 1.0
    upstream_timeout_s: float = 300.0  # longest silence from an engine (headers or bytes)
    max_connections: int = 4096  # upstream pool size; 0: unlimited
    backlog: int = 4096  # listen backlog of the HTTP socket
    suspect_s: float = 5.0  # how long an instance that refused a connection is skipped
    drain_timeout_s: float = 30.0  # SIGTERM: how long open streams may take to finish
    tokenizer_threads: int = 4
    # Token ids kept of sessions' previous turns, so a later turn tokenizes and hashes only
    # what is new (`session_prompts`); 0: every turn whole.
    session_prompt_tokens: int = 1 << 23
    # Overload bounds (see `overload`): beyond each a request gets 429 + Retry-After at once.
    max_in_flight: int = 2048  # completions open at once
    max_placing: int = 256  # requests waiting for the Conductor's placement
    fallback_max_in_flight: int = 32  # per instance, while the Conductor is unreachable
    # Longest session id a client may give (UTF-8 bytes): the engine gets it in a header,
    # percent-encoded (up to three times as long), which HTTP parsers cap at a few KB.
    max_session_id_bytes: int = 256
    # Longest request body, bytes; 0: the longest a prompt within `max_model_len` tokens can
    # need (`tokenizer.body_bytes_bound`), at most `MAX_BODY_BYTES`.
    max_body_bytes: int = 0
    # Bodies of at least this many bytes are decoded by the body worker process, off this
    # process's GIL (`bodies`); 0: every body on the event loop, no worker.
    body_worker_bytes: int = 1 << 20
    otlp_endpoint: str | None = None
    log: LogSettings = field(default_factory=LogSettings)

    def __post_init__(self) -> None:
        if self.api_keys is None and not self.no_auth:
            raise ValueError("give --api-keys PATH, or --no-auth to serve without API keys")
        if self.api_keys is not None and self.no_auth:
            raise ValueError("--api-keys and --no-auth exclude each other")
        if not self.conductors:
            raise ValueError("at least one Conductor address is needed (--conductor)")
        positive = {
            "--block-size": self.block_size,
            "--max-model-len": self.max_model_len,
            "--placement-timeout": self.placement_timeout_s,
            "--transfer-wait": self.transfer_wait_s,
            "--instances-refresh": self.instances_refresh_s,
            "--upstream-timeout": self.upstream_timeout_s,
            "--tokenizer-threads": self.tokenizer_threads,
            "--max-session-id-bytes": self.max_session_id_bytes,
            "--max-in-flight": self.max_in_flight,
            "--max-placing": self.max_placing,
            "--fallback-max-in-flight": self.fallback_max_in_flight,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.chat_template_content_format not in get_args(ContentFormatOption):
            raise ValueError(
                "--chat-template-content-format must be auto, string or openai, got "
                f"{self.chat_template_content_format!r}"
            )
        if self.session_prompt_tokens < 0:
            raise ValueError("--session-prompt-tokens must be 0 (none kept) or positive")
        if self.max_connections < 0:
            raise ValueError("--max-connections must be 0 (unlimited) or positive")
        if self.max_body_bytes < 0:
            raise ValueError("--max-body-bytes must be 0 (derived) or positive")
        if self.body_worker_bytes < 0:
            raise ValueError("--body-worker-bytes must be 0 (no worker) or positive")


def parse(argv: Sequence[str] | None = None) -> RouterSettings:
    """Settings from flags and `KVSCHED_ROUTER_*`; exits with a usage error (status 2) on a
    bad value, like argparse does."""
    d = RouterSettings(router_id="", no_auth=True)
    p = argparse.ArgumentParser(
        prog="kvsched router", description="Run a Router (OpenAI-compatible HTTP front)."
    )
    _flag(p, "id", "", "this Router's id (default host-pid)")
    _flag(p, "listen", d.listen, "HTTP listen address")
    _flag(p, "grpc-listen", d.grpc_listen, "gRPC admin (RouterService, health) listen address")
    _flag(p, "conductor", ",".join(d.conductors), "Conductor gRPC addresses, comma-separated")
    CONDUCTOR_TLS.add(_flag, p)
    GRPC_TLS.add(_flag, p)
    add_insecure(_flag, p)
    _flag(p, "api-keys", "", "tenants and hashed API keys (JSON; see services.router.api_keys)")
    _flag(p, "no-auth", False, "serve without API keys (one anonymous tenant, no salt)")
    _flag(p, "tokenizer", "", "tokenizer directory or tokenizer.json (default: the demo one)")
    _flag(p, "chat-template", "", "chat template file or text, as vLLM's --chat-template")
    _flag(
        p,
        "chat-template-content-format",
        d.chat_template_content_format,
        "auto, string or openai: message content as the template gets it (as vLLM's flag)",
    )
    _flag(p, "block-size", d.block_size, "tokens per KV block (as the Conductor's)")
    add_block_hash_flags(_flag, p)
    _flag(p, "model", d.model, "served model name (for /v1/models when no engine answers)")
    _flag(p, "model-alias", "", "ALIAS=NAME[,...]: names clients may use for a served model")
    _flag(p, "model-tokenizer", "", "NAME=DIR[,...]: other served models, their tokenizers")
    _flag(
        p,
        "lora-modules",
        "",
        "LoRA adapters as vLLM's flag: NAME=PATH[,...] (of --model) or JSON "
        '[{"name", "path", "base_model_name"}]; PATH as the engines load it',
    )
    _flag(p, "max-model-len", d.max_model_len, "longest prompt plus output, tokens")
    _flag(p, "placement-timeout", d.placement_timeout_s, "seconds before a placement is shed")
    _flag(p, "transfer-wait", d.transfer_wait_s, "longest wait for KV a request needs, seconds")
    _flag(p, "instances-refresh", d.instances_refresh_s, "instance list refresh period, seconds")
    _flag(p, "upstream-timeout", d.upstream_timeout_s, "longest engine silence, seconds")
    _flag(p, "max-connections", d.max_connections, "upstream connection pool size (0: no cap)")
    _flag(p, "backlog", d.backlog, "listen backlog of the HTTP socket")
    _flag(p, "drain-timeout", d.drain_timeout_s, "on SIGTERM, seconds open streams may take")
    _flag(p, "tokenizer-threads", d.tokenizer_threads, "threads that tokenize and hash")
    _flag(
        p,
        "session-prompt-tokens",
        d.session_prompt_tokens,
        "ids of sessions' last turns kept to tokenize only what is new (0: none)",
    )
    _flag(p, "max-session-id-bytes", d.max_session_id_bytes, "longest session id, UTF-8 bytes")
    _flag(p, "max-in-flight", d.max_in_flight, "completions open at once; more get 429")
    _flag(p, "max-placing", d.max_placing, "requests waiting for a placement; more get 429")
    _flag(
        p,
        "fallback-max-in-flight",
        d.fallback_max_in_flight,
        "per instance, while the Conductor is unreachable; more get 429",
    )
    _flag(p, "max-body-bytes", d.max_body_bytes, "longest request body (0: from the context)")
    _flag(p, "body-worker-bytes", d.body_worker_bytes, "bodies decoded off the GIL from (0: none)")
    add_log_flags(_flag, p)
    a = p.parse_args(argv)
    tls = CONDUCTOR_TLS.read(p, a)
    grpc_tls = GRPC_TLS.read(p, a)
    require_secure(p, a, (GRPC_TLS, grpc_tls), [(CONDUCTOR_TLS, tls)])
    try:
        template = load_chat_template(a.chat_template) if a.chat_template else None
        return RouterSettings(
            router_id=a.id or process_id(),
            listen=a.listen,
            grpc_listen=a.grpc_listen,
            conductors=tuple(c.strip() for c in a.conductor.split(",") if c.strip()),
            conductor_tls=tls,
            grpc_tls=grpc_tls,
            api_keys=a.api_keys or None,
            no_auth=a.no_auth,
            tokenizer=a.tokenizer or None,
            chat_template=template,
            chat_template_content_format=a.chat_template_content_format,
            block_size=a.block_size,
            block_hashes=block_hashes_from_args(a),
            model=a.model,
            model_aliases=pairs(a.model_alias, "--model-alias", "ALIAS=NAME"),
            model_tokenizers=pairs(a.model_tokenizer, "--model-tokenizer", "NAME=DIR"),
            lora_modules=parse_lora_modules(a.lora_modules, a.model),
            max_model_len=a.max_model_len,
            placement_timeout_s=a.placement_timeout,
            transfer_wait_s=a.transfer_wait,
            instances_refresh_s=a.instances_refresh,
            upstream_timeout_s=a.upstream_timeout,
            max_connections=a.max_connections,
            backlog=a.backlog,
            drain_timeout_s=a.drain_timeout,
            tokenizer_threads=a.tokenizer_threads,
            session_prompt_tokens=a.session_prompt_tokens,
            max_session_id_bytes=a.max_session_id_bytes,
            max_in_flight=a.max_in_flight,
            max_placing=a.max_placing,
            fallback_max_in_flight=a.fallback_max_in_flight,
            max_body_bytes=a.max_body_bytes,
            body_worker_bytes=a.body_worker_bytes,
            otlp_endpoint=otlp_endpoint(),
            log=read_log_settings(p, a),
        )
    except ValueError as exc:
        p.error(str(exc))
