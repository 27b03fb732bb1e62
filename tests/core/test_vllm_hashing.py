"""Our computation of vLLM's block hashes against vLLM's own: vectors its code produced, and
the hashes a real vLLM server published in its KV events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvsched.core.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, event_hash

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm"
VECTORS = json.loads((DATA / "block_hashes.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "v",
    VECTORS,
    ids=lambda v: f"{v['algo']}-{v['seed']}-{bool(v['cache_salt'])}-{bool(v['adapter'])}",
)
def test_hashes_equal_vllms_for_every_algorithm_seed_salt_and_adapter(v: dict[str, Any]) -> None:
    hasher = VllmBlockHasher(v["block_size"], v["algo"], v["seed"] or DEFAULT_SEED)
    expected = [int(h) for h in v["hashes"]]
    adapter = tuple(v["adapter"]) if v["adapter"] else None
    assert hasher.hash_prompt(v["token_ids"], v["cache_salt"], adapter) == expected


def test_vectors_cover_every_algorithm_with_and_without_salt_and_an_adapter() -> None:
    seen = {(v["algo"], bool(v["cache_salt"]), bool(v["adapter"])) for v in VECTORS}
    assert len(seen) == 10


def test_an_adapter_changes_every_block_and_its_path_counts() -> None:
    tokens = list(range(96))
    base = VllmBlockHasher(32).hash_prompt(tokens)
    a = VllmBlockHasher(32).hash_prompt(tokens, None, ("a", "/x"))
    moved = VllmBlockHasher(32).hash_prompt(tokens, None, ("a", "/y"))
    assert len(a) == 3 and not set(base) & set(a) and not set(a) & set(moved)


def _captured_events(folder: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted((DATA / "cpu-0.32-capture" / folder).glob("*.bin")):
        frames = msgpack.unpackb(path.read_bytes())
        payload = msgpack.unpackb(frames[2], strict_map_key=False)
        events.extend(e for e in payload[1] if e["type"] == "BlockStored")
    return events


@pytest.mark.parametrize("folder", ["frames", "frames_salt", "frames_evict"])
def test_hashes_equal_what_a_real_vllm_published(folder: str) -> None:
    """Every stored block's hash, chains followed across events: the prompt so far is the
    tokens of the chain's blocks, the salt that of its first block."""
    hasher = VllmBlockHasher(32)
    prompts: dict[int, tuple[list[int], str | None]] = {}  # block hash -> (prefix, salt)
    prefix: list[int]
    checked = 0
    events = _captured_events(folder)
    for event in events:
        parent = event["parent_block_hash"]
        tokens = list(event["token_ids"])
        if parent is None:
            first = (event.get("extra_keys") or [None])[0]
            prefix, salt = [], (first[0] if first else None)
        else:
            prefix, salt = prompts[parent]
        prompt = prefix + tokens
        ours = hasher.hash_prompt(prompt, salt)[len(prefix) // 32 :]
        assert ours == list(event["block_hashes"])
        for i, h in enumerate(ours):
            prompts[h] = (prompt[: len(prefix) + 32 * (i + 1)], salt)
        checked += len(ours)
    assert checked == sum(len(e["block_hashes"]) for e in events) >= 4


def test_a_salt_or_a_seed_changes_every_hash_and_only_full_blocks_count() -> None:
    tokens = list(range(70))
    plain = VllmBlockHasher(32).hash_prompt(tokens)
    assert len(plain) == 2
    salted = VllmBlockHasher(32).hash_prompt(tokens, "tenant-a")
    assert not set(plain) & set(salted)
    assert not set(plain) & set(VllmBlockHasher(32, seed="1").hash_prompt(tokens))
    assert VllmBlockHasher(32).hash_prompt(tokens[:64]) == plain


def test_event_hashes_as_digests_or_integers_are_the_same_block() -> None:
    digest = VllmBlockHasher(16).digests(list(range(16)))[0]
    assert event_hash(digest) == VllmBlockHasher(16).hash_prompt(list(range(16)))[0]
    assert event_hash(1 << 70 | 5) == 5


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"block_size": 16, "algo": "md5"}])
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        VllmBlockHasher(**kwargs)
