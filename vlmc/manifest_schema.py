"""The manifest schema as declarative data: every field of vlmc.json typed and bounded.

The types at the top are a tiny schema language (validate a value, or emit JSON Schema); the data at
the bottom is the manifest. Adding a field is one line in the section's ``Obj({...})``; adding a
preprocessing kind is one entry in :data:`PREPROCESS_KINDS` (see docs/security.md).
``vlmc schema manifest`` prints the JSON Schema (docs/manifest.schema.json).

Policy for keys the schema does not name (another vlmc's facts, or a newer family's): known keys are
checked strictly; unknown keys in a section are accepted only as bounded :class:`Facts` (scalars,
short strings, small lists and mappings, shallow), so a package cannot smuggle unbounded work
through a key nobody reads, and a field someone adds is bounded before they declare it. Cross-field
rules (token ids below vocab_size, pipeline names listed in graphs) are in :func:`cross_check`.
"""

from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass, field
from typing import Any

from vlmc import limits
from vlmc.errors import VlmcError

# The characters str.splitlines breaks at: a key path holds the file's own keys, which may contain them.
_LINE_BREAKS = {c: repr(chr(c))[1:-1] for c in (*range(32), 0x7F, 0x85, 0x2028, 0x2029)}


class SchemaError(VlmcError):
    """A manifest value outside the schema; the message names the key path, kept to one line (control
    characters in a file's keys are shown escaped)."""

    def __init__(self, message: str) -> None:
        super().__init__(message.translate(_LINE_BREAKS))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


# ---- the schema language ------------------------------------------------------------------------
class T(abc.ABC):
    doc: str = ""

    @abc.abstractmethod
    def check(self, value: Any, path: str) -> None:
        """Raise VlmcError naming ``path`` unless ``value`` fits."""

    @abc.abstractmethod
    def json(self) -> dict:
        """This type as JSON Schema."""

    def accepts(self, value: Any) -> bool:
        try:
            self.check(value, "")
        except SchemaError:
            return False
        return True


def _doc(s: dict, doc: str) -> dict:
    if doc:
        s["description"] = doc
    return s


@dataclass(frozen=True)
class Int(T):
    min: int | None = None
    max: int | None = None
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SchemaError(f"{path} must be an integer, got {_kind(value)} {_show(value)}")
        if self.min is not None and value < self.min:
            raise SchemaError(f"{path}={_show(value)} is below the minimum {self.min}")
        if self.max is not None and value > self.max:
            raise SchemaError(f"{path}={_show(value)} is above the maximum {self.max}")

    def json(self):
        s: dict = {"type": "integer"}
        if self.min is not None:
            s["minimum"] = self.min
        if self.max is not None:
            s["maximum"] = self.max
        return _doc(s, self.doc)


@dataclass(frozen=True)
class Num(T):
    """A finite number (ints accepted); ``gt`` is an exclusive lower bound."""

    min: float | None = None
    max: float | None = None
    gt: float | None = None
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SchemaError(f"{path} must be a number, got {_kind(value)} {_show(value)}")
        if not math.isfinite(value):
            raise SchemaError(f"{path}={value} must be finite")
        if self.gt is not None and value <= self.gt:
            raise SchemaError(f"{path}={_show(value)} must be above {self.gt}")
        if self.min is not None and value < self.min:
            raise SchemaError(f"{path}={_show(value)} is below the minimum {self.min}")
        if self.max is not None and value > self.max:
            raise SchemaError(f"{path}={_show(value)} is above the maximum {self.max}")

    def json(self):
        s: dict = {"type": "number"}
        if self.min is not None:
            s["minimum"] = self.min
        if self.gt is not None:
            s["exclusiveMinimum"] = self.gt
        if self.max is not None:
            s["maximum"] = self.max
        return _doc(s, self.doc)


@dataclass(frozen=True)
class Str(T):
    max_len: int = 256
    choices: tuple[str, ...] | None = None
    pattern: str | None = None
    min_len: int = 0
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, str):
            raise SchemaError(f"{path} must be a string, got {_kind(value)} {_show(value)}")
        if self.choices is not None and value not in self.choices:
            raise SchemaError(f"{path}={_show(value)} is not one of {', '.join(self.choices)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(f"{path} must be {self.min_len} to {self.max_len} characters, got {len(value)}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise SchemaError(f"{path}={_show(value)} does not match {self.pattern}")

    def json(self):
        s: dict = {"type": "string", "maxLength": self.max_len}
        if self.min_len:
            s["minLength"] = self.min_len
        if self.choices is not None:
            s["enum"] = list(self.choices)
        if self.pattern is not None:
            s["pattern"] = f"^{self.pattern}$"
        return _doc(s, self.doc)


@dataclass(frozen=True)
class Bool(T):
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, bool):
            raise SchemaError(f"{path} must be true or false, got {_kind(value)} {_show(value)}")

    def json(self):
        return _doc({"type": "boolean"}, self.doc)


