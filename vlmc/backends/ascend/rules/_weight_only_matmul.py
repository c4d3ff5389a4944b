"""Rule: weight-only quantized MatMul -> NPUWeightQuantBatchMatmulV2, from the quantize pass's facts.

The quantize pass records, per MatMul, the integer weight, its scales, the axis and the group size
(``graphs[name].quantization.weights``). This rule reads them. Fitting ``(q + offset) * scale`` to the
folded weight is kept only as a fallback for QDQ/dequant graphs made by other tools (no facts).

The target op (hicann/ops-nn matmul/weight_quant_batch_matmul_v2):
* op_graph/weight_quant_batch_matmul_v2_proto.h: weight (k, n); antiquant_scale (n,) per channel or
  (ceil(k/g), n) per group, float16/bfloat16 "the same with x"; ``antiquant_group_size`` 0 or a
  multiple of 32 in [0, k-1]; y = x @ ((weight + antiquant_offset) * antiquant_scale).
* framework/npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp: reads only antiquant_group_size and
  dtype, and forces transpose_x/transpose_weight off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from vlmc import ascend_limits, ortsession
from vlmc.errors import VlmcError
from vlmc.runtime.executors import reference

from ._base import Context, NoMatch, Rule
from ._graph import Graph, as_int8, release

logger = logging.getLogger(__name__)

_WQBMM = "hicann/ops-nn matmul/weight_quant_batch_matmul_v2/"
SOURCE = "; ".join(
    (
        _WQBMM + "op_graph/weight_quant_batch_matmul_v2_proto.h (group size, dtypes, shapes)",
        _WQBMM
        + "framework/npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp (attributes read, transposes off)",
        _WQBMM + "op_host/weight_quant_batch_matmul_v2_def.cpp (910B dtypes)",
        _WQBMM + "docs/aclnnWeightQuantBatchMatmulV2.md ((weight + offset) * scale)",
    )
)
GROUP_MULTIPLE = ascend_limits.GROUP_MULTIPLE
# Group sizes the fallback fit tries (largest first). 16 and 48 are not legal on the NPU; they are
# tried so that a foreign graph quantized with them is refused by name rather than "does not fit".
FIT_GROUP_SIZES = (1024, 512, 256, 128, 64, 48, 32, 16)
_DEQUANT_OPS = frozenset({"DequantizeLinear", "Mul", "Sub", "Cast"})
# hicann/ge 14b93e226 ("atc support onnx int4") maps ONNX INT4 to DT_INT4; it is on develop, master and
# the 9.2.0-beta.2 branch but in no release tag (the latest are v9.1.0 and v9.2.0-beta.1).
INT4_RELEASE = "hicann/ge 14b93e226, which is in no CANN release tag yet (latest v9.1.0, v9.2.0-beta.1)"
INT4_NOTE = (
    "INT4 runs with INT8 storage on Ascend: the int4 values are held one per int8 (0.25x of FP32 "
    "weight bytes, the same as INT8; packed INT4 would be 0.125x). Target option int4_weights: int4 "
    f"writes ONNX INT4 instead, for an ATC whose parser maps it to DT_INT4 ({INT4_RELEASE})"
)
INT4_PACKED_NOTE = (
    "INT4 weights are written as ONNX INT4 (two per byte, 0.125x of FP32 weight bytes) in external data, "
    "which ATC parses as FileConstant (hicann/ge parser/parser/onnx/onnx_file_constant_parser.cc reads "
    "only the dtype, shape and file location; the bytes are used as written). ONNX INT4 maps to DT_INT4 "
    f"only from {INT4_RELEASE}; NPUWeightQuantBatchMatmulV2 takes DT_INT4 weights on 910B (ops-nn "
    "weight_quant_batch_matmul_v2_def.cpp). Unverified on hardware; int4_weights: int8 builds on any CANN"
)


def legal_group_size(group: int, k: int) -> bool:
    """NPUWeightQuantBatchMatmulV2: 0 (per channel) or a multiple of 32 that is at most k-1."""
    return group == 0 or (group % GROUP_MULTIPLE == 0 and 0 < group <= k - 1)


class _Unpacked:
    """The int8 (k, n) weight of quantize's packed int4 initializer, unpacked only when called.

    The lowering only needs its shape; the values are made when the build's data file is written
    (:meth:`Graph.add_deferred_init`), so each deploy weight is computed once, straight into the
    build, instead of being written to the lowering's scratch store and copied from there.
    """

    def __init__(self, source: ir.Value) -> None:
        self.source = source
        rows, cols = source.const_value.shape.numpy()
        self.shape = (2 * int(rows), int(cols))

    def __call__(self) -> np.ndarray:
        # quantize's packing: row 2i in the low nibble, row 2i+1 in the high one, each stored q+8.
        # Unpacked straight into the int8 result, so the working set is that plus one half of it.
        packed = self.source.const_value.numpy()  # memory-mapped
        q = np.empty(self.shape, np.int8)
        np.subtract((packed & 0x0F).view(np.int8), 8, out=q[0::2])
        np.subtract((packed >> 4).view(np.int8), 8, out=q[1::2])
        del packed
        release(self.source)
        return q


@dataclass
class _Lowered:
    q8: np.ndarray | _Unpacked  # int8 (k, n), or quantize's packed int4 unpacked when written
    scale: np.ndarray  # (n,) or (k/g, n), float32
    offset: np.ndarray | None  # same shape as scale, or None (symmetric)
    group: int  # antiquant_group_size
    bits: int
    source: str  # "facts" | "fit"


@dataclass
class WeightOnlyMatch:
    node: ir.Node
    nodes: list[ir.Node]  # the constant dequant subgraph
    leaves: list[ir.Value]  # its initializers
    facts: dict | None  # the quantize pass's record for this node
    lowered: _Lowered | str | None = None  # what the facts (or the fallback fit) give; str: why not


def _match(ctx: Context, node: ir.Node) -> WeightOnlyMatch | NoMatch:
    gr = ctx.graph
    weight = node.inputs[1]
    if weight.is_initializer():
        return NoMatch("the weight is a plain initializer (not quantized)")
    a = node.inputs[0].producer()
    if a is not None and a.op_type == "DequantizeLinear":
        return NoMatch("the input is a quantized activation (the qdq_matmul pattern)")
    sub = gr.const_subgraph(weight)
    if sub is None:
        return NoMatch("the weight is computed from graph inputs (activation x activation)")
    nodes, leaves = sub
    if not nodes or not any(n.op_type in _DEQUANT_OPS for n in nodes):
        return NoMatch("the weight's constant subgraph holds no dequantization")
    m = WeightOnlyMatch(node, nodes, leaves, ctx.node_facts(node))
    m.lowered = _from_facts(ctx, m)
    if m.lowered is None:
        m.lowered = _from_fit(ctx, m)
    if m.lowered is None:
        return NoMatch("the folded weight is not an integer tensor times scales")
    return m


def _from_facts(ctx: Context, m: WeightOnlyMatch) -> _Lowered | str | None:
    """The lowering read from the recorded facts; None when they do not describe this subgraph."""
    f = m.facts
    leaves = {v.name: v for v in m.leaves}
    if not f or f.get("weight") not in leaves or f.get("scale") not in leaves:
        return None
    weights = ctx.facts.get("weights") or {}
    q = leaves[f["weight"]].const_value.numpy()  # memory-mapped
    scale = leaves[f["scale"]].const_value.numpy().astype(np.float32)
    # The group size is per node when recorded there, else graph-wide (quantize writes it under weights).
    group = f.get("group_size", weights.get("group_size"))
    bits = 4 if weights.get("dtype") == "int4" else 8
    if f.get("axis", 1) != 1:
        return f"the recorded weight axis is {f.get('axis')}; only axis 1 (of [k, n]) is lowered"
    if q.dtype == np.uint8 and f.get("storage") == "packed":
        if q.ndim != 2:
            return f"the recorded weight has {q.ndim} dims, not 2"
        del q
        q = _Unpacked(leaves[f["weight"]])
    elif q.dtype != np.int8:
        return f"the recorded weight {f['weight']} is {q.dtype}, not int8 or packed int4"
    if len(q.shape) != 2:
        return f"the recorded weight has {len(q.shape)} dims, not 2"
    k, n = q.shape
    if group:
        scale = scale.reshape(-1, n)
        if scale.shape[0] * group != k:
            return f"the recorded scales ({scale.shape[0]} groups of {group}) do not cover k={k}"
    else:
        scale = scale.reshape(n)
    return _Lowered(q, scale, None, int(group or 0), bits, "facts")


def _from_fit(ctx: Context, m: WeightOnlyMatch) -> _Lowered | str | None:
    """Fallback for graphs without facts: fold the weight with onnxruntime and fit q, scale, offset."""
    node = m.node
    # Only 8-bit integer leaves can be the weight (as is, or two int4 per byte): without one there is
    # nothing to fit, and the weight is not folded (an fp16 weight behind a Cast is read for nothing).
    small_ints = (ir.DataType.INT8, ir.DataType.UINT8)
    ints = [v.const_value.numpy() for v in m.leaves if v.const_value.dtype in small_ints]
    if not ints:
        return None
    try:
        w = np.asarray(ortsession.from_model(_weight_model(ctx.graph, m)).run(None, {})[0], dtype=np.float32)
    except Exception as exc:  # onnxruntime raises its own types; a weight it cannot fold is left alone
        logger.debug("%s: weight subgraph not folded: %s", node.name, exc)
        return None
    if w.ndim != 2:
        return None
    k, n = w.shape
    big = [c for q in ints for c in _int_candidates(q, k * n)]
    if not big:
        return None
    for q in big:
        fit = _fit_antiquant(w, q)
        if fit is not None:
            q8, scale, offset, group = fit
            nibble = (q8.min() >= -8 and q8.max() <= 7) or (q8.min() >= 0 and q8.max() <= 15)
            bits = 4 if nibble else 8
            return _Lowered(q8, scale, offset, group, bits, "fit")
    return (
        "its weight-only dequantization does not reduce to (q + offset) * scale per channel or per "
        "group; vlmc cannot lower it to NPUWeightQuantBatchMatmulV2"
    )


def _weight_model(gr: Graph, m: WeightOnlyMatch) -> ir.Model:
    """The weight's constant subgraph alone, as a model onnxruntime can fold (tensors shared, not read)."""
    mapped: dict[ir.Value, ir.Value] = {}
    inits = []
    for v in m.leaves:
        mapped[v] = ir.Value(name=v.name, const_value=v.const_value, type=v.type, shape=v.shape)
        inits.append(mapped[v])
    nodes = []
    for n in m.nodes:
        copy = ir.Node(
            n.domain,
            n.op_type,
            [None if i is None else mapped[i] for i in n.inputs],
            attributes=list(n.attributes.values()),
            num_outputs=len(n.outputs),
            name=n.name,
        )
        for old, new in zip(n.outputs, copy.outputs):
            new.name = old.name
            mapped[old] = new
        nodes.append(copy)
    out = mapped[m.node.inputs[1]]
    out.type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph(
        [], [out], nodes=nodes, initializers=inits, opset_imports=dict(gr.g.opset_imports), name="w"
    )
    return ir.Model(graph, ir_version=gr.model.ir_version)


