"""Incremental prompt ids and block hashes (`services.router.prompt_pieces` and
`session_prompts`): always exactly the ids of tokenizing the whole text and the hashes of
hashing them, for the three tokenizer families and their own chat templates, over
multi-turn chats that append, edit earlier messages and change the system prompt,
completion texts, salts and hashers; which tokens are cut points and why the others are not
(with the counterexamples that make them unsafe); the LRU bounds; concurrent calls."""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.processors import TemplateProcessing

import bench.session_prompts as bench_session_prompts
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.model_tokenizer import ModelTokenizer
from services.common.inference_api.openai_api import PromptTokenizer, parse_request
from services.router.prompt_pieces import PieceTokenizer, _trie_pattern, cut_points
from services.router.session_prompts import SessionPrompts, _common_prefix

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("demo", "qwen2", "mistral")
PATHS = {
    "demo": None,
    "qwen2": REPO / "tests/data/tokenizers/qwen2",
    "mistral": REPO / "tests/data/tokenizers/mistral",
}
TOKENIZERS = {name: PromptTokenizer(path) for name, path in PATHS.items()}
PIECES = {name: PieceTokenizer(tok.model) for name, tok in TOKENIZERS.items()}
HASHERS = (
    VllmBlockHasher(4),
    VllmBlockHasher(1, "sha256_cbor"),
    VllmBlockHasher(16, "xxhash", seed="7"),
)
SALTS = (None, "", "a", "b")
# As many examples as the profile asks (tests/conftest.py: `explore` for many more).
EXAMPLES = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every added token of the three families, and pieces of them, to put inside texts.
SPECIALS = sorted({t.content for p in PIECES.values() for t in p.tokens})
FRAGMENTS = [
    *SPECIALS, "<|im_st", "art|>", "[INST", "INST]", "</", "<s", "s>", "<|", "|>", "▁", "▁▁",
    " ", "  ", "\n", "\n\n", "\t", " \n ", "\u3000", "\xa0", "\r\n",
    "e\u0301", "\u0301", "\u0301\u0301", "ﬁ", "Å", "İ", "ß", "😀", "中文", "<0x0A>",
    "def f(x):\n    return x", '{"a": [1, 2]}', "hello", "Hello", "_x", "42", "'s",
]  # fmt: skip
texts = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(st.characters(exclude_categories=["Cs"]), max_size=8),
    ),
    max_size=10,
).map("".join)


def modified(model: ModelTokenizer, backend: Tokenizer | None) -> ModelTokenizer:
    """A copy of `model` that tokenizes with `backend` (None: as a Python tokenizer)."""
    out = copy.copy(model)
    out.backend = backend
    return out


def with_added_flags(model: ModelTokenizer, **flags: dict[str, bool]) -> ModelTokenizer:
    """A copy of `model` whose added tokens named in `flags` have those flags."""
    assert model.backend is not None
    spec = json.loads(model.backend.to_str())
    for added in spec["added_tokens"]:
        added.update(flags.get(added["content"], {}))
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.encode_special_tokens = False
    return modified(model, backend)


_ORACLES: dict[str, Tokenizer] = {}


def hf_matches(backend: Tokenizer, text: str) -> list[tuple[int, str]]:
    """Where tokenizers itself matches `backend`'s raw (not normalized) added tokens in
    `text`: a tokenizer with the same added tokens and nothing else (each split between
    them one unknown word) reports their offsets."""
    spec = backend.to_str()
    oracle = _ORACLES.get(spec)
    if oracle is None:
        oracle = Tokenizer(WordLevel({"\x00": 0}, unk_token="\x00"))
        raw = [a for a in json.loads(spec)["added_tokens"] if not a["normalized"]]
        oracle.add_tokens(
            [
                AddedToken(
                    a["content"], single_word=a["single_word"], lstrip=a["lstrip"],
                    rstrip=a["rstrip"], normalized=False, special=a["special"],
                )
                for a in raw
            ]
        )  # fmt: skip
        _ORACLES[spec] = oracle
    got = oracle.encode(text, add_special_tokens=False)
    return [
        (start, text[start:end]) for i, (start, end) in zip(got.ids, got.offsets, strict=True) if i
    ]


