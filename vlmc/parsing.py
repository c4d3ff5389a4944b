"""Bounded parsers for untrusted JSON and YAML (manifests, compile.json, rank tables, recipes): docs/security.md.

One place for the limits every structured input gets before any of it is used:

- **nesting depth** (:data:`vlmc.limits.MAX_JSON_DEPTH` levels, JSON and YAML): deeper input would
  otherwise end in RecursionError in the parser or in the first recursive reader;
- **integer digits** (:data:`vlmc.limits.MAX_INT_DIGITS`): no vlmc value needs more, and Python refuses
  to convert decimal strings past 4300 digits with a ValueError (CPython's ``int_max_str_digits``,
  https://docs.python.org/3/library/stdtypes.html#int-max-str-digits) while YAML's ``0b``/``0x`` and
  base-60 forms are not limited at all;
- **YAML aliases**: PyYAML shares the node an alias names, so ``&a [*b, *b, ...]`` chains stay small
  in memory until something walks them (a "billion laughs" bomb then takes minutes and ends in
  MemoryError). The loader counts every node as many times as aliases make a reader visit it and
  refuses a document past :data:`vlmc.limits.MAX_YAML_NODES`, or one with a recursive alias;
- NaN and Infinity are not JSON numbers.

Each refusal is one VlmcError line naming the input.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import yaml

from vlmc import limits
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


class _Refused(Exception):
    """A bound the input broke (the caller adds where)."""


def _no_constant(name: str):
    raise _Refused(f"{name} is not a JSON number")


def _int(text: str) -> int:
    digits = len(text.lstrip("+-"))
    if digits > limits.MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {limits.MAX_INT_DIGITS})")
    return int(text)


def depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0, ``[]`` is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_json(text: str | bytes, where: str, max_depth: int = limits.MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the bounds above; VlmcError ``"{where}: not valid JSON (...)"`` otherwise."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise VlmcError(f"{where}: not valid JSON (not UTF-8 at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_int)
    except json.JSONDecodeError as exc:
        raise VlmcError(f"{where}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise VlmcError(f"{where}: not valid JSON (nested too deeply)") from None
    except (_Refused, ValueError) as exc:
        raise VlmcError(f"{where}: not valid JSON ({exc})") from None
    if depth(value) > max_depth:
        raise VlmcError(f"{where}: not valid JSON (nested too deeply: more than {max_depth} levels)")
    return value


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing deep nesting, alias bombs, recursive aliases and huge integers.

    Nodes are composed in document order and an alias can only name a node composed before it (or
    one still being composed: a recursive alias), so the expanded size and depth of every node are
    known the moment it is finished: the sum over its children, each alias counted at full size.
    """

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._level = 0
        self._facts: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)

    def compose_node(self, parent, index):
        self._level += 1
        try:
            if self._level > limits.MAX_JSON_DEPTH:
                raise _Refused(f"nested deeper than {limits.MAX_JSON_DEPTH} levels")
            alias = self.check_event(yaml.AliasEvent)
            node = super().compose_node(parent, index)
        finally:
            self._level -= 1
        if alias:
            if id(node) not in self._facts:  # the node it names is still being composed
                raise _Refused("a recursive alias (a node that contains itself)")
            return node
        if isinstance(node, yaml.ScalarNode):
            size, deep = 1, 0
        else:
            children = (
                node.value if isinstance(node, yaml.SequenceNode) else [x for kv in node.value for x in kv]
            )
            size = 1 + sum(self._facts[id(c)][0] for c in children)
            deep = 1 + max((self._facts[id(c)][1] for c in children), default=0)
        if size > limits.MAX_YAML_NODES:
            raise _Refused(
                f"aliases expand it past {limits.MAX_YAML_NODES} nodes (an alias bomb?); write the values out"
            )
        if deep > limits.MAX_JSON_DEPTH:
            raise _Refused(f"aliases nest it deeper than {limits.MAX_JSON_DEPTH} levels")
        self._facts[id(node)] = (size, deep)
        return node

    def construct_yaml_int(self, node):
        text = str(node.value)
        if len(text.replace("_", "").lstrip("+-")) > limits.MAX_INT_DIGITS:
            raise _Refused(f"an integer of {len(text)} characters (at most {limits.MAX_INT_DIGITS} digits)")
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load_yaml(text: str, where: str) -> Any:
    """One YAML document through the bounded safe loader; VlmcError ``"{where}: YAML error..."`` otherwise."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader checks the characters here already
        return loader.get_single_data()
    except _Refused as exc:
        raise VlmcError(f"{where}: YAML refused: {exc}") from None
    except RecursionError:
        raise VlmcError(f"{where}: YAML refused: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "invalid YAML"
        if isinstance(exc, yaml.reader.ReaderError):
            at = f" at character {exc.position}"
        raise VlmcError(f"{where}: YAML error{at}: {problem}") from None
    except ValueError as exc:  # a float or timestamp YAML's resolver accepted but Python cannot convert
        raise VlmcError(f"{where}: YAML error: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
