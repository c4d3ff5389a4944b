"""The quantize pass's per-graph scheme: validation of the nested options and their JSON Schema."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any

from vlmc import ascend_limits, limits
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

WEIGHTS = ("fp32", "fp16", "int8", "int4")
ACTIVATIONS = ("fp32", "int8")
METHODS = ("rtn", "awq")
CALIB_METHODS = ("minmax", "percentile", "entropy")
INT4_STORAGE = ("packed", "int8")
TARGETS = ("ascend", "portable")
# NPUWeightQuantBatchMatmulV2's group-size rule (vlmc/ascend_limits.py cites its source).
ASCEND_GROUP_MULTIPLE = ascend_limits.GROUP_MULTIPLE
DEFAULT_OP_TYPES = ("MatMul", "Gemm", "Conv")
DEFAULT_PROMPTS = (
    "Describe the image.",
    "What is in the picture?",
    "What colors do you see?",
    "How many shapes are there?",
    "Write a caption for this image.",
)

# Sub-key -> (python type, JSON Schema fragment). Order is the order error messages list them.
CALIB_KEYS: dict[str, tuple[type, dict]] = {
    "images": (
        str,
        {"type": "string", "description": "directory of calibration images (default: built-in demo images)"},
    ),
    "prompts": (
        list,
        {
            "type": "array",
            "items": {"type": "string"},
            "description": "prompts paired with the images (cycled)",
        },
    ),
    "count": (
        int,
        {
            "type": "integer",
            "minimum": 1,
            "maximum": limits.MAX_CALIBRATION_SAMPLES,
            "description": "number of calibration samples (default 32; at most VLMC_MAX_CALIBRATION_SAMPLES, "
            f"default {limits.MAX_CALIBRATION_SAMPLES})",
        },
    ),
    "method": (
        str,
        {"enum": list(CALIB_METHODS), "description": "activation range estimator (default minmax)"},
    ),
}
KEEP_KEYS: dict[str, tuple[type, dict]] = {
    "op_types": (
        list,
        {"type": "array", "items": {"type": "string"}, "description": "op types kept in float32"},
    ),
    "nodes": (
        list,
        {
            "type": "array",
            "items": {"type": "string"},
            "description": "node names (shell-style globs) kept in float32",
        },
    ),
}
GRAPH_KEYS: dict[str, tuple[type, dict]] = {
    "weights": (
        str,
        {"enum": list(WEIGHTS), "description": "weight precision: fp32 (leave), fp16, int8 or int4"},
    ),
    "activations": (
        str,
        {
            "enum": list(ACTIVATIONS),
            "description": "int8: static per-tensor activation "
            "quantization (needs weights: int8); fp32: weight-only",
        },
    ),
    "method": (
        str,
        {
            "enum": list(METHODS),
            "description": "weight-only method: rtn (round to nearest) or "
            "awq (activation-aware per-input-channel scaling from calibration data)",
        },
    ),
    "group_size": (
        int,
        {
            "type": "integer",
            "minimum": 32,
            "multipleOf": 16,
            "description": "int4: input rows sharing one scale (default 128); a multiple of 32 for "
            "target ascend (NPUWeightQuantBatchMatmulV2), a multiple of 16 for target portable",
        },
    ),
    "activation_symmetric": (
        bool,
        {
            "type": "boolean",
            "description": "int8: symmetric activations (zero point 0, AscendQuant offset 0). Default true "
            "for target ascend, false for portable; false on ascend follows AMCT's deploy form (offset on "
            "AscendQuant, bias not corrected) and is unverified on hardware",
        },
    ),
    "int4_storage": (
        str,
        {
            "enum": list(INT4_STORAGE),
            "description": "int4 weights as packed nibbles in uint8 "
            "(two per byte; default) or one value per int8",
        },
    ),
    "keep_io_fp32": (
        bool,
        {
            "type": "boolean",
            "description": "fp16: keep graph inputs/outputs float32 (default true; false makes them float16)",
        },
    ),
    "op_types": (
        list,
        {
            "type": "array",
            "items": {"type": "string"},
            "description": "int8: op types whose constant-weight nodes are quantized "
            "(default MatMul, Gemm, Conv)",
        },
    ),
    "calibration": (
        dict,
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: s for k, (_, s) in CALIB_KEYS.items()},
            "description": "calibration data for int8 activations and awq",
        },
    ),
    "keep_fp32": (
        dict,
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: s for k, (_, s) in KEEP_KEYS.items()},
            "description": "ops/nodes of this graph kept in float32 (added to the pass-wide list)",
        },
    ),
}


@dataclass
class Calibration:
    images: str | None = None
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    count: int = 32
    method: str = "minmax"


@dataclass
class KeepFp32:
    op_types: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()

    def merged(self, other: KeepFp32) -> KeepFp32:
        return KeepFp32(
            tuple(dict.fromkeys(self.op_types + other.op_types)),
            tuple(dict.fromkeys(self.nodes + other.nodes)),
        )

    def matches(self, node, name: str | None = None) -> bool:
        """True if a NodeProto is kept in float32 by op type or by a name glob (``name`` stands for its own)."""
        name = node.name if name is None else name
        return node.op_type in self.op_types or any(fnmatch.fnmatchcase(name, p) for p in self.nodes)

    def to_dict(self) -> dict:
        return {"op_types": list(self.op_types), "nodes": list(self.nodes)}


@dataclass
class GraphScheme:
    """What to do with one graph (or all graphs of a role)."""

    key: str
    weights: str
    activations: str = "fp32"
    method: str = "rtn"
    group_size: int = 128
    int4_storage: str = "packed"
    activation_symmetric: bool = True
    target: str = "ascend"
    keep_io_fp32: bool = True
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    calibration: Calibration = field(default_factory=Calibration)
    keep_fp32: KeepFp32 = field(default_factory=KeepFp32)

    @property
    def mode(self) -> str:
        """The manifest precision this scheme produces."""
        if self.weights == "int8":
            return "int8" if self.activations == "int8" else "int8_weight_only"
        if self.weights == "int4":
            return "int4_weight_only"
        return self.weights

    @property
    def needs_calibration(self) -> bool:
        return self.mode == "int8" or (self.weights in ("int8", "int4") and self.method == "awq")


def _check_keys(value: Any, keys: dict, where: str) -> dict:
    if not isinstance(value, dict):
        raise VlmcError(f"{where} must be a mapping with keys {', '.join(keys)}")
    for k, v in value.items():
        if k not in keys:
            raise VlmcError(f"{where}: unknown key {k!r}; valid keys: {', '.join(keys)}")
        t, schema = keys[k]
        ok = isinstance(v, t) and not (t is int and isinstance(v, bool))
        if not ok:
            raise VlmcError(f"{where}.{k} must be {schema.get('type', 'a string')}, got {v!r}")
        if "enum" in schema and v not in schema["enum"]:
            raise VlmcError(f"{where}.{k}={v!r} is not one of {', '.join(schema['enum'])}")
        if t is list and not all(isinstance(x, str) for x in v):
            raise VlmcError(f"{where}.{k} must be a list of strings")
    return value


def parse_calibration(value: Any, where: str, base: Calibration | None = None) -> Calibration:
    base = base or Calibration()
    if value is None:
        return base
    d = _check_keys(value, CALIB_KEYS, where)
    if "count" in d and d["count"] < 1:
        raise VlmcError(f"{where}.count must be at least 1, got {d['count']}")
    if "count" in d and d["count"] > limits.MAX_CALIBRATION_SAMPLES:
        raise VlmcError(
            f"{where}.count={d['count']} is above the maximum {limits.MAX_CALIBRATION_SAMPLES} "
            "(raise it with VLMC_MAX_CALIBRATION_SAMPLES)"
        )
    if "prompts" in d and not d["prompts"]:
        raise VlmcError(f"{where}.prompts must name at least one prompt")
    return Calibration(
        images=d.get("images", base.images),
        prompts=tuple(d.get("prompts", base.prompts)),
        count=d.get("count", base.count),
        method=d.get("method", base.method),
    )


def parse_keep(value: Any, where: str) -> KeepFp32:
    if value is None:
        return KeepFp32()
    d = _check_keys(value, KEEP_KEYS, where)
    return KeepFp32(tuple(d.get("op_types", ())), tuple(d.get("nodes", ())))


def parse_graph(
    key: str, value: Any, where: str, calib: Calibration, keep: KeepFp32, target: str = "ascend"
) -> GraphScheme:
    """Validate one graph's mapping (e.g. ``{weights: int8, activations: int8}``) into a GraphScheme.

    ``target`` is the quantize pass's ``target`` option: ``ascend`` holds the scheme to the forms the
    NPU builds (symmetric activations by default, group sizes NPUWeightQuantBatchMatmulV2 accepts).
    """
    where = f"{where}: {key}"
    d = _check_keys(value, GRAPH_KEYS, where)
    if "weights" not in d:
        raise VlmcError(f"{where}: 'weights' is required (one of {', '.join(WEIGHTS)})")
    scheme = GraphScheme(
        key=key,
        weights=d["weights"],
        activations=d.get("activations", "fp32"),
        method=d.get("method", "rtn"),
        group_size=d.get("group_size", 128),
        int4_storage=d.get("int4_storage", "packed"),
        activation_symmetric=d.get("activation_symmetric", target == "ascend"),
        target=target,
        keep_io_fp32=d.get("keep_io_fp32", True),
        op_types=tuple(d.get("op_types", DEFAULT_OP_TYPES)),
        calibration=parse_calibration(d.get("calibration"), f"{where}.calibration", calib),
        keep_fp32=keep.merged(parse_keep(d.get("keep_fp32"), f"{where}.keep_fp32")),
    )
    if scheme.activations == "int8" and scheme.weights != "int8":
        raise VlmcError(f"{where}: activations: int8 needs weights: int8 (got weights: {scheme.weights})")
    if scheme.group_size < 32 or scheme.group_size % 16:
        raise VlmcError(f"{where}.group_size={scheme.group_size} must be a multiple of 16 and at least 32")
    if target == "ascend" and scheme.group_size % ASCEND_GROUP_MULTIPLE:
        raise VlmcError(
            f"{where}.group_size={scheme.group_size} is refused by the NPU: NPUWeightQuantBatchMatmulV2 takes "
            f"a multiple of {ASCEND_GROUP_MULTIPLE} (e.g. {scheme.group_size // 32 * 32 or 32} or "
            f"{(scheme.group_size // 32 + 1) * 32}); use quantize target: portable for other backends"
        )
    if "activation_symmetric" in d and scheme.activations != "int8":
        raise VlmcError(f"{where}: activation_symmetric applies to activations: int8 only")
    if "method" in d and scheme.weights not in ("int8", "int4"):
        raise VlmcError(
            f"{where}: method applies to int8/int4 weight-only graphs, not weights: {scheme.weights}"
        )
    if scheme.method == "awq" and scheme.activations == "int8":
        raise VlmcError(f"{where}: method: awq is for weight-only quantization; drop activations: int8")
    return scheme


def graph_schema() -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["weights"],
        "properties": {k: dict(s) for k, (_, s) in GRAPH_KEYS.items()},
        "description": "per-graph scheme (key: a graph name or a role such as vision/decoder)",
    }