def check(  # noqa: PLR0917
    prompts: SessionPrompts,
    key: str | None,
    text: str,
    flag: bool,
    hasher: VllmBlockHasher,
    salt: str | None,
) -> list[int]:
    """Assert `prompts`' ids and hashes for `text` are the whole path's; return the ids."""
    ids, hashes = prompts.ids_and_hashes(key, text, flag, hasher, salt)
    expected = prompts.tokenizer.model.encode(text, flag)
    assert list(ids) == expected
    assert list(hashes) == hasher.hash_prompt(expected, salt)
    return list(ids)


# -- which tokens are cut points ------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "safe"),
    [
        ("demo", ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>",
                  "<|assistant|>"]),
        ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                   "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                   "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                   "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                   "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                   "<|repo_name|>", "<|file_sep|>"]),
        ("mistral", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                     "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                     "[/TOOL_RESULTS]"]),
    ],
)  # fmt: skip
def test_cut_point_table(family: str, safe: list[str]) -> None:
    table = cut_points(TOKENIZERS[family].model)
    assert [t.content for t in table] == safe  # every added token, in id order
    assert all(t.safe and t.reason == "" for t in table)
    assert PIECES[family].cuts


def test_affixes_are_the_post_processors_ids() -> None:
    assert PIECES["demo"].affixes(True) == ((0,), ())  # <|begin_of_text|>
    assert PIECES["qwen2"].affixes(True) == ((), ())  # Qwen2 adds no BOS
    assert PIECES["mistral"].affixes(True) == ((1,), ())  # <s>
    assert all(p.affixes(False) == ((), ()) for p in PIECES.values())


def test_unsafe_tokens_are_named_and_why() -> None:
    model = with_added_flags(
        TOKENIZERS["qwen2"].model,
        **{
            "<|im_start|>": {"lstrip": True},
            "<|im_end|>": {"single_word": True},
            "<|endoftext|>": {"normalized": True},
        },
    )
    reasons = {t.content: t.reason for t in cut_points(model)}
    assert reasons["<|im_start|>"].startswith("lstrip")
    assert reasons["<|im_end|>"].startswith("single_word")
    assert reasons["<|endoftext|>"].startswith("normalized")
    assert reasons["<tool_call>"] == ""  # "<" is no word character: still safe


def test_a_word_token_is_unsafe_next_to_single_word_ones() -> None:
    model = TOKENIZERS["qwen2"].model
    assert model.backend is not None
    backend = Tokenizer.from_str(model.backend.to_str())
    backend.add_tokens([AddedToken("Hello", normalized=False)])
    backend.add_tokens([AddedToken("<w>", single_word=True, normalized=False)])
    reasons = {t.content: t.reason for t in cut_points(modified(model, backend))}
    assert reasons["Hello"].startswith("starts with a word character")
    assert reasons["<w>"].startswith("single_word")
    # Counterexample: "<w>" before "Hello" is no word of its own (not matched), but at the
    # end of the piece a cut before "Hello" leaves, it is.
    changed = modified(model, backend)
    assert changed.encode(" <w>Hello", False) != changed.encode(" <w>", False) + changed.encode(
        "Hello", False
    )
    assert PieceTokenizer(changed).pieces(" <w>Hello") == [" <w>Hello"]


def test_no_cuts_with_split_special_tokens_or_without_a_rust_backend() -> None:
    model = TOKENIZERS["qwen2"].model
    assert model.backend is not None
    splitting = Tokenizer.from_str(model.backend.to_str())
    splitting.encode_special_tokens = True
    for changed, reason in [
        (modified(model, splitting), "split_special_tokens is on"),
        (modified(model, None), None),
    ]:
        pieces = PieceTokenizer(changed)
        assert not pieces.cuts
        if reason is None:  # a Python tokenizer: no added tokens are read
            assert pieces.tokens == ()
        assert all(not t.safe and t.reason == reason for t in pieces.tokens)
        text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert pieces.pieces(text) == [text]
        prompts = SessionPrompts(pieces)
        for turn in (text, text + "more", text + "more<|im_end|>"):
            for flag in (False, True):
                check(prompts, "s", turn, flag, HASHERS[0], None)


