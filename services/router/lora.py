"""LoRA adapters behind the Router: which adapters the cluster serves (vLLM's
`--lora-modules`), and loading them onto engines through vLLM's runtime LoRA API.

A request names an adapter in `model`, as with vLLM. It is tokenized with its base model's
tokenizer, and its blocks are hashed with the adapter's name and path as vLLM hashes them
(`("lora", name, path)` on every block), so the path must be the one the engines load the
adapter from. The Conductor places it where the adapter is held, or has a slot free, and says
what the instance must load and unload first (`AdapterChange`). The Router does that before it
forwards the request: `POST /v1/unload_lora_adapter`, then `POST /v1/load_lora_adapter`
(served by vLLM started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). vLLM loads a name once,
under a lock per name; a second load of it answers 400 "already been loaded", which is
success here: two Routers placing the same adapter at once both go ahead once it is loaded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvsched.core.adapters import AdapterChange
from kvsched.core.vllm_hashing import AdapterKey
from services.common.serving.api_errors import ApiError
from services.common.serving.flags import pairs

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0  # a large adapter read from a network disk
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter the cluster serves: its name (a request's `model`), the path its engines
    load it from, its base model's served name, and its weight bytes (0: not readable here)."""

    name: str
    path: str
    base_model: str
    weight_bytes: int = 0

    @property
    def key(self) -> AdapterKey:
        """What vLLM puts in the extra keys of its blocks' hashes."""
        return (self.name, self.path)


def parse_lora_modules(text: str, default_base: str) -> tuple[LoraModule, ...]:
    """vLLM's `--lora-modules` forms: `NAME=PATH[,NAME=PATH...]`, or a JSON object or list
    of objects `{"name", "path", "base_model_name"}` (the base defaults to `default_base`).
    Raises ValueError naming what is wrong."""
    text = text.strip()
    if not text:
        return ()
    entries: list[tuple[str, str, str]] = []
    if text.startswith(("{", "[")):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: not JSON ({exc})") from None
        for item in raw if isinstance(raw, list) else [raw]:
            if not isinstance(item, dict) or not all(
                isinstance(item.get(k), str) and item[k] for k in ("name", "path")
            ):
                raise ValueError('--lora-modules: each JSON entry needs "name" and "path"')
            base = item.get("base_model_name") or default_base
            if not isinstance(base, str):
                raise ValueError("--lora-modules: base_model_name must be a string")
            entries.append((item["name"], item["path"], base))
    else:
        entries += [(n, p, default_base) for n, p in pairs(text, "--lora-modules", "NAME=PATH")]
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("--lora-modules: an adapter name is given twice")
    return tuple(LoraModule(n, p, b, weight_bytes(p)) for n, p, b in entries)


def weight_bytes(path: str) -> int:
    """The adapter's weight file's size where this machine can read it, else 0 (a Router
    apart from the engines' disks: its load is then priced at the host link's setup)."""
    for name in _WEIGHT_FILES:
        try:
            return (Path(path) / name).stat().st_size
        except OSError:
            continue
    return 0


def unavailable_adapter(name: str, why: str) -> ApiError:
    return ApiError(
        503,
        f"The LoRA adapter `{name}` could not be loaded: {why}",
        type_="ServiceUnavailableError",
        code="adapter_unavailable",
        retry_after_s=1.0,
    )


class AdapterLoader:
    """Carries out the Conductor's adapter changes on engines (vLLM's runtime LoRA API)."""

    def __init__(self, modules: Iterable[LoraModule]) -> None:
        self.modules: Mapping[str, LoraModule] = {m.name: m for m in modules}
        self._timeout = aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)

    async def change(self, session: aiohttp.ClientSession, url: str, change: AdapterChange) -> None:
        """Unload `change.unload` (one the engine no longer has is fine), then load
        `change.load` (one it has already is fine) on the engine at `url`; "" skips either.
        Raises ApiError 503 when the engine cannot load the adapter."""
        load, unload = change.load, change.unload
        if unload:
            status, text = await self._post(session, url, "/v1/unload_lora_adapter",
                                             {"lora_name": unload})  # fmt: skip
            if status not in (200, 404):
                log.warning("engine %s did not unload adapter %s: %s %s", url, unload, status,
                            text[:200])  # fmt: skip
        if not load:
            return
        module = self.modules.get(load)
        if module is None:  # (the Conductor names only adapters a Router asked for)
            raise unavailable_adapter(load, "this Router does not know it")
        status, text = await self._post(
            session, url, "/v1/load_lora_adapter", {"lora_name": load, "lora_path": module.path}
        )
        if status == 200 or (status == 400 and "already been loaded" in text):
            return
        log.warning("engine %s did not load adapter %s: %s %s", url, load, status, text[:200])
        raise unavailable_adapter(load, f"the engine answered {status}")

    async def _post(
        self, session: aiohttp.ClientSession, url: str, path: str, body: dict[str, str]
    ) -> tuple[int, str]:
        try:
            async with session.post(url + path, json=body, timeout=self._timeout) as resp:
                return resp.status, (await resp.content.read(4096)).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine %s: %s failed: %s", url, path, exc)
            return 0, ""