@dataclass(frozen=True)
class Null(T):
    def check(self, value, path):
        if value is not None:
            raise SchemaError(f"{path} must be null, got {_show(value)}")

    def json(self):
        return {"type": "null"}


@dataclass(frozen=True)
class OneOf(T):
    options: tuple[T, ...]
    doc: str = ""

    def check(self, value, path):
        errors = []
        for o in self.options:
            try:
                o.check(value, path)
                return
            except SchemaError as exc:
                errors.append(str(exc))
        # The closest alternative's message: the one whose type matched, else the first.
        typed = [e for e in errors if " must be " not in e or "characters" in e]
        raise SchemaError(typed[0] if typed else errors[0])

    def json(self):
        return _doc({"anyOf": [o.json() for o in self.options]}, self.doc)


def Nullable(t: T, doc: str = "") -> OneOf:
    return OneOf((t, Null()), doc)


@dataclass(frozen=True)
class List(T):
    item: T
    min_len: int = 0
    max_len: int = 4096
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, list):
            raise SchemaError(f"{path} must be a list, got {_kind(value)} {_show(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(f"{path} must have {self.min_len} to {self.max_len} items, got {len(value)}")
        for i, v in enumerate(value):
            self.item.check(v, f"{path}[{i}]")

    def json(self):
        s = {"type": "array", "items": self.item.json(), "maxItems": self.max_len}
        if self.min_len:
            s["minItems"] = self.min_len
        return _doc(s, self.doc)


@dataclass(frozen=True)
class Facts(T):
    """Open-ended JSON, bounded: depth, items per container, string length and number range."""

    depth: int = 2
    max_items: int = 256
    max_str: int = 4096
    doc: str = ""

    def check(self, value, path, depth=0):
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, int):
            if abs(value) > 2**63:
                raise SchemaError(f"{path}={_show(value)} is out of the 64-bit range")
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                raise SchemaError(f"{path}={value} must be finite")
            return
        if isinstance(value, str):
            if len(value) > self.max_str:
                raise SchemaError(f"{path} is {len(value)} characters, above the {self.max_str} limit")
            return
        if isinstance(value, (list, dict)):
            if depth >= self.depth:
                raise SchemaError(f"{path} nests deeper than {self.depth} levels")
            if len(value) > self.max_items:
                raise SchemaError(f"{path} has {len(value)} items, above the {self.max_items} limit")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                self.check(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]", depth + 1)
            return
        raise SchemaError(f"{path} has unsupported type {type(value).__name__}")

    def json(self):
        return _doc(
            {"description": f"bounded facts (depth ≤ {self.depth}, ≤ {self.max_items} items)"}, self.doc
        )


@dataclass(frozen=True)
class Req:
    """A required field (plain types in an Obj are optional)."""

    type: T


@dataclass(frozen=True)
class Obj(T):
    fields: dict[str, T | Req] = field(default_factory=dict)
    extra: T | None = Facts()  # unknown keys: None refuses them
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(f"{path} must be an object, got {_kind(value)} {_show(value)}")
        for k, f in self.fields.items():
            t = f.type if isinstance(f, Req) else f
            if k not in value:
                if isinstance(f, Req):
                    raise SchemaError(f"{_join(path, k)} is missing")
                continue
            t.check(value[k], _join(path, k))
        for k, v in value.items():
            if k in self.fields:
                continue
            if self.extra is None:
                raise SchemaError(f"{_join(path, k)} is not a known key ({', '.join(self.fields)})")
            if len(k) > 128:
                raise SchemaError(f"{path} has a key longer than 128 characters")
            self.extra.check(v, _join(path, k))

    def json(self):
        s: dict = {
            "type": "object",
            "properties": {k: (f.type if isinstance(f, Req) else f).json() for k, f in self.fields.items()},
        }
        req = [k for k, f in self.fields.items() if isinstance(f, Req)]
        if req:
            s["required"] = req
        s["additionalProperties"] = False if self.extra is None else self.extra.json()
        return _doc(s, self.doc)