def test_an_unknown_component_means_no_cuts() -> None:
    model = TOKENIZERS["mistral"].model
    assert model.backend is not None
    spec = json.loads(model.backend.to_str())
    spec["model"]["dropout"] = 0.5
    dropout = modified(model, Tokenizer.from_str(json.dumps(spec)))
    assert not PieceTokenizer(dropout).cuts
    assert cut_points(dropout)[0].reason == "BPE dropout makes ids random"


# -- the key idea and its counterexamples ---------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@given(before=texts, after=texts)
@EXAMPLES
def test_a_cut_before_a_special_token_keeps_the_ids(family: str, before: str, after: str) -> None:
    model = TOKENIZERS[family].model
    for token in (t.content for t in PIECES[family].tokens):
        text = before + token + after
        pieces = PIECES[family].pieces(text)
        assert "".join(pieces) == text
        assert PIECES[family].encode(text, True) == model.encode(text, True)
        assert PIECES[family].encode(text, False) == model.encode(text, False)


def test_metaspace_needs_the_token_at_the_start_of_the_piece() -> None:
    """Mistral's Metaspace (`prepend_scheme: first`) puts ▁ before the input's first text
    only: a piece cut right before [INST] keeps its text past offset 0, a piece cut right
    after it would not."""
    model = TOKENIZERS["mistral"].model
    assert model.encode("x[INST]y", False) == model.encode("x", False) + model.encode(
        "[INST]y", False
    )
    assert model.encode("[INST]y", False) != model.encode("[INST]", False) + model.encode(
        "y", False
    )


def test_lstrip_tokens_are_never_cut_at() -> None:
    """Counterexample: an lstrip token takes the whitespace left of it, which a cut right
    before it leaves in the previous piece."""
    model = with_added_flags(TOKENIZERS["qwen2"].model, **{"<|im_start|>": {"lstrip": True}})
    text = "hi  <|im_start|>user"
    assert model.encode(text, False) != model.encode("hi  ", False) + model.encode(
        "<|im_start|>user", False
    )
    pieces = PieceTokenizer(model)
    assert pieces.pieces(text) == [text]
    assert pieces.encode(text, False) == model.encode(text, False)


def test_single_word_tokens_are_never_cut_at() -> None:
    """Counterexample: a single_word token after a word character is not matched, but at
    the start of a piece it is."""
    model = with_added_flags(TOKENIZERS["qwen2"].model, **{"<|im_end|>": {"single_word": True}})
    text = "a<|im_end|>"
    assert model.encode(text, False) != model.encode("a", False) + model.encode("<|im_end|>", False)
    assert PieceTokenizer(model).pieces(text) == [text]


UNSAFE = PieceTokenizer(
    with_added_flags(
        TOKENIZERS["qwen2"].model,
        **{
            "<|im_start|>": {"lstrip": True, "rstrip": True},
            "<|im_end|>": {"single_word": True},
            "<|endoftext|>": {"normalized": True},
            "<tool_call>": {"rstrip": True},
        },
    )
)


@given(text=texts)
@EXAMPLES
def test_unsafe_tokens_stay_inside_pieces(text: str) -> None:
    pieces = UNSAFE
    model = pieces.model
    safe = {t.content for t in pieces.tokens if t.safe}
    assert "<|im_start|>" not in safe and "<tool_call>" in safe
    cut = pieces.pieces(text)
    assert "".join(cut) == text
    assert all(any(p.startswith(s) for s in safe) for p in cut[1:])
    for flag in (False, True):
        assert pieces.encode(text, flag) == model.encode(text, flag)


def test_a_post_processor_suffix_is_added_once() -> None:
    model = TOKENIZERS["mistral"].model
    assert model.backend is not None
    backend = Tokenizer.from_str(model.backend.to_str())
    backend.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    pieces = PieceTokenizer(modified(model, backend))
    assert pieces.affixes(True) == ((1,), (2,))
    prompts = SessionPrompts(pieces)
    text = "[INST] hi[/INST] yes</s>"
    for turn in (text, text + "[INST] more[/INST]", text + "[INST] more[/INST] ok</s>"):
        check(prompts, "s", turn, True, HASHERS[0], None)
        check(prompts, "s", turn, False, HASHERS[0], None)