def _int_candidates(q: np.ndarray, size: int) -> list[np.ndarray]:
    """Integer weight values an initializer may hold: as is, or int4 packed two per byte (either nibble
    order, signed or unsigned), flattened to ``size`` values."""
    if q.size == size:
        return [q.reshape(-1)]
    if q.size * 2 != size:
        return []
    b = q.view(np.uint8)
    lo, hi = (b & 0x0F).astype(np.int16), (b >> 4).astype(np.int16)
    out = []
    # A byte's two nibbles are neighbours along one axis: the last (consecutive values) or, e.g. for
    # a [k/2, n] packing, rows 2i and 2i+1.
    for axis in reversed(range(b.ndim)):
        for first, second in ((lo, hi), (hi, lo)):
            u = np.stack([first, second], axis=axis + 1).reshape(-1)
            out.append(u.astype(np.int8))  # unsigned nibbles 0..15 (with a zero point)
            out.append(np.where(u >= 8, u - 16, u).astype(np.int8))  # two's-complement nibbles -8..7
    return out


def _fit_antiquant(w: np.ndarray, q_raw: np.ndarray):
    """int8 q (k, n), scale and offset with ``(q + offset) * scale == w`` per channel or per group."""
    k, n = w.shape
    layouts = [q_raw.reshape(k, n), q_raw.reshape(n, k).T.copy()]
    groups = [k] + [g for g in FIT_GROUP_SIZES if g < k and k % g == 0]
    tol = 1e-5 * max(float(np.abs(w).max()), 1e-30)
    for q in layouts:
        q8, _ = as_int8(np.ascontiguousarray(q), np.zeros(1, np.uint8 if q.dtype == np.uint8 else np.int8))
        qf = q8.astype(np.float64)
        for g in groups:
            with np.errstate(divide="ignore", invalid="ignore"):  # a wrong layout fails the check
                fit = _fit_groups(qf, w, k, n, g, tol)
            if fit is not None:
                scale, zp = fit
                # zero points are integers; the least-squares fit leaves rounding noise around them
                zp = np.where(np.abs(zp - np.rint(zp)) < 1e-3, np.rint(zp), zp)
                offset = -zp / reference.ANTIQUANT_OFFSET_SIGN
                if g == k:
                    return q8, scale[0].astype(np.float32), offset[0].astype(np.float32), 0
                return q8, scale.astype(np.float32), offset.astype(np.float32), g
    return None


