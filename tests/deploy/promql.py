"""A small PromQL reader for the tests, so that no Prometheus binary is needed: `check` tells
whether an expression is well formed (brackets, strings, label matchers, range selectors,
known functions, aggregations and keywords), `metric_names` lists the metric names it
selects and `label_names` the labels it matches or groups by. Not a full parser: anything it
cannot place is an error (`PromqlError`), so a typo fails a test instead of slipping through.
Grafana's variables (`$namespace`, `$__rate_interval`) stand for a value or a duration."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# PromQL's functions (prometheus/promql/parser/functions.go) and aggregation operators.
_FUNCTION_NAMES = """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters
    double_exponential_smoothing hour idelta increase irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin
    sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year"""
FUNCTIONS = frozenset(_FUNCTION_NAMES.split())
AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
     "topk", "quantile", "limitk", "limit_ratio"}
)  # fmt: skip
BINARY_KEYWORDS = frozenset({"and", "or", "unless", "atan2"})
# Keywords followed by a list of label names in brackets (optional after group_*).
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
MATCH_OPERATORS = frozenset({"=", "!=", "=~", "!~"})

_DURATION = r"(?:\d+(?:ms|[smhdwy]))+|\$\{?\w+\}?"
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w.]))
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?))
  | (?P<variable>\$\{?\w+\}?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=])
  | (?P<punct>[(){},])
    """,
    re.VERBOSE,
)
_RANGE = re.compile(rf"^\[\s*(?:{_DURATION})\s*(?::\s*(?:{_DURATION})?\s*)?\]$")
_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PromqlError(ValueError):
    """An expression this reader cannot place (malformed, or an unknown function)."""


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    text: str
    at: int


def tokens(expr: str) -> list[Token]:
    """The expression's tokens, spaces left out; raises on a character no token starts with."""
    out, at = [], 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise PromqlError(f"unexpected {expr[at]!r} at {at} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            out.append(Token(kind, match.group(), at))
        at = match.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects; raises `PromqlError` where it is not well formed."""
    return set(_Reader(expr).names())


def label_names(expr: str) -> set[str]:
    """The labels `expr` matches on (`{label=...}`) or groups and joins by (`by`, `without`,
    `on`, `ignoring`, `group_left`, `group_right`)."""
    reader = _Reader(expr)
    for _ in reader.names():
        pass
    return reader.labels


def check(expr: str) -> None:
    """Raise `PromqlError` unless `expr` is well formed (as far as this reader knows)."""
    metric_names(expr)


class _Reader:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = tokens(expr)
        self.i = 0
        self.labels: set[str] = set()

    def fail(self, what: str) -> PromqlError:
        tok = self.toks[self.i] if self.i < len(self.toks) else None
        where = f"{tok.text!r} at {tok.at}" if tok else "the end"
        return PromqlError(f"{what}: {where} in {self.expr!r}")

    def peek(self, offset: int = 0) -> Token | None:
        j = self.i + offset
        return self.toks[j] if j < len(self.toks) else None

    def take(self) -> Token:
        tok = self.peek()
        if tok is None:
            raise self.fail("unexpected end")
        self.i += 1
        return tok

    def names(self) -> Iterator[str]:
        if not self.toks:
            raise PromqlError("empty expression")
        depth = 0
        while self.peek() is not None:
            tok = self.take()
            if tok.kind == "punct" and tok.text == "(":
                depth += 1
            elif tok.kind == "punct" and tok.text == ")":
                depth -= 1
                if depth < 0:
                    raise PromqlError(f"unbalanced ')' at {tok.at} in {self.expr!r}")
            elif tok.kind == "punct" and tok.text == "{":
                self.matchers()
            elif tok.kind == "punct" and tok.text == "}":
                raise PromqlError(f"unbalanced '}}' at {tok.at} in {self.expr!r}")
            elif tok.kind == "range" and not _RANGE.match(tok.text):
                raise PromqlError(f"bad range {tok.text!r} in {self.expr!r}")
            elif tok.kind == "ident":
                yield from self.identifier(tok)
        if depth:
            raise PromqlError(f"{depth} unclosed '(' in {self.expr!r}")

    def identifier(self, tok: Token) -> Iterator[str]:
        word, after = tok.text, self.peek()
        opens = after is not None and after.text == "("
        if word in GROUPING:
            if opens:
                self.label_list()
            elif word not in ("group_left", "group_right"):
                raise self.fail(f"{word} needs a list of labels")
        elif word in AGGREGATIONS:
            if not opens and not (after is not None and after.text in ("by", "without")):
                raise self.fail(f"aggregation {word} needs its argument")
        elif word in FUNCTIONS:
            if not opens:
                raise self.fail(f"function {word} needs its arguments")
        elif word == "offset":
            if after is None or after.kind not in ("duration", "variable"):
                raise self.fail("offset needs a duration")
        elif word in BINARY_KEYWORDS or word == "bool":
            pass
        elif opens:
            raise PromqlError(f"unknown function {word!r} in {self.expr!r}")
        else:
            yield word

    def label_list(self) -> None:
        self.take()  # (
        while True:
            tok = self.take()
            if tok.text == ")":
                return
            if tok.kind != "ident" or not _LABEL.match(tok.text):
                raise PromqlError(f"bad label {tok.text!r} in {self.expr!r}")
            self.labels.add(tok.text)
            sep = self.take()
            if sep.text == ")":
                return
            if sep.text != ",":
                raise PromqlError(f"expected ',' after {tok.text!r} in {self.expr!r}")

    def matchers(self) -> None:
        while True:
            label = self.take()
            if label.text == "}":
                return
            if label.kind != "ident" or not _LABEL.match(label.text):
                raise PromqlError(f"bad label {label.text!r} in {self.expr!r}")
            self.labels.add(label.text)
            op, value = self.take(), self.take()
            if op.text not in MATCH_OPERATORS:
                raise PromqlError(f"bad matcher operator {op.text!r} in {self.expr!r}")
            if value.kind != "string":
                raise PromqlError(f"a matcher's value must be a string, not {value.text!r}")
            sep = self.take()
            if sep.text == "}":
                return
            if sep.text != ",":
                raise PromqlError(f"expected ',' or '}}' after {label.text!r} in {self.expr!r}")