# -- where cuts are found -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@given(text=texts)
@EXAMPLES
def test_cuts_are_the_tokenizers_own_matches(family: str, text: str) -> None:
    backend = TOKENIZERS[family].model.backend
    assert backend is not None
    expected = [start for start, _ in hf_matches(backend, text) if start > 0]
    assert PIECES[family]._cut_starts(text) == expected


OVERLAPPING = ["<a>", "a><b", "<a><b>", "b>", "<a", "aa", "<c>"]


def overlapped() -> PieceTokenizer:
    """Qwen2's tokenizer with added tokens that overlap ("<c>" lstrip)."""
    model = TOKENIZERS["qwen2"].model
    assert model.backend is not None
    backend = Tokenizer.from_str(model.backend.to_str())
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in OVERLAPPING[:-1]])
    backend.add_special_tokens([AddedToken("<c>", normalized=False, lstrip=True)])
    return PieceTokenizer(modified(model, backend))


OVERLAPPED = overlapped()


@given(text=st.lists(st.sampled_from([*OVERLAPPING, "a", "b", "<", ">", " "]), max_size=14)
       .map("".join))  # fmt: skip
@EXAMPLES
def test_overlapping_tokens_are_matched_leftmost_longest(text: str) -> None:
    pieces = OVERLAPPED
    backend, changed = pieces.model.backend, pieces.model
    assert backend is not None
    assert not pieces._scan.disjoint
    safe = {t.content for t in pieces.tokens if t.safe}
    expected = [s for s, content in hf_matches(backend, text) if s > 0 and content in safe]
    assert pieces._cut_starts(text) == expected
    assert pieces.encode(text, False) == changed.encode(text, False)


@given(
    tokens=st.lists(st.text("ab<", min_size=1, max_size=4), min_size=1, max_size=5, unique=True),
    text=st.text("ab<", max_size=20),
)
@EXAMPLES
def test_the_trie_pattern_is_leftmost_longest(tokens: list[str], text: str) -> None:
    got = [m.span() for m in re.finditer(_trie_pattern(tokens), text)]
    expected, at = [], 0
    while at < len(text):
        found = [t for t in tokens if text.startswith(t, at)]
        if found:
            longest = max(found, key=len)
            expected.append((at, at + len(longest)))
            at += len(longest)
        else:
            at += 1
    assert got == expected