def _fit_groups(qf: np.ndarray, w: np.ndarray, k: int, n: int, g: int, tol: float):
    """Least-squares scale and zero point per (group, column); None unless they reproduce w."""
    qg = qf.reshape(k // g, g, n)
    wg = w.astype(np.float64).reshape(k // g, g, n)
    qm, wm = qg.mean(axis=1), wg.mean(axis=1)
    var = ((qg - qm[:, None]) ** 2).sum(axis=1)
    cov = ((qg - qm[:, None]) * (wg - wm[:, None])).sum(axis=1)
    scale = np.where(var > 0, cov / np.where(var > 0, var, 1.0), np.where(wm != 0, np.abs(wm), 1.0))
    zp = qm - wm / scale  # w = (q - zp) * scale
    recon = (qg - zp[:, None]) * scale[:, None]
    if np.isfinite(recon).all() and np.abs(recon - wg).max() <= tol:
        return scale, zp
    return None


def _check(ctx: Context, m: WeightOnlyMatch) -> str | None:
    low = m.lowered
    if isinstance(low, str):
        return low
    k = low.q8.shape[0]
    if low.group and low.group >= k:
        # one group spanning all of k is per channel, which the op spells as group size 0
        low.scale = low.scale.reshape(-1)
        low.offset = None if low.offset is None else low.offset.reshape(-1)
        low.group = 0
    if not legal_group_size(low.group, k):
        # Refused here rather than by ATC on the NPU host: one line, exit 2.
        raise VlmcError(
            f"{ctx.name}: {m.node.name} (MatMul): antiquant_group_size {low.group} is refused by "
            f"NPUWeightQuantBatchMatmulV2 (0 or a multiple of {GROUP_MULTIPLE} at most k-1 = {k - 1}, "
            "ops-nn weight_quant_batch_matmul_v2_proto.h); requantize with group_size a multiple of 32"
        )
    if low.bits == 4 and ctx.int4_weights == "int4" and low.q8.shape[1] % 2:
        # op proto: with int4 weights and transpose_weight false, n must be even
        return f"n={low.q8.shape[1]} is odd; NPUWeightQuantBatchMatmulV2 takes int4 weights only for even n"
    for what, arr in (("antiquant_scale", low.scale), ("antiquant_offset", low.offset)):
        if arr is None:
            continue
        half = arr.astype(np.float16)
        if not np.isfinite(half).all() or np.any((half == 0) & (arr != 0)):
            return f"{what} is not representable in float16 (the type of x on the NPU)"
    return None


def _rewrite(ctx: Context, m: WeightOnlyMatch) -> None:
    low = m.lowered
    assert isinstance(low, _Lowered)  # check() refused every other case
    gr, node, report = ctx.graph, m.node, ctx.report
    report.weight_only_bits = max(report.weight_only_bits or 0, low.bits)
    packed = low.bits == 4 and ctx.int4_weights == "int4"
    q8 = low.q8
    if packed:
        # ONNX INT4: two values per byte, the lower index in the low nibble, which is GE's DT_INT4
        # layout. The weight is external data, which GE parses as a FileConstant (hicann/ge
        # onnx_file_constant_parser.cc): the bytes are used as written. INT4 needs IR 10.
        name, dtype = f"{node.name}_weight_int4", ir.DataType.INT4
        make = (lambda: q8().astype(ml_dtypes.int4)) if callable(q8) else q8.astype(ml_dtypes.int4)
        gr.model.ir_version = max(gr.model.ir_version, 10)
    else:
        name, dtype, make = f"{node.name}_weight_int{low.bits}", ir.DataType.INT8, q8
    if callable(make):
        weight = gr.add_deferred_init(name, dtype, q8.shape, make)
    else:
        weight = gr.add_init(name, make)
    # The deploy weight is in the store now: neither it nor the source's map is kept.
    low.q8 = None
    release(*m.leaves)
    # antiquant_scale/offset have the type of x (float16 on the NPU: ATC runs x in fp16).
    inputs = [
        node.inputs[0],
        weight,
        gr.add_init(f"{node.name}_antiquant_scale", low.scale.astype(np.float16)),
    ]
    if low.offset is not None and np.any(low.offset != 0):
        inputs.append(gr.add_init(f"{node.name}_antiquant_offset", low.offset.astype(np.float16)))
    out = ir.Value(name=node.outputs[0].name)
    new = ir.node(
        "NPUWeightQuantBatchMatmulV2",
        inputs,
        {"antiquant_group_size": int(low.group), "transpose_weight": 0, "transpose_x": 0},
        outputs=[out],
        name=node.name,
    )
    gr.replace(node, [new], [], [(node.outputs[0], out)])
    report.weight_only_layers.append(node.name)
    report.weight_only_sources[low.source] = report.weight_only_sources.get(low.source, 0) + 1
    if low.bits == 4:
        report.int4_storage = "int4" if packed else "int8"
        note = INT4_PACKED_NOTE if packed else INT4_NOTE
        if note not in report.notes:
            report.notes.append(note)


def weight_only_matmul_rule() -> Rule:
    """The weight-only MatMul rule (int8 per channel, int4 per group)."""
    return Rule("weight_only_matmul", ("MatMul",), SOURCE, _match, _check, _rewrite)