@dataclass(frozen=True)
class Map(T):
    """A mapping from names (matching ``key``) to values of one type."""

    value: T
    key: str = r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}"
    max_items: int = 256
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(f"{path} must be an object, got {_kind(value)} {_show(value)}")
        if len(value) > self.max_items:
            raise SchemaError(f"{path} has {len(value)} entries, above the {self.max_items} limit")
        for k, v in value.items():
            if not re.fullmatch(self.key, k):
                raise SchemaError(f"{path} key {_show(k)} is not a plain name ({self.key})")
            self.value.check(v, _join(path, k))

    def json(self):
        return _doc(
            {
                "type": "object",
                "propertyNames": {"pattern": f"^{self.key}$"},
                "additionalProperties": self.value.json(),
                "maxProperties": self.max_items,
            },
            self.doc,
        )


@dataclass(frozen=True)
class ByKind(T):
    """An object whose ``kind`` selects its fields; an unknown kind gets only bounded facts."""

    kinds: dict[str, Obj]
    common: dict[str, T | Req]
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(f"{path} must be an object, got {_kind(value)} {_show(value)}")
        kind = value.get("kind")
        extra = self.kinds.get(kind) if isinstance(kind, str) else None
        Obj({**self.common, **(extra.fields if extra else {})}, SCALAR_FACTS).check(value, path)

    def json(self):
        return _doc(
            {
                "anyOf": [
                    Obj({**self.common, "kind": Str(choices=(k,)), **o.fields}, SCALAR_FACTS).json()
                    for k, o in self.kinds.items()
                ]
                + [Obj(self.common, SCALAR_FACTS).json()]
            },
            self.doc,
        )


@dataclass(frozen=True)
class Tagged(T):
    """An object whose ``key`` (a required tag) selects one of several object types; other tags are refused."""

    key: str
    variants: dict[str, Obj]
    doc: str = ""

    def check(self, value, path):
        if not isinstance(value, dict):
            raise SchemaError(f"{path} must be an object, got {_kind(value)} {_show(value)}")
        tag = value.get(self.key)
        if not isinstance(tag, str) or tag not in self.variants:
            raise SchemaError(
                f"{_join(path, self.key)}={_show(tag)} is not one of {', '.join(self.variants)}"
            )
        self.variants[tag].check(value, path)

    def json(self):
        return _doc(
            {
                "oneOf": [
                    {**o.json(), "required": sorted({self.key, *o.json().get("required", [])})}
                    for o in self.variants.values()
                ]
            },
            self.doc,
        )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ---- building blocks ----------------------------------------------------------------------------
# Unknown keys of family sections (vision, text, kv, preprocess, a graph entry): scalars, short strings,
# and lists/mappings of those, one level deep.
SCALAR_FACTS = Facts(depth=2, max_items=4096, max_str=4096)
NAME = r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}"  # graph names: no '/', never leading '.'
FILE_NAME = Str(
    255, pattern=r"[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,254}", doc="a plain file name inside the package"
)
REL_PATH = Str(
    1024,
    pattern=r"(?!/)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9_.@+/ -]+",
    min_len=1,
    doc="a relative path inside the package (resolved with symlinks followed; must stay inside)",
)
TOKEN_ID = Int(0, limits.MAX_VOCAB - 1, doc="a token id (below text.vocab_size)")
SIDE = Int(1, limits.MAX_IMAGE_SIDE, doc=f"pixels (≤ VLMC_MAX_IMAGE_SIDE, default {limits.MAX_IMAGE_SIDE})")
HW = List(SIDE, 2, 2, doc="[height, width]")
POS = Int(1, limits.MAX_HIDDEN)
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "int4",
    "uint4",
    "float8_e4m3fn",
    "float8_e5m2",
)
KV_DTYPES = ("float32", "float16", "bfloat16", "int8")
ROLES = ("vision", "fusion", "embed", "decoder", "vlm")
KV_LAYOUTS = ("contiguous", "paged")
PRECISIONS = ("fp32", "fp16", "int8", "int8_weight_only", "int4_weight_only", "mixed")
RESAMPLE = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")
SYMBOL = Str(128, pattern=r"[^\x00-\x1f]{1,128}", doc="a symbolic dimension name")
DIM = OneOf((Int(0, 1 << 40), SYMBOL), "a dimension: an int or a symbol")
IO = Obj(
    {"name": Req(Str(1024, min_len=1)), "dtype": Req(Str(choices=DTYPES)), "shape": List(DIM, 0, 16)},
    SCALAR_FACTS,
)

