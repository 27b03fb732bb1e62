"""What the engine tells about itself to whoever schedules, routes or watches it: Prometheus
`/metrics`; vLLM's `/load` and `/kv_event_sources`; SGLang's `/server_info` and `/model_info`
(what sglang-router reads to learn a worker's model); the JSON views a Messenger reads
(`/kvsched/info`, `/kvsched/load`, `/kvsched/kv/snapshot`) and the step counters the load
generator reads (`/kvsched/stats`)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.engine.lora import Adapters
from services.engine.runner import LiveEngine
from services.engine.settings import EngineSettings


class StatusRoutes:
    """The handlers reading `live` (and its LoRA `adapters`, None when LoRA is off)."""

    def __init__(
        self, settings: EngineSettings, live: LiveEngine, adapters: Adapters | None
    ) -> None:
        self.settings = settings
        self.live = live
        self.adapters = adapters

    async def prometheus(self, request: web.Request) -> web.Response:
        engine, m = self.live.engine, self.live.metrics
        m.running.set(engine.running)
        m.waiting.set(len(engine.waiting) + len(engine.handoffs))
        m.kv_usage.set(engine.cache.locked / engine.cache.total)
        if self.adapters is not None:
            m.lora_requests(self.adapters.capacity, self._busy_adapters(), [])
        body = generate_latest(m.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- vLLM and SGLang views ---------------------------------------------------------

    async def server_load(self, request: web.Request) -> web.Response:
        """vLLM's `/load`: requests the server holds now."""
        return web.json_response({"server_load": len(self.live.requests)})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM's `/kv_event_sources`: the KV-event publisher's settings by DP rank."""
        pub = self.live.publisher
        source = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
                  "replay_endpoint": pub.replay_endpoint, "topic": pub.topic.decode()}  # fmt: skip
        return web.json_response({"0": source})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/server_info`: the server's settings. sglang-router names a worker's model
        after `served_model_name` (else `model_path`); without it, requests that name the model
        find no worker."""
        s, model = self.settings, self.live.model
        return web.json_response(
            {
                "model_path": s.model,
                "tokenizer_path": s.tokenizer,
                "served_model_name": s.model,
                "dp_size": 1,
                "page_size": model.block_size,
                "context_length": model.max_model_len,
                "max_total_num_tokens": model.capacity_blocks * model.block_size,
                "max_running_requests": s.max_running,
                "chunked_prefill_size": s.chunk_tokens,
                "version": "kvsched-sim",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's `/model_info`: what the served model is (a text generator)."""
        s = self.settings
        return web.json_response(
            {
                "model_path": s.model,
                "tokenizer_path": s.tokenizer,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    # ---- kvsched views -----------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        pub = self.live.publisher
        return web.json_response(
            {
                "instance_id": self.settings.instance_id,
                "model": self.settings.model,
                "role": self.settings.role.value,
                "block_size": self.live.model.block_size,
                "capacity_blocks": self.live.model.capacity_blocks,
                "max_model_len": self.live.model.max_model_len,
                "kv_events": {
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "topic": pub.topic.decode(),
                    "shape": pub.shape,
                },
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        """`Engine.report()`: the load a scheduler reads (seconds are model seconds), and the
        part of the pending prefill still queued, not admitted (for the hotspot index)."""
        r = self.live.engine.report()
        body: dict[str, object] = {
            "pending_prefill_tokens": r.pending_prefill_tokens,
            "pending_prefill_s": r.pending_prefill_s,
            "queued_prefill_s": self.live.engine.queued_s,
            "waiting": r.waiting,
            "running": r.running,
            "decode_tokens": r.decode_tokens,
            "free_blocks": r.free_blocks,
        }
        if self.adapters is not None:  # the adapters held, and those its requests run with
            held = sorted(self.adapters.paths)
            body["adapters"] = {"capacity": self.adapters.capacity, "held": held,
                                "busy": self._busy_adapters()}  # fmt: skip
        return web.json_response(body)

    def _busy_adapters(self) -> list[str]:
        """The adapters of the requests in the engine."""
        return sorted({r.adapter[0] for r in self.live.requests.values() if r.adapter})

    async def snapshot(self, request: web.Request) -> web.Response:
        """Every cached block; events from `next_seq` on apply on top of it."""
        return web.json_response(
            {
                "next_seq": self.live.publisher.next_seq,
                "block_size": self.live.model.block_size,
                "blocks": self.live.snapshot(),
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        """The engine model's cumulative step counters (model seconds), as the simulator's
        report reads them from its engines."""
        e = self.live.engine
        keys = ("busy_s", "kv_area", "batch_area", "passes", "decode_passes", "mixed_passes")
        return web.json_response({k: getattr(e, k) for k in keys})
