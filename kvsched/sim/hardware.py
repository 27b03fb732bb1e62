"""The serving hardware a replay models: `kvsched replay`'s hardware options.

Which model (its KV bytes per token and weights), which GPU (its measured latency profile), how
much KV cache each instance holds (given, or following from GPU memory by vLLM's rule), and how
fast each link class of the topology is. With no option given every figure is the shipped H100
Llama-3.1-8B cluster's, as before these options existed.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvsched.core.latency import DEFAULT_LATENCY, LatencyModel, latency_profiles, load_latency
from kvsched.core.memory import DEFAULT_UTILIZATION, GIB, GpuMemory
from kvsched.core.models import DEFAULT_MODEL, MODELS, ModelConfig, model_config
from kvsched.core.topology import DISTANCE_NAMES, LinkClass, TopologyConfig


@dataclass(frozen=True, slots=True)
class LinkSpeed:
    """A link class's speed as the user gives it; `setup_ms` None keeps the default setup."""

    distance: int  # index into DISTANCE_NAMES
    gb_per_s: float
    setup_ms: float | None = None

    def __post_init__(self) -> None:
        name = DISTANCE_NAMES[self.distance]
        if not (math.isfinite(self.gb_per_s) and self.gb_per_s > 0):
            raise ValueError(f"--link {name}: bandwidth must be positive, got {self.gb_per_s:g}")
        if self.setup_ms is not None and not (math.isfinite(self.setup_ms) and self.setup_ms >= 0):
            raise ValueError(f"--link {name}: setup must be >= 0 ms, got {self.setup_ms:g}")

    def applied_to(self, link: LinkClass) -> LinkClass:
        setup_s = link.setup_s if self.setup_ms is None else self.setup_ms / 1e3
        return LinkClass(self.gb_per_s * 1e9, setup_s)


@dataclass(frozen=True)
class HardwareOptions:
    """What a replay's instances run on. Names or JSON paths are checked by `check()`."""

    model_config: str = DEFAULT_MODEL  # built-in model name or a model config .json
    latency_profile: str = DEFAULT_LATENCY  # shipped profile name or a profile .json
    kv_capacity_tokens: int = 0  # per instance; 0: from `gpu_memory`, else the profile's
    gpu_memory: GpuMemory | None = None
    max_model_len: int = 0  # longest prompt an instance takes; 0: the model config's
    links: tuple[LinkSpeed, ...] = ()  # replace the topology's link class of each distance

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 0:
            raise ValueError(f"--kv-capacity must be positive, got {self.kv_capacity_tokens}")
        if self.kv_capacity_tokens and self.gpu_memory is not None:
            raise ValueError("--kv-capacity and --gpu-memory both set the KV capacity: give one")
        if self.max_model_len < 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        distances = [link.distance for link in self.links]
        if len(set(distances)) != len(distances):
            raise ValueError("--link names a link class twice")

    def model(self) -> ModelConfig:
        return model_config(self.model_config)

    def latency(self) -> LatencyModel:
        return load_latency(self.latency_profile)

    def capacity_tokens(self) -> int:
        """KV capacity per instance for the cluster config: 0 keeps the latency profile's."""
        if self.gpu_memory is not None:
            return self.gpu_memory.kv_capacity_tokens(self.model())
        return self.kv_capacity_tokens

    def check(self) -> None:
        """Load the model config and the profile and size the KV cache: raises ValueError
        (naming the known profiles or models, or the bad number) before any replay starts."""
        model, latency = self.model(), self.latency()
        if self.max_model_len > model.max_model_len:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds {model.name}'s context length "
                f"({model.max_model_len} tokens)"
            )
        context = self.max_model_len or model.max_model_len
        capacity = self.capacity_tokens() or latency.kv_capacity_tokens
        if capacity < context:
            # vLLM refuses to start so; an engine model left to try would never admit the
            # longest prompts (they wait for room that cannot come).
            raise ValueError(
                f"a KV capacity of {capacity} tokens per instance is below the context length "
                f"({context} tokens): lower --max-model-len, or give more KV capacity"
            )

    def topology(self, base: TopologyConfig) -> TopologyConfig:
        """`base` with the given link classes replaced (the fan-outs stay)."""
        links = list(base.links)
        for speed in self.links:
            links[speed.distance] = speed.applied_to(links[speed.distance])
        return replace(base, links=tuple(links))

    def record(self) -> dict[str, Any]:
        """The options as given and what they resolved to, for report.json's config."""
        model = self.model()
        capacity: dict[str, Any]
        if self.gpu_memory is not None:
            capacity = {
                "from": "gpu_memory",
                "gpu_memory_gib": self.gpu_memory.memory_gib,
                "gpu_memory_utilization": self.gpu_memory.utilization,
                "activation_memory_gib": self.gpu_memory.activation_gib,
                "weights_gib": model.weight_bytes / GIB,
            }
        elif self.kv_capacity_tokens:
            capacity = {"from": "kv_capacity"}
        else:
            capacity = {"from": "latency_profile"}
        capacity["tokens"] = self.capacity_tokens() or self.latency().kv_capacity_tokens
        return {
            "model_config": self.model_config,
            "latency_profile": self.latency_profile,
            "model": asdict(model),
            "kv_capacity": capacity,
            "links_given": [DISTANCE_NAMES[s.distance] for s in self.links],
        }


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    """The hardware flags, in their own group (values parsed by `hardware_from_args`, so a bad
    one is a one-line error)."""
    g = p.add_argument_group("hardware (default: one H100 per instance serving Llama-3.1-8B)")
    g.add_argument(
        "--model-config",
        metavar="NAME|PATH",
        default=DEFAULT_MODEL,
        help=f"model architecture (KV bytes per token, weights): {', '.join(sorted(MODELS))}, "
        "or a JSON file",
    )
    g.add_argument(
        "--latency-profile",
        metavar="NAME|PATH",
        default=DEFAULT_LATENCY,
        help=f"the GPU's step-time profile: {', '.join(latency_profiles())}, or a JSON file",
    )
    g.add_argument("--kv-capacity", metavar="TOKENS", help="KV cache per instance (tokens)")
    g.add_argument(
        "--gpu-memory", metavar="GIB", help="GPU memory per instance; sizes the KV cache as vLLM"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        metavar="F",
        help=f"with --gpu-memory: share vLLM may use (default {DEFAULT_UTILIZATION})",
    )
    g.add_argument(
        "--activation-memory",
        metavar="GIB",
        help="with --gpu-memory: peak activation memory vLLM reserves (default 0)",
    )
    g.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        help="longest prompt an instance takes, as vLLM's flag (default: the model config's)",
    )
    g.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="NAME=GBPS[,SETUP_MS]",
        help=f"speed of a link class ({', '.join(DISTANCE_NAMES)}); repeat for several",
    )


