"""Placement policies, selectable by name.

A policy spec is `NAME` or `NAME:key=value,key=value` (e.g. `mooncake:colocated=1`,
`elastic:idle_migration=0`)."""

from __future__ import annotations

from collections.abc import Mapping

from kvsched.core.cluster import ClusterState
from kvsched.core.policies.affinity import Ear, Sticky
from kvsched.core.policies.base import ParamValue, Policy
from kvsched.core.policies.cache_aware import CacheAware
from kvsched.core.policies.continuum import Continuum
from kvsched.core.policies.disaggregated import Mooncake, StaticPD
from kvsched.core.policies.dynamo import Dynamo
from kvsched.core.policies.elastic import Elastic
from kvsched.core.policies.llmd import Llmd
from kvsched.core.policies.lmetric import LMetric
from kvsched.core.policies.sglang import Sglang
from kvsched.core.policies.simple import LeastLoaded, RandomChoice, RoundRobin

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        LeastLoaded,
        CacheAware,
        LMetric,
        Llmd,
        Dynamo,
        Sglang,
        Continuum,
        Mooncake,
        Sticky,
        StaticPD,
        Ear,
        Elastic,
        RandomChoice,
    )
}
# What `--policies all` compares (`random` stays available by name).
ALL_POLICIES = tuple(name for name in POLICIES if name != "random")


def parse_spec(spec: str) -> tuple[str, dict[str, ParamValue]]:
    """Split `name:key=value,...` into the policy class name and its parameters."""
    name, _, rest = spec.strip().partition(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    params: dict[str, ParamValue] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy parameter {item!r} must look like key=value")
        params[key.strip()] = _parse_value(value.strip())
    unknown = sorted(set(params) - set(POLICIES[name].defaults))
    if unknown:
        known = ", ".join(sorted(POLICIES[name].defaults)) or "none"
        raise ValueError(f"policy {name!r} has no parameter(s) {unknown}; known: {known}")
    return name, params


def _parse_value(text: str) -> ParamValue:
    lowered = text.lower()
    if lowered in {"true", "yes", "on"}:
        return True
    if lowered in {"false", "no", "off"}:
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def make_policy(
    spec: str, cluster: ClusterState, params: Mapping[str, ParamValue] | None = None
) -> Policy:
    """Build the policy named by `spec` on `cluster` (extra `params` override the spec's)."""
    name, parsed = parse_spec(spec)
    parsed.update(params or {})
    return POLICIES[name](cluster, parsed)


__all__ = ["ALL_POLICIES", "POLICIES", "Policy", "make_policy", "parse_spec"]
