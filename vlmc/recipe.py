"""Recipes: YAML files naming the model, the passes with options, and the compile target.

Everything is validated before any work starts: unknown keys, passes and options are errors that
list the valid names; wrong types and out-of-range values name the key.
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmc import backends, errors, limits, parsing, pass_api
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

TOP_KEYS = ("model", "export", "passes", "target")
EXPORT_KEYS = ("trust_remote_code", "allow_pickle", "revision")
_COMMAND_LINE_ONLY = {
    "trust_remote_code": ("--trust-remote-code", "to run the model's own code"),
    "allow_pickle": ("--allow-pickle", "to unpickle .bin/.pt weights"),
}


@dataclass
class Step:
    """One validated pass invocation."""

    name: str
    options: dict
    index: int  # 1-based position in the recipe

    def instantiate(self) -> pass_api.Pass:
        return pass_api.get(self.name)(**self.options)


@dataclass
class Recipe:
    model: str | None = None
    export: dict = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    target: dict | None = None
    source: str = "<recipe>"

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "export": self.export,
            "passes": [{s.name: s.options} for s in self.steps],
            "target": self.target,
        }


def load(path: str | Path) -> Recipe:
    """Read and validate a recipe file: a regular file (never a FIFO or a device), size-bounded."""
    p = Path(path)
    try:
        info = p.stat()
    except OSError:
        raise VlmcError(f"recipe {p} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise VlmcError(f"recipe {p} is not a regular file")
    if info.st_size > limits.MAX_RECIPE_BYTES:
        raise VlmcError(
            f"recipe {p} is {info.st_size} bytes, above the {limits.MAX_RECIPE_BYTES}-byte limit "
            "(VLMC_MAX_RECIPE_BYTES)"
        )
    try:
        text = p.read_bytes()[: limits.MAX_RECIPE_BYTES + 1].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VlmcError(f"recipe {p} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise VlmcError(f"recipe {p} cannot be read: {exc.strerror}") from None
    return parse(text, source=str(p))


def parse(text: str, source: str = "<recipe>") -> Recipe:
    """Parse recipe YAML (the bounded safe loader: vlmc/parsing.py) and validate it."""
    data = parsing.load_yaml(text, source)
    return from_dict(data if data is not None else {}, source)


def from_dict(data: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise VlmcError(f"{source}: a recipe must be a mapping with keys {', '.join(TOP_KEYS)}")
    for k in data:
        if k not in TOP_KEYS:
            raise VlmcError(f"{source}: unknown key {_show(k)}; valid keys: {', '.join(TOP_KEYS)}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise VlmcError(f"{source}: model must be a string (hub id, local directory or built-in name)")
    export = data.get("export") or {}
    if not isinstance(export, dict):
        raise VlmcError(f"{source}: export must be a mapping")
    for k, v in export.items():
        if k not in EXPORT_KEYS:
            raise VlmcError(f"{source}: export: unknown key {_show(k)}; valid keys: {', '.join(EXPORT_KEYS)}")
        if k in ("trust_remote_code", "allow_pickle") and not isinstance(v, bool):
            raise VlmcError(f"{source}: export.{k} must be true or false")
        if k in _COMMAND_LINE_ONLY and v:
            # A recipe is untrusted input (docs/security.md): running a model's code, or unpickling its
            # weights (which runs code too), needs the command line's own flag.
            flag, what = _COMMAND_LINE_ONLY[k]
            raise VlmcError(
                f"{source}: export.{k} cannot be turned on by a recipe; pass {flag} on the command line {what}"
            )
    raw_passes = data.get("passes") or []
    if not isinstance(raw_passes, list):
        raise VlmcError(f"{source}: passes must be a list")
    steps = [_step(entry, i + 1, source) for i, entry in enumerate(raw_passes)]
    target = data.get("target")
    if target is not None:
        target = backends.validate_target(target, where=f"{source}: target")
    return Recipe(model=model, export=export, steps=steps, target=target, source=source)


def _step(entry: Any, index: int, source: str) -> Step:
    where = f"{source}: pass #{index}"
    if isinstance(entry, str):
        name, opts = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, opts = next(iter(entry.items()))
        opts = {} if opts is None else opts
    else:
        raise VlmcError(f"{where}: each pass is a name or a one-key mapping {{name: {{options}}}}")
    if not isinstance(name, str):
        raise VlmcError(f"{where}: pass name must be a string")
    try:
        cls = pass_api.get(name)
    except (
        VlmcError
    ) as exc:  # unknown pass: the message lists the valid ones (the name cut to a readable length)
        shown = str(exc).replace(repr(name), _show(name))
        raise VlmcError(f"{where}: {shown}") from None
    if not isinstance(opts, dict):
        raise VlmcError(f"{where} ({name}): options must be a mapping")
    validated = cls.validate_options(opts, where=f"{where} ({name})")
    return Step(name=name, options=validated, index=index)


def _show(value: Any) -> str:
    """A recipe value inside an error line: its repr, cut to 80 characters (names can be any length)."""
    return errors.one_line(repr(value), 80)


def json_schema() -> dict:
    """JSON Schema for recipes, generated from the pass registry (docs/recipe.schema.json)."""
    pass_items = []
    for name, cls in pass_api.registry().items():
        pass_items.append({"const": name, "description": cls.summary})
        pass_items.append(
            {
                "type": "object",
                "properties": {name: {"oneOf": [cls.json_schema(), {"type": "null"}]}},
                "required": [name],
                "additionalProperties": False,
            }
        )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://vlmc.dev/recipe.schema.json",
        "title": "vlmc recipe",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "model": {
                "type": "string",
                "description": "Hugging Face hub id, local directory or built-in name",
            },
            "export": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "trust_remote_code": {
                        "const": False,
                        "description": "only false: remote code needs --trust-remote-code on the command line",
                    },
                    "allow_pickle": {
                        "const": False,
                        "description": "only false: unpickling weights needs --allow-pickle on the command line",
                    },
                    "revision": {"type": "string"},
                },
            },
            "passes": {"type": "array", "items": {"anyOf": pass_items}},
            "target": backends.target_schema(),
        },
    }
