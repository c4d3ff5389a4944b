"""The quantize pass's per-graph scheme: validation of the nested options and their JSON Schema."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Any

from vlmc import ascend_limits, limits
from vlmc.errors import VlmcError
from vlmc.pass_api import Option, schema_json, validate

logger = logging.getLogger(__name__)

WEIGHTS = ("fp32", "fp16", "int8", "int4")
ACTIVATIONS = ("fp32", "int8")
METHODS = ("rtn", "awq")
CALIB_METHODS = ("minmax", "percentile", "entropy")
INT4_STORAGE = ("packed", "int8")
INT4_SCALES = ("signed", "absmax")  # weight_only.int4_scales: the full signed range (NNCF) or max|w|/7
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

# The nested recipe keys, in the pass contract's one option language (vlmc.pass_api.Option): each
# type, choice and bound is written once and serves validation and the JSON Schema. ``None`` (the
# default) means "not set": the dataclasses below, or the pass-wide value, supply the default.
CALIBRATION = (
    Option("images", str, None, "directory of calibration images (default: built-in demo images)"),
    Option("prompts", list, None, "prompts paired with the images (cycled)", items=str, min_items=1),
    Option(
        "count",
        int,
        None,
        "number of calibration samples (default 32; at most VLMC_MAX_CALIBRATION_SAMPLES, "
        f"default {limits.MAX_CALIBRATION_SAMPLES}: raise it there)",
        min=1,
        max=limits.MAX_CALIBRATION_SAMPLES,
    ),
    Option("method", str, None, "activation range estimator (default minmax)", choices=CALIB_METHODS),
)
KEEP = (
    Option("op_types", list, None, "op types kept in float32", items=str),
    Option("nodes", list, None, "node names (shell-style globs) kept in float32", items=str),
)
GRAPH = (
    Option("weights", str, None, "weight precision: fp32 (leave), fp16, int8 or int4", choices=WEIGHTS),
    Option(
        "activations",
        str,
        None,
        "int8: static per-tensor activation quantization (needs weights: int8); fp32: weight-only",
        choices=ACTIVATIONS,
    ),
    Option(
        "method",
        str,
        None,
        "weight-only method: rtn (round to nearest) or "
        "awq (activation-aware per-input-channel scaling from calibration data)",
        choices=METHODS,
    ),
    Option(
        "group_size",
        int,
        None,
        "int4: input rows sharing one scale (default 128); a multiple of 32 for "
        "target ascend (NPUWeightQuantBatchMatmulV2), a multiple of 16 for target portable",
        min=32,
        multiple_of=16,
    ),
    Option(
        "activation_symmetric",
        bool,
        None,
        "int8: symmetric activations (zero point 0, AscendQuant offset 0). Default true "
        "for target ascend, false for portable; false on ascend follows AMCT's deploy form (offset on "
        "AscendQuant, bias not corrected) and is unverified on hardware",
    ),
    Option(
        "int4_storage",
        str,
        None,
        "int4 weights as packed nibbles in uint8 (two per byte; default) or one value per int8",
        choices=INT4_STORAGE,
    ),
    Option(
        "int4_scale",
        str,
        None,
        "int4 group scales: signed (default; the largest-magnitude value of each group maps to -8, "
        "the full signed range, as NNCF does; a scale is negative when that value is positive) or absmax "
        "(max|w|/7, values in [-7, 7])",
        choices=INT4_SCALES,
    ),
    Option(
        "embeddings",
        bool,
        None,
        "int8/int4 weight-only: also quantize embedding tables (a Gather of a 2-D float table, e.g. "
        "embed_tokens): int8 per row, int4 in groups of group_size along each row; only the gathered "
        "rows are dequantized (default false)",
    ),
    Option(
        "keep_io_fp32",
        bool,
        None,
        "fp16: keep graph inputs/outputs float32 (default true; false makes them float16)",
    ),
    Option(
        "op_types",
        list,
        None,
        "int8: op types whose constant-weight nodes are quantized (default MatMul, Gemm, Conv)",
        items=str,
    ),
    Option("calibration", dict, None, "calibration data for int8 activations and awq", fields=CALIBRATION),
    Option(
        "keep_fp32",
        dict,
        None,
        "ops/nodes of this graph kept in float32 (added to the pass-wide list)",
        fields=KEEP,
    ),
)


def _given(schema: tuple[Option, ...], value: Any, where: str) -> dict:
    """The keys of ``value`` that are set (not None), validated against ``schema``."""
    return {k: v for k, v in validate(schema, value, where, noun="key").items() if v is not None}


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
    int4_scale: str = "signed"
    activation_symmetric: bool = True
    target: str = "ascend"
    keep_io_fp32: bool = True
    embeddings: bool = False
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


def parse_calibration(value: Any, where: str, base: Calibration | None = None) -> Calibration:
    base = base or Calibration()
    if value is None:
        return base
    d = _given(CALIBRATION, value, where)
    return Calibration(
        images=d.get("images", base.images),
        prompts=tuple(d.get("prompts", base.prompts)),
        count=d.get("count", base.count),
        method=d.get("method", base.method),
    )


def parse_keep(value: Any, where: str) -> KeepFp32:
    if value is None:
        return KeepFp32()
    d = _given(KEEP, value, where)
    return KeepFp32(tuple(d.get("op_types", ())), tuple(d.get("nodes", ())))


def parse_graph(
    key: str, value: Any, where: str, calib: Calibration, keep: KeepFp32, target: str = "ascend"
) -> GraphScheme:
    """Validate one graph's mapping (e.g. ``{weights: int8, activations: int8}``) into a GraphScheme.

    ``target`` is the quantize pass's ``target`` option: ``ascend`` holds the scheme to the forms the
    NPU builds (symmetric activations by default, group sizes NPUWeightQuantBatchMatmulV2 accepts).
    """
    where = f"{where}: {key}"
    d = _given(GRAPH, value, where)
    if "weights" not in d:
        raise VlmcError(f"{where}: 'weights' is required (one of {', '.join(WEIGHTS)})")
    scheme = GraphScheme(
        key=key,
        weights=d["weights"],
        activations=d.get("activations", "fp32"),
        method=d.get("method", "rtn"),
        group_size=d.get("group_size", 128),
        int4_storage=d.get("int4_storage", "packed"),
        int4_scale=d.get("int4_scale", "signed"),
        activation_symmetric=d.get("activation_symmetric", target == "ascend"),
        target=target,
        keep_io_fp32=d.get("keep_io_fp32", True),
        embeddings=bool(d.get("embeddings", False)),
        op_types=tuple(d.get("op_types", DEFAULT_OP_TYPES)),
        calibration=parse_calibration(d.get("calibration"), f"{where}.calibration", calib),
        keep_fp32=keep.merged(parse_keep(d.get("keep_fp32"), f"{where}.keep_fp32")),
    )
    if scheme.activations == "int8" and scheme.weights != "int8":
        raise VlmcError(f"{where}: activations: int8 needs weights: int8 (got weights: {scheme.weights})")
    if target == "ascend" and scheme.group_size % ASCEND_GROUP_MULTIPLE:
        raise VlmcError(
            f"{where}.group_size={scheme.group_size} is refused by the NPU: NPUWeightQuantBatchMatmulV2 takes "
            f"a multiple of {ASCEND_GROUP_MULTIPLE} (e.g. {scheme.group_size // 32 * 32 or 32} or "
            f"{(scheme.group_size // 32 + 1) * 32}); use quantize target: portable for other backends"
        )
    if "int4_scale" in d and scheme.weights != "int4":
        raise VlmcError(f"{where}: int4_scale applies to weights: int4 only (got weights: {scheme.weights})")
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
    """JSON Schema of one graph's mapping (the quantize pass's extra keys)."""
    schema = schema_json(GRAPH, "per-graph scheme (key: a graph name or a role such as vision/decoder)")
    return {**schema, "required": ["weights"]}
