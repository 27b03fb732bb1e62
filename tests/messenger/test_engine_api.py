"""The engine's JSON answers become values, and nothing off the contract gets through."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core.load import LoadReport
from services.messenger.engine_api import (
    EngineMalformed,
    parse_info,
    parse_load,
    parse_snapshot,
)

INFO = {
    "instance_id": "node-0/e0",
    "model": "m",
    "role": "both",
    "block_size": 16,
    "capacity_blocks": 1024,
    "kv_events": {
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": None,
        "topic": "kv-events",
        "shape": "map",
    },
}
LOAD = {
    "pending_prefill_tokens": 10,
    "pending_prefill_s": 0.5,
    "waiting": 1,
    "running": 2,
    "decode_tokens": 30,
    "free_blocks": 7,
}


def block(h: int, parent: int | None, first: int, extra: Any = None) -> dict[str, Any]:
    return {
        "block_hash": h,
        "parent_block_hash": parent,
        "token_ids": list(range(first, first + 16)),
        "extra_keys": extra,
        "medium": "GPU",
    }


def test_info_and_load_parse() -> None:
    info = parse_info(INFO)
    assert (info.instance_id, info.block_size, info.role) == ("node-0/e0", 16, "both")
    assert info.kv_events.replay_endpoint is None and info.kv_events.topic == "kv-events"
    assert parse_load(LOAD) == LoadReport(10, 0.5, 1, 2, 30, 7)


@pytest.mark.parametrize(
    "change",
    [
        {"instance_id": ""},
        {"block_size": 0},
        {"block_size": "16"},
        {"role": "boss"},
        {"kv_events": {"endpoint": "http://x"}},
        {"kv_events": None},
    ],
)
def test_info_off_the_contract_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(EngineMalformed):
        parse_info({**INFO, **change})


@pytest.mark.parametrize(
    "change",
    [
        {"waiting": -1},
        {"running": True},
        {"pending_prefill_s": float("nan")},
        {"pending_prefill_s": "1"},
        {"free_blocks": 2**64},
    ],
)
def test_load_off_the_contract_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(EngineMalformed):
        parse_load({**LOAD, **change})
    with pytest.raises(EngineMalformed):
        parse_load([LOAD])


def test_snapshot_joins_chains_and_keeps_each_blocks_extra_keys() -> None:
    snap = parse_snapshot(
        {
            "next_seq": 9,
            "block_size": 16,
            "blocks": [
                block(1, None, 0, ["lora", "salt-a"]),
                block(2, 1, 16),
                block(3, 2, 32),
                block(4, 1, 48),  # a branch: a new event continuing block 1
                block(5, None, 64, [["salt-b"]]),  # the per-block-list form
            ],
        }
    )
    assert (snap.next_seq, snap.blocks) == (9, 5)
    assert [e.block_hashes for e in snap.events] == [(1, 2, 3), (4,), (5,)]
    assert [e.parent_block_hash for e in snap.events] == [None, 1, None]
    first = snap.events[0]
    assert first.token_ids == tuple(range(48))
    assert first.extra_keys == [["lora", "salt-a"], None, None]
    assert snap.events[2].extra_keys == [["salt-b"]]


@pytest.mark.parametrize(
    "blocks",
    [
        [{"block_hash": -1, "parent_block_hash": None, "token_ids": []}],
        [{"block_hash": 1, "parent_block_hash": "x", "token_ids": []}],
        [{"block_hash": 1, "parent_block_hash": None, "token_ids": [2**32]}],
        [{"block_hash": 1, "parent_block_hash": None, "token_ids": "abc"}],
        [{"block_hash": 1, "parent_block_hash": None, "token_ids": [], "medium": 3}],
        ["not a block"],
        "not a list",
    ],
)
def test_snapshot_off_the_contract_is_refused(blocks: Any) -> None:
    with pytest.raises(EngineMalformed):
        parse_snapshot({"next_seq": 0, "block_size": 16, "blocks": blocks})