@given(a=st.lists(st.integers(0, 2), max_size=300), b=st.lists(st.integers(0, 2), max_size=300))
@EXAMPLES
def test_common_prefix(a: list[int], b: list[int]) -> None:
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert _common_prefix(array("H", a), array("H", b), 0) == expected
    assert _common_prefix(array("H", a), array("H", b), expected // 2) == expected


# -- sessions: exactness over turns ---------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "look", "description": "Look.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip


class Chat:
    """A conversation every family's template renders: exchanges of a user message, tool
    calls with their results, and an answer (all but the last exchange answered)."""

    def __init__(self, system: str | None, user: str) -> None:
        self.system = system
        self.tools = False
        self.exchanges: list[dict[str, Any]] = [{"user": user, "calls": [], "answer": None}]

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": self.system})
        for n, ex in enumerate(self.exchanges):
            out.append({"role": "user", "content": ex["user"]})
            for m, (args, result) in enumerate(ex["calls"]):
                call = f"call_{n}_{m}"
                out.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call,
                                "type": "function",
                                "function": {"name": "look", "arguments": json.dumps({"q": args})},
                            }
                        ],
                    }
                )
                out.append({"role": "tool", "tool_call_id": call, "content": result})
            if ex["answer"] is not None:
                out.append({"role": "assistant", "content": ex["answer"]})
        return out  # fmt: skip

    def render(self, tok: PromptTokenizer) -> str:
        body: dict[str, Any] = {"messages": self.messages()}
        if self.tools:
            body["tools"] = TOOLS
        chat = parse_request("chat", body).chat
        assert chat is not None
        return tok.render_chat(chat)

    def step(self, data: st.DataObject) -> None:
        """One turn's change: a tool call, an answer and a new question, an earlier message
        edited, the system prompt or tools changed, or nothing."""
        op = data.draw(st.sampled_from(["call", "call", "next", "next", "edit", "system",
                                        "tools", "same"]))  # fmt: skip
        last = self.exchanges[-1]
        if op == "call":
            last["calls"].append((data.draw(texts), data.draw(texts)))
        elif op == "next":
            last["answer"] = data.draw(texts)
            self.exchanges.append({"user": data.draw(texts), "calls": [], "answer": None})
        elif op == "edit":
            n = data.draw(st.integers(0, len(self.exchanges) - 1))
            ex = self.exchanges[n]
            if ex["calls"] and data.draw(st.booleans()):
                m = data.draw(st.integers(0, len(ex["calls"]) - 1))
                ex["calls"][m] = (ex["calls"][m][0], data.draw(texts))
            elif ex["answer"] is not None and data.draw(st.booleans()):
                ex["answer"] = data.draw(texts)
            else:
                ex["user"] = data.draw(texts)
        elif op == "system":
            self.system = data.draw(st.none() | texts)
        elif op == "tools":
            self.tools = not self.tools


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
@EXAMPLES
def test_chat_turns_are_exact(family: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[family]
    prompts = SessionPrompts(PIECES[family])
    chat = Chat(data.draw(st.none() | texts), data.draw(texts))
    hasher = data.draw(st.sampled_from(HASHERS))
    salt = data.draw(st.sampled_from(SALTS))
    for _ in range(data.draw(st.integers(1, 8))):
        text = chat.render(tok)
        # Mostly one hasher, salt and flag per session (reuse), sometimes another.
        if data.draw(st.integers(0, 5)) == 0:
            hasher = data.draw(st.sampled_from(HASHERS))
            salt = data.draw(st.sampled_from(SALTS))
        flag = data.draw(st.integers(0, 4)) == 0
        check(prompts, "session", text, flag, hasher, salt)
        chat.step(data)


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
@EXAMPLES
def test_completion_turns_are_exact(family: str, data: st.DataObject) -> None:
    prompts = SessionPrompts(PIECES[family])
    text = data.draw(texts)
    hasher = data.draw(st.sampled_from(HASHERS))
    for _ in range(data.draw(st.integers(1, 8))):
        check(prompts, "c", text, data.draw(st.integers(0, 3)) > 0, hasher, None)
        op = data.draw(st.sampled_from(["append", "append", "edit", "cut"]))
        at = data.draw(st.integers(0, len(text)))
        if op == "append":
            text += data.draw(texts)
        elif op == "edit":
            text = text[:at] + data.draw(texts) + text[at + data.draw(st.integers(0, 5)) :]
        else:
            text = text[:at]


def agent_turns(family: str, turns: int, size: int = 600) -> list[str]:
    """A session's rendered prompts, each the previous one's plus a tool call and result."""
    tok = TOKENIZERS[family]
    rng = random.Random(family)
    chat = Chat("You are an agent.", "Fix the bug.")
    words = ["def", "return", " x", "\n", "  ", "<|im_start|>", "[INST]", "é", "\u0301", "中"]
    out = []
    for _ in range(turns):
        out.append(chat.render(tok))
        result = "".join(rng.choice(words) for _ in range(size))
        chat.exchanges[-1]["calls"].append(("look", result))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_later_turns_reuse_the_previous_turns_work(family: str) -> None:
    prompts = SessionPrompts(PIECES[family])
    hasher = VllmBlockHasher(16)
    first, second, third = agent_turns(family, 3)
    ids1 = check(prompts, "s", first, False, hasher, "salt")
    before = prompts.stats()
    ids2 = check(prompts, "s", second, False, hasher, "salt")
    after = prompts.stats()
    assert after.reused_tokens - before.reused_tokens >= len(ids1) - 40
    assert after.tokenized_tokens - before.tokenized_tokens <= len(ids2) - len(ids1) + 40
    assert after.reused_blocks - before.reused_blocks >= len(ids1) // 16 - 10
    # Another salt: the ids are reused, the hash chain is not (its first block differs).
    check(prompts, "s", third, False, hasher, "other")
    last = prompts.stats()
    assert last.reused_tokens - after.reused_tokens >= len(ids2) - 40
    assert last.reused_blocks == after.reused_blocks
    # Another hasher: none reused either; the same text again: all of it.
    ids3 = check(prompts, "s", third, False, VllmBlockHasher(8), "other")
    mid = prompts.stats()
    assert mid.reused_blocks == after.reused_blocks
    check(prompts, "s", third, False, VllmBlockHasher(8), "other")
    again = prompts.stats()
    assert again.tokenized_tokens == mid.tokenized_tokens
    assert again.reused_blocks - mid.reused_blocks >= len(ids3) // 8 - 7  # from a checkpoint
    # With BOS (add_special_tokens) the pieces are still reused (not the hash chain).
    check(prompts, "s", third, True, VllmBlockHasher(8), "other")
    assert prompts.stats().tokenized_tokens == again.tokenized_tokens


def test_a_lone_surrogate_is_a_type_error_and_changes_nothing() -> None:
    prompts = SessionPrompts(PIECES["qwen2"])
    check(prompts, "s", "<|im_start|>user\nhi", False, HASHERS[0], None)
    kept = prompts.stats()
    with pytest.raises(TypeError):
        prompts.ids_and_hashes("s", "<|im_start|>user\nhi\ud800", False, HASHERS[0], None)
    assert prompts.stats() == kept


# -- bounds and threads ---------------------------------------------------------------------


def test_the_lru_keeps_within_its_token_budget() -> None:
    pieces = PIECES["qwen2"]
    text = "<|im_start|>user\n" + "word " * 40 + "<|im_end|>"
    size = len(pieces.model.encode(text, False))
    prompts = SessionPrompts(pieces, max_tokens=2 * size + 1)
    hasher = HASHERS[0]
    for key in ("a", "b"):
        check(prompts, key, text, False, hasher, None)
    assert prompts.stats().sessions == 2
    check(prompts, "a", text, False, hasher, None)  # "a" now the most recently used
    check(prompts, "c", text, False, hasher, None)  # evicts "b", the least
    assert set(prompts._turns) == {"a", "c"}
    assert prompts.stats().tokens_kept == 2 * size
    check(prompts, "huge", text * 3, False, hasher, None)  # over the budget alone: not kept
    assert set(prompts._turns) == {"a", "c"}
    prompts.discard("a")
    prompts.discard("never")
    assert prompts.stats().sessions == 1 and prompts.stats().tokens_kept == size
    check(prompts, None, text, False, hasher, None)  # no key: nothing kept
    assert prompts.stats().sessions == 1


def test_the_lru_keeps_within_its_session_count() -> None:
    prompts = SessionPrompts(PIECES["demo"], max_sessions=3)
    for n in range(10):
        check(prompts, f"s{n}", f"<|user|>\nturn {n}", False, HASHERS[0], None)
    assert list(prompts._turns) == ["s7", "s8", "s9"]
    with pytest.raises(ValueError):
        SessionPrompts(PIECES["demo"], max_tokens=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_calls_are_exact(family: str) -> None:
    prompts = SessionPrompts(PIECES[family], max_tokens=1 << 16)
    hasher = VllmBlockHasher(16)
    sessions = {f"s{n}": agent_turns(family, 6, size=300) for n in range(3)}
    calls = [(key, text) for key, turns in sessions.items() for text in turns] * 3
    random.Random(1).shuffle(calls)  # turns of one session out of order, and at once
    expected = {t: PIECES[family].model.encode(t, False) for ts in sessions.values() for t in ts}

    def call(key_text: tuple[str, str]) -> bool:
        key, text = key_text
        ids, hashes = prompts.ids_and_hashes(key, text, False, hasher, key)
        prompts.stats()
        return list(ids) == expected[text] and list(hashes) == hasher.hash_prompt(ids, key)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(call, calls))
    assert prompts.stats().sessions == 3


def test_the_bench_runs() -> None:
    """`bench.session_prompts` on a tiny session (it checks every turn's ids itself)."""
    args = argparse.Namespace(turns=3, tokens=3000, follow_up=2, repeats=1)
    rows = bench_session_prompts.family_rows(TOKENIZERS["qwen2"], VllmBlockHasher(16), args)
    assert [row[0] for row in rows] == [1, 2, 3]
    assert rows[2][2] < rows[2][1]  # the third turn tokenized less than its whole prompt
