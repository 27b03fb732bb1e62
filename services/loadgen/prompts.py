"""Prompts for trace calls: each trace block id becomes a block of real vocabulary token ids.

Traces publish block ids, not text. The simulator hashes pseudo tokens (`kvsched.core.hashing.
pseudo_tokens`); a live engine only accepts ids inside its vocabulary, so here a block id is
written in base (vocab − reserved) digits, which keeps equal ids equal and different ids
different, and the rest of the block is filler derived from the id."""

from __future__ import annotations

from kvsched.sim.traces.model import TraceCall

RESERVED = 16  # special tokens sit at the bottom of the demo vocabulary
_DIGITS = 6  # 4080**6 > 2**64: six digits name any 64-bit id


def block_tokens(block_id: int, size: int, vocab: int) -> list[int]:
    """`size` in-vocabulary tokens standing for trace block `block_id`."""
    base = vocab - RESERVED
    if size < _DIGITS and block_id >= base**size:
        raise ValueError(f"a {size}-token block cannot name id {block_id} in base {base}")
    out: list[int] = []
    rest = block_id
    for _ in range(min(size, _DIGITS)):
        rest, digit = divmod(rest, base)
        out.append(RESERVED + digit)
    seed = block_id % base
    out += [RESERVED + (seed + 7919 * i) % base for i in range(len(out), size)]
    return out


def call_prompt(call: TraceCall, size: int, vocab: int) -> list[int]:
    """The call's prompt: its full blocks, then a partial tail unique to the call."""
    tokens: list[int] = []
    for block_id in call.block_ids:
        tokens += block_tokens(block_id, size, vocab)
    tail = call.input_tokens - len(tokens)
    if tail < 0:
        return tokens[: call.input_tokens]
    base = vocab - RESERVED
    tokens += [RESERVED + (call.index * 104_729 + 31 * i + 1) % base for i in range(tail)]
    return tokens
