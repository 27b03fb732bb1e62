"""Which shape of message content a chat template expects, decided as vLLM decides it.

vLLM hands a template each message's content either as one string (text parts joined with
"\\n": the "string" format) or as the list of parts (`{"type": "text", "text": ...}`: the
"openai" format). It picks "openai" when the template loops over a message's content
(`{% for part in message['content'] %}`, directly, through a variable assigned from the
messages, or through a macro that gets the content), else "string"; a template whose syntax
tree cannot be read counts as "string". This module walks the template's syntax tree the way
vllm/renderers/hf.py (`_detect_content_format` and the helpers before it) does, so that both
pick the same format for every template.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
from jinja2 import nodes

from services.common.inference_api.model_tokenizer import jinja_template

ContentFormat = Literal["string", "openai"]
ContentFormatOption = Literal["auto", "string", "openai"]  # vLLM's `--chat-template-content-format`


@lru_cache(maxsize=32)
def content_format(source: str) -> ContentFormat:
    """The content format of the template `source` (cached per template)."""
    try:
        ast = jinja_template(source).environment.parse(source)
        next(_content_loops(ast))
    except (StopIteration, jinja2.TemplateError, _Unreadable):
        return "string"
    return "openai"


class _Unreadable(Exception):
    """A construct vLLM's walk does not follow (it then falls back to "string")."""


def _name(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _Unreadable(f"{type(node).__name__} where a variable name was expected")
    return node.name


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and (node.arg.value == key)
        )
    return isinstance(node, nodes.Getattr) and _is_var(node.node, name) and node.attr == key


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`name` (or `name.key`), possibly filtered, tested or sliced."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: nodes.Template, name: str) -> Iterator[str]:
    """`name` and every variable assigned from it (or from one of those), breadth first."""
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, current):
                target = _name(assign.target)
                yield target
                if target != current:  # `{% set x = x %}` must not loop forever
                    related.append(target)


def _message_names(root: nodes.Template) -> Iterator[str]:
    """The targets of loops over the messages (`{% for message in messages %}`)."""
    messages = list(_names_bound_to(root, "messages"))
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in messages):
            yield _name(loop.target)


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    """Loops over a message's content: over `message.content`, over a macro parameter that a
    call passes `message.content` to, or (outside macros) over a variable named `content`."""
    message_names = list(_message_names(root))

    def is_content(node: nodes.Node) -> bool:
        return any(_is_var_or_elems(node, name, "content") for name in message_names)

    content_params: dict[int, set[str]] = {}  # loop inside a macro -> the macro's content params
    loops_in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        bound: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and is_content(arg):
                    bound.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in names and is_content(kwarg.value):
                    bound.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            loops_in_macros.add(id(loop))
            if bound:
                content_params[id(loop)] = bound

    for loop in root.find_all(nodes.For):
        params = content_params.get(id(loop))
        if is_content(loop.iter) or (
            isinstance(loop.iter, nodes.Name)
            and (
                (params is not None and loop.iter.name in params)
                or (id(loop) not in loops_in_macros and loop.iter.name == "content")
            )
        ):
            _name(loop.target)  # vLLM insists on a plain loop variable here too
            yield loop