# Preprocessing kinds: fields each kind's runtime reads (all kinds share COMMON_PREPROCESS).
COMMON_PREPROCESS: dict[str, T | Req] = {
    "kind": Str(64, doc="clip, resize, packed_patches (the runtime refuses kinds it does not know, or none)"),
    "mean": List(Num(-1e3, 1e3), 1, 4),
    "std": List(Num(gt=0, max=1e3), 1, 4, doc="per-channel divisors: positive"),
    "rescale_factor": Num(gt=0, max=1e3),
    "resample": Str(choices=RESAMPLE),
}
PREPROCESS_KINDS: dict[str, Obj] = {
    "clip": Obj({"crop_size": Req(HW), "resize_shortest_edge": Req(SIDE)}),
    "resize": Obj({"size": Req(HW)}),
    "packed_patches": Obj(
        {
            "min_pixels": Int(1, limits.MAX_IMAGE_PIXELS),
            "max_pixels": Int(1, limits.MAX_IMAGE_PIXELS, doc="≤ VLMC_MAX_IMAGE_PIXELS"),
            "patch_size": Int(1, 1024),
            "merge_size": Int(1, 64),
            "temporal_patch_size": Int(1, 64),
        }
    ),
}

GRAPH = Obj(
    {
        "file": Req(FILE_NAME),
        "role": Req(Str(choices=ROLES)),
        "precision": Req(Str(choices=PRECISIONS)),
        "inputs": Req(List(IO)),
        "outputs": Req(List(IO)),
        "weights_file": FILE_NAME,
        "kv_layers": List(Int(0, limits.MAX_LAYERS), 2, 2),
        "quantization": Facts(depth=6, max_items=1 << 20),
        "stages": Facts(depth=12, max_items=1 << 20),
        "pipeline": Facts(depth=12, max_items=1 << 20),
    },
    Facts(depth=4, max_items=4096),
)

# The tensor_parallel pass's section (passes/tensor_parallel.py, docs/tensor_parallel.md).
_GRAPH_NAME = Str(128, pattern=NAME)
TP_PLAN_STEP = Tagged(
    "step",
    {
        "segment": Obj(
            {
                "step": Req(Str(choices=("segment",))),
                "graphs": Req(List(_GRAPH_NAME, 2, limits.MAX_HEADS, doc="the segment's graph on each rank")),
                "index": Int(0, 1 << 20),
                "kind": Str(64),
                "layer": Int(0, limits.MAX_LAYERS),
            },
            SCALAR_FACTS,
        ),
        "all_reduce": Obj(
            {
                "step": Req(Str(choices=("all_reduce",))),
                "op": Req(Str(choices=("sum",))),
                "input": Req(Str(1024, min_len=1, doc="an output of the segment before")),
                "output": Req(Str(1024, min_len=1, doc="an input of the segment after")),
                "after": Str(256),
            },
            SCALAR_FACTS,
        ),
    },
)
TENSOR_PARALLEL = Obj(
    {
        "size": Req(Int(2, limits.MAX_HEADS, doc="ranks: an integer ≥ 2 that divides the attention heads")),
        "heads": Req(Int(1, limits.MAX_HEADS)),
        "heads_per_rank": Req(Int(1, limits.MAX_HEADS)),
        "kv_heads": Req(Int(1, limits.MAX_HEADS)),
        "kv_heads_per_rank": Req(Int(1, limits.MAX_HEADS)),
        "kv": Req(Str(choices=("split", "replicated"))),
        "kv_heads_of_rank": List(
            List(Int(0, limits.MAX_HEADS - 1), 1, limits.MAX_HEADS), 2, limits.MAX_HEADS
        ),
        "intermediate_per_rank": Int(1, 4 * limits.MAX_HIDDEN),
        "replicated": List(Str(256), 0, 64),
        "source_graph": _GRAPH_NAME,
        "collective": Facts(depth=2),
        "plan": Req(List(TP_PLAN_STEP, 1, 1 << 16)),
    },
    Facts(depth=4),
)

