"""Trace readers (Mooncake, WEKA Claude Code agentic, Azure 2023), transformations and ideal
prefix-cache ceilings. Every reader produces a `Trace` of `TraceCall`s (see `model`)."""

from kvsched.sim.traces.azure import AZURE_BLOCK_TOKENS, read_azure
from kvsched.sim.traces.ceiling import Scope, ideal_apc, matched_blocks
from kvsched.sim.traces.model import Trace, TraceCall
from kvsched.sim.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvsched.sim.traces.transform import (
    FORMATS,
    cap_requests,
    detect_format,
    load,
    scale_tokens,
)
from kvsched.sim.traces.weka import WEKA_BLOCK_TOKENS, read_weka, weka_shared_prefix

__all__ = [
    "AZURE_BLOCK_TOKENS",
    "FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "WEKA_BLOCK_TOKENS",
    "Scope",
    "Trace",
    "TraceCall",
    "cap_requests",
    "detect_format",
    "ideal_apc",
    "load",
    "matched_blocks",
    "read_azure",
    "read_mooncake",
    "read_weka",
    "scale_tokens",
    "weka_shared_prefix",
]