def hardware_from_args(args: argparse.Namespace) -> HardwareOptions:
    """The options the flags give, checked. Raises ValueError with a one-line message."""
    gpu_memory = None
    if args.gpu_memory is not None:
        gpu_memory = GpuMemory(
            _number("--gpu-memory", args.gpu_memory),
            _number("--gpu-memory-utilization", args.gpu_memory_utilization)
            if args.gpu_memory_utilization is not None
            else DEFAULT_UTILIZATION,
            _number("--activation-memory", args.activation_memory)
            if args.activation_memory is not None
            else 0.0,
        )
    elif args.gpu_memory_utilization is not None or args.activation_memory is not None:
        raise ValueError("--gpu-memory-utilization and --activation-memory apply with --gpu-memory")
    capacity = 0
    if args.kv_capacity is not None:
        capacity = _integer("--kv-capacity", args.kv_capacity)
        if capacity <= 0:
            raise ValueError(f"--kv-capacity must be positive, got {capacity}")
    max_model_len = 0
    if args.max_model_len is not None:
        max_model_len = _integer("--max-model-len", args.max_model_len)
        if max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {max_model_len}")
    options = HardwareOptions(
        model_config=args.model_config,
        latency_profile=args.latency_profile,
        kv_capacity_tokens=capacity,
        gpu_memory=gpu_memory,
        max_model_len=max_model_len,
        links=tuple(parse_link(text) for text in args.link),
    )
    options.check()
    return options


def parse_link(text: str) -> LinkSpeed:
    """`NAME=GBPS[,SETUP_MS]`, e.g. `rack=50` or `node=400,1`."""
    name, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--link takes NAME=GBPS[,SETUP_MS], got {text!r}")
    if name not in DISTANCE_NAMES:
        known = ", ".join(DISTANCE_NAMES)
        raise ValueError(f"--link: no link class {name!r}; link classes: {known}")
    gbps, _, setup = value.partition(",")
    return LinkSpeed(
        DISTANCE_NAMES.index(name),
        _number(f"--link {name}", gbps),
        _number(f"--link {name} setup", setup) if setup else None,
    )


def _number(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} takes a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{flag} takes a finite number, got {text!r}")
    return value


def _integer(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} takes a whole number of tokens, got {text!r}") from None