MANIFEST = Obj(
    {
        "format_version": Req(Int(1, 1)),
        "vlmc_version": Str(64),
        "model": Req(
            Obj(
                {
                    "family": Req(Str(64, min_len=1)),
                    "architecture": Req(Str(256)),
                    "source": Req(Str(4096)),
                    "config_hash": Req(Str(256)),
                }
            )
        ),
        "vision": Req(
            Obj(
                {
                    "image_size": Req(Nullable(HW)),
                    "tokens_per_image": Req(Nullable(Int(1, limits.MAX_TOKENS_PER_IMAGE))),
                    "image_token_id": Req(TOKEN_ID),
                    "preprocess": Req(ByKind(PREPROCESS_KINDS, COMMON_PREPROCESS)),
                    "hidden_size": POS,
                    "vision_hidden_size": POS,
                    "patch_grid": List(Int(1, 4096), 2, 2),
                    "patch_size": Int(1, 1024),
                    "spatial_merge_size": Int(1, 64),
                    "temporal_patch_size": Int(1, 64),
                    "num_query_tokens": Int(1, limits.MAX_TOKENS_PER_IMAGE),
                    "feature_layer": OneOf(
                        (
                            Int(-limits.MAX_LAYERS, limits.MAX_LAYERS),
                            List(Int(-limits.MAX_LAYERS, limits.MAX_LAYERS), 1, 64),
                        )
                    ),
                    "has_cls_token": Bool(),
                    "packed_features": Bool(),
                    "dynamic_resolution": Bool(),
                    # groups lists every feature token's patches: 4096 for Gemma3's 256 pooled tokens, 576 for
                    # Phi-3-vision's 144 merged ones
                    "attention": Nullable(Facts(depth=2, max_items=1 << 16)),
                    "pruning": Facts(depth=3),
                },
                SCALAR_FACTS,
            )
        ),
        "text": Req(
            Obj(
                {
                    "vocab_size": Req(Int(1, limits.MAX_VOCAB)),
                    # null: the model has no usable EOS and generation stops at max_new_tokens; a present id must
                    # still be one of the vocabulary (cross_check).
                    "eos_token_id": Req(OneOf((TOKEN_ID, List(TOKEN_ID, 1, 64), Null()))),
                    "pad_token_id": Nullable(TOKEN_ID),
                    "bos_token_id": Nullable(TOKEN_ID),
                    "max_positions": Int(1, limits.MAX_POSITIONS),
                    "hidden_size": POS,
                    "intermediate_size": Int(1, 4 * limits.MAX_HIDDEN),
                    "tokenizer": Str(choices=("source", "bytes")),
                    "prompt_template": Str(65536),
                    "image_marker": Str(64, min_len=1),
                    "add_bos": Bool(),
                    "tokenizer_file": REL_PATH,
                    "chat_template": REL_PATH,
                    "special_tokens": Map(Str(1024), key=r"[A-Za-z0-9_]{1,64}", max_items=64),
                    "position": Str(64, doc="1d, mrope (the runtime refuses kinds it does not know)"),
                    "mrope_section": List(Int(0, 4096), 1, 8),
                    "image_tokens_first": Bool(),
                    "token_type_ids": Str(128),
                },
                SCALAR_FACTS,
            )
        ),
        "kv": Req(
            Obj(
                {
                    "layers": Req(Int(1, limits.MAX_LAYERS)),
                    "kv_heads": Req(Int(1, limits.MAX_HEADS)),
                    "head_dim": Req(Int(1, 4096)),
                    "layout": Req(Str(choices=KV_LAYOUTS)),
                    "block_size": Nullable(Int(1, 65536)),
                    "dtype": Str(choices=KV_DTYPES),
                    "num_blocks": OneOf((Int(1, 1 << 24), SYMBOL)),
                    "padding_slot": Str(4096, doc="the rule for padding slots (text)"),
                    "context_lens": Str(4096, doc="the rule for context lengths (text)"),
                },
                SCALAR_FACTS,
            )
        ),
        "graphs": Req(Map(GRAPH, key=NAME, max_items=1024)),
        "pipeline": Req(
            Obj(
                {
                    "image": List(Nullable(Str(128, pattern=NAME)), 0, 64),
                    "embed": Nullable(Str(128, pattern=NAME)),
                    "decoder": List(Nullable(Str(128, pattern=NAME)), 0, 1024),
                    "vlm": Nullable(Str(128, pattern=NAME)),
                },
                Facts(depth=2),
            )
        ),
        "tensor_parallel": Nullable(TENSOR_PARALLEL),
        "history": List(
            Obj(
                {
                    "pass": Req(Str(128)),
                    "index": Int(0, 1 << 20),
                    "modified": Bool(),
                    "options": Facts(depth=8, max_items=1 << 20),
                    "report": Facts(depth=12, max_items=1 << 20, max_str=65536),
                },
                Facts(depth=8, max_items=65536),
            ),
            0,
            1024,
        ),
    },
    # Sections other engineers add (tensor_parallel, a host plan, ...): bounded until declared here.
    Facts(depth=8, max_items=65536),
)


