"""The first stage of a completion: what the Router checks and computes before it asks where
the request runs.

Every check the Router makes of a request's content is here, in the order a client meets
them: the body (JSON, at most `max_body_bytes`; a large completion or chat body decoded and
checked by the body worker process: `bodies`), its fields (`parse_request`; an Anthropic
Messages or Responses body first read as the chat request vLLM makes of it), its model (a
model the Router has no tokenizer for is vLLM's 404), the session id's length
(`check_session_id`), a prompt too long for the context by its bytes alone
(`RouterTokenizer.least_tokens`: refused untokenized), the chat's rendering
(`PromptTokenizer.prompt_ids`: media parts, a request's own template), then the lengths
(`output_budget`: an empty prompt, the model's context, in vLLM's words).
What passes is tokenized with its model's tokenizer and hashed as vLLM does, with the
tenant's salt (one call: on the event loop for a small prompt, else on a thread pool, where
the tokenizer's backend lets go of the GIL), and leaves as a `Call`. (Who may ask, and
whether this Router still takes requests, is the server's: `server`.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Literal

from aiohttp import web
from opentelemetry.trace import Tracer

from clients.python.packed_hashes import hash_count, pack_hashes
from services.common.inference_api import anthropic_messages, responses_input
from services.common.inference_api.openai_api import (
    ApiError,
    CompletionRequest,
    Kind,
    bad_request,
    check_length,
    parse_request,
)
from services.common.telemetry.spans import child_span
from services.router.auth import Tenant
from services.router.bodies import BodyReader, BodyWorker, body_limit
from services.router.client_ids import (
    check_session_id,
    client_request_id,
    session_header,
    session_key,
    session_param,
)
from services.router.placement import PlacementQuery
from services.router.prompt_pieces import PieceTokenizer
from services.router.proxy import with_cache_salt
from services.router.session_prompts import SessionPrompts
from services.router.settings import RouterSettings
from services.router.tokenizer import RouterTokenizer

log = logging.getLogger(__name__)

# Prompts up to this many characters (or token ids) are tokenized and hashed on the event
# loop: at most ~80 µs of work (demo tokenizer), less than a pool thread's round trip costs.
INLINE_PROMPT_CHARS: Final = 256
# Prompts above this go to the engine as ids: its tokenizing then costs more than the
# re-serialised body (a millisecond a megabyte) and the ids (a few bytes a token).
HAND_OVER_CHARS: Final = 4096
# The APIs a request may come by: OpenAI's completions and chat, Anthropic's Messages and
# OpenAI's Responses (the last two read as the chat request vLLM makes of them).
Api = Literal["completion", "chat", "messages", "responses"]
# How each is parsed (`parse_request`) and so checked by the body worker; None: converted.
OPENAI_KINDS: Final[dict[Api, Kind | None]] = {
    "completion": "completion", "chat": "chat", "messages": None, "responses": None,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tokenized:
    """What the tokenizer thread makes of a request."""

    prompt_tokens: int
    output_tokens: int  # at most, within the context
    packed_hashes: bytes  # the prompt's block hashes, packed (`clients.python.pack_hashes`)
    body: bytes  # what the engine gets


@dataclass(frozen=True, slots=True)
class Call:
    """One completion request, checked and hashed, on its way to an engine."""

    req: CompletionRequest
    query: PlacementQuery
    body: bytes  # what the engine gets
    arrived: float  # perf_counter() when the request came in
    reply: dict[str, str]  # our headers for the client's response (filled as we go)
    # The client's own X-Request-Id (`client_request_id`): the engine's request id, and the
    # client's again in our answer. None: the engine gets ours.
    client_request_id: str | None = None


class Preparer:
    """Turns an HTTP request into a `Call` (see the module docstring); owns the tokenizer and
    its threads, and the body reader and its worker process (`start` starts it)."""

    def __init__(self, settings: RouterSettings, tracer: Tracer) -> None:
        def tokenizer(path: str | None) -> RouterTokenizer:
            return RouterTokenizer(
                path,
                chat_template=settings.chat_template,
                content_format=settings.chat_template_content_format,
            )

        self.default_model = settings.model
        self.tokenizer = tokenizer(settings.tokenizer)  # the default model's
        self.tokenizers = {settings.model: self.tokenizer}
        self.tokenizers |= {name: tokenizer(path) for name, path in settings.model_tokenizers}
        # Each model's sessions' last turns, to tokenize and hash only what a turn adds.
        self.session_prompts = {
            name: SessionPrompts(PieceTokenizer(tok.model), settings.session_prompt_tokens)
            for name, tok in self.tokenizers.items()
        } if settings.session_prompt_tokens else {}  # fmt: skip
        # What refuses a body by its bytes alone must hold for every model's tokenizer.
        bounds = [t.max_token_bytes for t in self.tokenizers.values()]
        longest = None if None in bounds else max(b for b in bounds if b is not None)
        self.max_body_bytes = body_limit(settings.max_body_bytes, settings.max_model_len, longest)
        worker = BodyWorker(longest, settings.max_model_len) if settings.body_worker_bytes else None
        self.bodies = BodyReader(self.max_body_bytes, worker, settings.body_worker_bytes)
        self.hasher = settings.block_hashes.hasher(settings.block_size)
        self.aliases = dict(settings.model_aliases)
        self.adapters = {m.name: m for m in settings.lora_modules}
        for module in settings.lora_modules:
            if module.base_model not in self.tokenizers:
                raise ValueError(f"LoRA adapter {module.name}: no tokenizer for its base model "
                                 f"{module.base_model!r} (--model, --model-tokenizer)")  # fmt: skip
            if module.name in self.tokenizers:
                raise ValueError(f"LoRA adapter {module.name}: a base model has that name")
        self._chat_template = settings.chat_template
        # What each model's chat template shows the Messages and Responses conversions.
        self._messages_traits: dict[str, anthropic_messages.TemplateTraits] = {}
        self._responses_traits: dict[str, responses_input.TemplateTraits] = {}
        self.max_model_len = settings.max_model_len
        # Each model's context as its engines said it (the Placer's, kept up to date), over
        # `max_model_len` where one said it.
        self.contexts: Mapping[str, int] = {}
        self.max_session_id_bytes = settings.max_session_id_bytes
        self._tracer = tracer
        self._pool = ThreadPoolExecutor(
            settings.tokenizer_threads, thread_name_prefix="kvsched-tok"
        )

    def _parse(self, api: Api, body: dict[str, Any]) -> CompletionRequest:
        """What the serving path needs of `body`: an Anthropic Messages or a Responses body is
        read as the chat request vLLM makes of it (its prompt, for the ids to hash); the
        engine still gets the body as the client sent it. Raises `ApiError` 400 (404 for an
        unknown model)."""
        kind = OPENAI_KINDS[api]
        if kind is not None:
            return parse_request(kind, body)
        asked = body.get("model")
        model = self.base_model(self.served_model(asked if isinstance(asked, str) else None))
        tokenizer = self.tokenizers[model]
        if api == "messages":
            traits = self._messages_traits.get(model)
            if traits is None:  # probed once a model, as vLLM does at its start
                traits = anthropic_messages.template_traits(tokenizer, self._chat_template)
                self._messages_traits[model] = traits
            return parse_request("chat", anthropic_messages.chat_body(body, traits))
        shows = self._responses_traits.get(model)
        if shows is None:
            shows = responses_input.template_traits(tokenizer, self._chat_template)
            self._responses_traits[model] = shows
        return parse_request("chat", responses_input.chat_body(body, shows))

    def served_model(self, model: str | None) -> str:
        """The served name a request's `model` stands for (the default one where it names
        none, an alias's model; an adapter is a served name); raises the 404 vLLM answers for
        a model it does not serve."""
        if not model:
            return self.default_model
        served = self.aliases.get(model, model)
        if served not in self.tokenizers and served not in self.adapters:
            raise ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError",
                           param="model")  # fmt: skip
        return served

    def base_model(self, served: str) -> str:
        """The model a served name runs on: an adapter's base, else itself."""
        module = self.adapters.get(served)
        return served if module is None else module.base_model

    async def start(self) -> None:
        """Start the body worker process, if there is one (one that cannot start is tried
        again at the first large body; meanwhile they are decoded on the event loop)."""
        if self.bodies.worker is not None:
            try:
                await self.bodies.worker.start()
            except OSError as exc:
                log.warning("the body worker did not start: %s", exc)

    async def close(self) -> None:
        """Stop the tokenizer threads (requests still queued for them are cancelled) and the
        body worker."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.bodies.worker is not None:
            await self.bodies.worker.close()

    async def prepare(
        self,
        request: web.Request,
        api: Api,
        tenant: Tenant,
        arrived: float,
        reply: dict[str, str],
    ) -> Call:
        """Check, tokenize and hash `request`; raises `ApiError` 400 for what the Router
        refuses. Names the request (`x-kvsched-request-id` in `reply`) once it passed."""
        read = await self.bodies.read(request, OPENAI_KINDS[api])
        raw, body = read.raw, read.fields
        req = self._parse(api, body)
        model = self.served_model(req.model)
        tokenizer = self.tokenizers[self.base_model(model)]
        header, named = session_header(request)
        session = named or req.session_id
        if session:
            param = header or session_param(body)
            check_session_id(session, self.max_session_id_bytes, param)
        scoped = session_key(tenant.name, session) if session else ""
        if not read.checked:  # (the body worker did it)
            self._refuse_beyond_context(req, tokenizer, self.context(model))
        salt = tenant.cache_salt(req.cache_salt)
        with child_span(self._tracer, "tokenize") as span:
            work = partial(self._tokenize, req, model, raw, body, salt, session=scoped)
            if _small(req):
                tokenized = work()
            else:
                tokenized = await asyncio.get_running_loop().run_in_executor(self._pool, work)
            if span.is_recording():
                span.set_attribute("kvsched.prompt_tokens", tokenized.prompt_tokens)
                span.set_attribute("kvsched.blocks", hash_count(tokenized.packed_hashes))
        rid = uuid.uuid4().hex  # the Conductor's idempotency key: never a client's choice
        reply["x-kvsched-request-id"] = rid
        client_rid = client_request_id(request)
        if client_rid is not None:
            reply["x-request-id"] = client_rid
        adapter = self.adapters.get(model)
        query = PlacementQuery(
            rid,
            tokenized.prompt_tokens,
            tokenized.output_tokens,
            tokenized.packed_hashes,
            scoped,
            model if adapter is None else adapter.base_model,
            "" if adapter is None else adapter.name,
            0 if adapter is None else adapter.weight_bytes,
        )
        return Call(req, query, tokenized.body, arrived, reply, client_rid)

    def _refuse_beyond_context(
        self, req: CompletionRequest, tokenizer: RouterTokenizer, context: int
    ) -> None:
        """Raise the 400 vLLM gives for a prompt over the `context` when the fewest tokens
        the prompt can have (`RouterTokenizer.least_tokens`) are already too many: such a
        prompt is refused without being tokenized (seconds of work for megabytes of text)."""
        least = tokenizer.least_tokens(req)
        if least >= context:
            check_length(least, req.max_tokens, context, at_least=True)

    def context(self, model: str) -> int:
        """The context length of served name `model` (an adapter's is its base's): the
        least its engines said, else `--max-model-len`."""
        return self.contexts.get(self.base_model(model)) or self.max_model_len

    def _tokenize(
        self,
        req: CompletionRequest,
        model: str,
        raw: bytes,
        body: dict[str, Any],
        salt: str,
        *,
        session: str = "",
    ) -> Tokenized:
        """Tokenize with `model`'s tokenizer, check the lengths, hash, and build the engine's
        body (thread-safe). A chat of a `session` is tokenized and hashed from what its
        previous turn left (`session_prompts`): only what is new, the same ids. A long text
        completion goes to the engine as its token ids (`hands_over_ids`)."""
        if req.model is not None and req.model != model:  # the engines know the served name
            body = {**body, "model": model}
            raw = json.dumps(body).encode()
        base = self.base_model(model)
        tokenizer = self.tokenizers[base]
        prompts = self.session_prompts.get(base)
        module = self.adapters.get(model)
        adapter = None if module is None else module.key  # vLLM hashes its blocks apart
        chat = req.chat
        batch: Sequence[Sequence[int]]  # the prompts' ids (arrays from `prompts`)
        block_hashes: Iterable[int]
        if session and prompts is not None and chat is not None and chat.forwarded_ids is None:
            text = tokenizer.render_chat(chat)
            try:
                ids, block_hashes = prompts.ids_and_hashes(
                    session,
                    text,
                    req.add_special_tokens,
                    self.hasher,
                    salt or None,
                    adapter=adapter,
                )
            except TypeError:  # a lone surrogate, as `prompt_ids` refuses it
                raise bad_request(
                    "'messages' is not valid Unicode (it contains a lone surrogate)", "messages"
                ) from None
            batch = [ids]
        else:
            batch = tokenizer.batch_ids(req)
            block_hashes = self.hasher.hash_prompt(batch[0], salt or None, adapter)
        # Each prompt of a batch is checked as vLLM checks it; the engine computes them all
        # (and `n` choices of each) where the first one is placed.
        context = self.context(model)
        output = sum(output_budget(req, len(ids), context) for ids in batch) * req.n
        if hands_over_ids(req, body):
            body = {**body, "prompt": list(batch[0])}
            raw = json.dumps(body).encode()
        # Packed once here (off the event loop for a long prompt): the placement and the
        # completion report both carry these bytes as they are.
        hashes = pack_hashes(block_hashes)
        prompt_tokens = sum(map(len, batch))
        return Tokenized(prompt_tokens, output, hashes, with_cache_salt(raw, body, salt))


def output_budget(req: CompletionRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The output tokens `req` can get with a prompt of `prompt_tokens`, or a 400: an empty
    prompt, one that leaves no room for output, `max_tokens` beyond the context."""
    if not prompt_tokens:
        param = "messages" if req.kind == "chat" else "prompt"
        raise bad_request("The prompt is empty.", param)
    return check_length(prompt_tokens, req.max_tokens, max_model_len)


def hands_over_ids(req: CompletionRequest, body: Mapping[str, Any]) -> bool:
    """Whether the engine gets `req`'s prompt as the ids the Router computed, so that it
    does not tokenize it again (on its critical path: about as long as the Router's own
    tokenizing, 100 ms and more at 80K tokens): a completion of one text prompt longer than
    `HAND_OVER_CHARS` (the ids are vLLM's: `tests/data/vllm/prompt_tokens.json`), not
    echoed (an echo would be the ids' text). The body is then re-serialised: every field
    keeps its value, not always its bytes. vLLM's chat APIs take no ids."""
    return (
        req.kind == "completion"
        and req.prompt_text is not None
        and len(req.prompt_text) > HAND_OVER_CHARS
        and not req.more_prompts
        and not body.get("echo")
    )


def _small(req: CompletionRequest) -> bool:
    """Whether tokenizing and hashing `req` costs less than handing it to a pool thread
    (0.1 ms of wake-ups and more on a busy machine): then it runs on the event loop."""
    if req.prompt_text is not None:
        return len(req.prompt_text) <= INLINE_PROMPT_CHARS
    return req.prompt_ids is not None and len(req.prompt_ids) <= INLINE_PROMPT_CHARS