def cross_check(m: dict, where: str) -> None:
    """Rules across fields: an image path in the pipeline; every ``*_token_id`` fact of vision and text is
    below text.vocab_size (pipeline names are checked against graphs in vlmc.manifest.validate)."""
    vocab = m["text"]["vocab_size"]
    for section in ("vision", "text"):
        for key, value in m[section].items():
            if not key.endswith("_token_id"):
                continue
            for v in value if isinstance(value, list) else [value]:
                if v is None:
                    continue
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab:
                    raise VlmcError(
                        f"{where}: {section}.{key}={_show(v)} is not a token id of the vocabulary "
                        f"(0 to {vocab - 1}, text.vocab_size)"
                    )


def _tp_cross_check(m: dict, where: str) -> None:
    """The tensor-parallel split against the heads, and the host plan against the graphs it names."""
    tp = m["tensor_parallel"]
    size, heads, kv_heads = tp["size"], tp["heads"], tp["kv_heads"]
    at = f"{where}: tensor_parallel"
    if heads % size:
        raise VlmcError(
            f"{at}.size {size} does not divide the {heads} attention heads (tensor_parallel.heads)"
        )
    if tp["heads_per_rank"] * size != heads:
        raise VlmcError(f"{at}.heads_per_rank {tp['heads_per_rank']} is not {heads} heads over {size} ranks")
    if kv_heads != m["kv"]["kv_heads"]:
        raise VlmcError(f"{at}.kv_heads {kv_heads} is not kv.kv_heads {m['kv']['kv_heads']}")
    per_rank = kv_heads // size if tp["kv"] == "split" else 1
    if tp["kv"] == "split" and kv_heads % size or tp["kv_heads_per_rank"] != per_rank:
        raise VlmcError(
            f"{at}.kv_heads_per_rank {tp['kv_heads_per_rank']} does not split {kv_heads} KV heads "
            f"over {size} ranks ({tp['kv']})"
        )
    if "kv_heads_of_rank" in tp and len(tp["kv_heads_of_rank"]) != size:
        raise VlmcError(f"{at}.kv_heads_of_rank has {len(tp['kv_heads_of_rank'])} entries for {size} ranks")
    graphs, plan = m["graphs"], tp["plan"]

    def names(graph: str, io: str) -> set:
        return {e["name"] for e in graphs[graph][io]}

    for s, step in enumerate(plan):
        here = f"{at}.plan[{s}]"
        if step["step"] == "segment":
            if len(step["graphs"]) != size:
                raise VlmcError(f"{here}.graphs names {len(step['graphs'])} graphs for {size} ranks")
            for r, g in enumerate(step["graphs"]):
                if g not in graphs:
                    raise VlmcError(
                        f"{here}.graphs[{r}] names graph {_show(g)}, which the manifest does not list"
                    )
                if graphs[g].get("rank", r) != r:
                    raise VlmcError(f"{here}.graphs[{r}] names {g}, a graph of rank {graphs[g]['rank']}")
            continue
        before = next((p for p in reversed(plan[:s]) if p["step"] == "segment"), None)
        after = next((p for p in plan[s + 1 :] if p["step"] == "segment"), None)
        if before is None or after is None:
            raise VlmcError(f"{here}: an all_reduce must sit between two segments")
        if step["input"] not in names(before["graphs"][0], "outputs"):
            raise VlmcError(
                f"{here}.input {_show(step['input'])} is not an output of {before['graphs'][0]}, the segment before it"
            )
        if step["output"] not in names(after["graphs"][0], "inputs"):
            raise VlmcError(
                f"{here}.output {_show(step['output'])} is not an input of {after['graphs'][0]}, the segment after it"
            )
    if plan[-1]["step"] != "segment":
        raise VlmcError(f"{at}.plan ends with an all_reduce; the last step must be a segment")


def check(m: Any, where: str) -> None:
    try:
        MANIFEST.check(m, "")
    except SchemaError as exc:
        raise VlmcError(f"{where}: {exc}") from None
    cross_check(m, where)
    if m.get("tensor_parallel") is not None:
        _tp_cross_check(m, where)


def json_schema() -> dict:
    s = MANIFEST.json()
    s.update(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://vlmc.dev/manifest.schema.json",
            "title": "vlmc package manifest (vlmc.json)",
        }
    )
    return s
