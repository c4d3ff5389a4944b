"""Lowering a portable graph into what ATC builds: QDQ -> AMCT deploy form, weight-only -> NPU ops.

Rewrites, in order (each works from the graph pattern, so it does not depend on how the quantize
pass records its bookkeeping):

1. ``DQ(Q(x)) -> MatMul/Gemm/Conv <- DQ(int8 weight)`` becomes ``AscendQuant(x)`` -> int8 op with int8
   weights and an int32 bias -> ``AscendDequant`` with a UINT64 deq_scale; a following bias Add
   (through the quantizer's Q/DQ on the accumulator) is folded in, so the dequant comes after it.
2. ``MatMul(x, W)`` where W is computed from constants only and holds an integer weight (a DQ, or a
   Mul/Sub group-dequant subgraph) becomes ``NPUWeightQuantBatchMatmulV2`` (weight (k, n), per-channel
   or grouped antiquant scale/offset), after checking that ``(q + offset) * scale`` reproduces W.
3. Remaining activation ``DQ(Q(x))`` pairs become ``Clip`` to their representable range: the
   quantizer may have folded a Relu into a pair's zero point, and dropping the pair would lose it.
4. Remaining ``DQ(int8 constant)`` per tensor becomes ``AscendAntiQuant``; per axis it is folded.

Anything still Q/DQ afterwards is an error naming the node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from vlmc import ortsession
from vlmc.backends.ascend import reference as ref
from vlmc.errors import CheckFailed

logger = logging.getLogger(__name__)

# AMCT's convert_qat_model emits MatMul/Gemm with per-tensor weights only, but the deploy form's
# deq_scale is defined per output channel (length Cout), so per-channel MatMul weights are lowered to a
# Cout-length deq_scale. Unconfirmed on hardware: set False to demand per-tensor weights instead.
ALLOW_PER_CHANNEL_MATMUL = True
# AscendQuant computes x * (1/s) in fp16 on 910B: a scale of 1/s above fp16's max overflows.
FP16_MAX = 65504.0
QUANT_CORE_OPS = ("MatMul", "Gemm", "Conv")
GROUP_SIZES = (1024, 512, 256, 128, 64, 32, 16)
# Manifest quantization keys that list the nodes the quantize pass kept in FP32 (first found wins).
_KEPT_FP32_KEYS = ("nodes_kept_fp32", "fp32_nodes", "nodes_to_exclude")


@dataclass
class LowerReport:
    """What the lowering did to one graph (shown in compile.json)."""

    quantized_layers: list[str] = field(default_factory=list)
    weight_only_layers: list[str] = field(default_factory=list)
    weight_only_bits: int | None = None
    fake_quant_clips: int = 0
    antiquant_constants: int = 0
    folded_constants: int = 0
    kept_fp32: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return bool(self.quantized_layers or self.weight_only_layers)

    def to_dict(self) -> dict:
        return {
            "quantized_layers": self.quantized_layers,
            "weight_only_layers": self.weight_only_layers,
            "weight_only_bits": self.weight_only_bits,
            "fake_quant_clips": self.fake_quant_clips,
            "antiquant_constants": self.antiquant_constants,
            "folded_constants": self.folded_constants,
            "kept_fp32": self.kept_fp32,
            "notes": self.notes,
        }


class _Graph:
    """Producer/consumer maps and constant lookups over a GraphProto that is being rewritten."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.g = model.graph
        self.inits = {t.name: t for t in self.g.initializer}
        self._names: set[str] = set()
        for i, n in enumerate(self.g.node):
            if not n.name:
                n.name = f"{n.op_type}_{i}"
        self.refresh()

    def refresh(self) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self._names = {n.name for n in self.g.node} | set(self.inits)
        for n in self.g.node:
            for o in n.output:
                self.producer[o] = n
                self._names.add(o)
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def const(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        p = self.producer.get(name)
        if p is not None and p.op_type == "Constant":
            for a in p.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def add_init(self, base: str, value: np.ndarray) -> str:
        name = self.unique(base)
        t = numpy_helper.from_array(np.ascontiguousarray(value), name)
        self.g.initializer.append(t)
        self.inits[name] = t
        return name

    def only_consumer(self, tensor: str) -> onnx.NodeProto | None:
        cons = self.consumers.get(tensor, [])
        if len(cons) == 1 and tensor not in self.outputs:
            return cons[0]
        return None


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass
class _QParams:
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1


def _qparams(gr: _Graph, node: onnx.NodeProto) -> _QParams | None:
    """Scale/zero point of a Q or DQ node when both are constants."""
    scale = gr.const(node.input[1])
    if scale is None:
        return None
    zp = (
        gr.const(node.input[2])
        if len(node.input) > 2 and node.input[2]
        else np.zeros_like(scale, dtype=np.uint8)
    )
    if zp is None:
        return None
    return _QParams(scale.astype(np.float32), zp, int(_attr(node, "axis", 1)))


def _as_int8(q: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shift uint8 data/zero points to int8 (q-128, zp-128 give the same real values)."""
    if q.dtype == np.uint8:
        return (q.astype(np.int16) - 128).astype(np.int8), zp.astype(np.int16) - 128
    return q.astype(np.int8), zp.astype(np.int16)


def lower(model: onnx.ModelProto, name: str, info: dict | None = None) -> tuple[onnx.ModelProto, LowerReport]:
    """Lower one graph in place for ATC.

    Args:
        model: the portable graph (a copy the caller owns; it is rewritten in place).
        name: the graph's name, for messages.
        info: the graph's manifest entry; its ``quantization`` facts are used when present.

    Returns:
        The lowered model and what was done.

    Raises:
        CheckFailed: a quantization pattern has no Ascend form; the message names the nodes.
    """
    info = info or {}
    facts = info.get("quantization") or {}
    report = LowerReport()
    problems: list[str] = []
    gr = _Graph(model)
    quant_cache: dict[tuple, str] = {}

    for node in list(gr.g.node):
        if node.op_type in QUANT_CORE_OPS:
            _lower_core(gr, node, report, problems, quant_cache)
    _dce(gr)
    for node in list(gr.g.node):
        if node.op_type == "MatMul":
            _lower_weight_only(gr, node, report, problems, facts)
    _dce(gr)
    for node in list(gr.g.node):
        if node.op_type == "DequantizeLinear":
            _lower_fake_quant(gr, node, report, problems)
    _dce(gr)
    for node in list(gr.g.node):
        if node.op_type == "DequantizeLinear":
            _lower_constant_dq(gr, node, report)
    _dce(gr)
    for node in gr.g.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"):
            problems.append(
                f"{node.name} ({node.op_type}) is not part of a pattern vlmc can lower; quantize "
                "MatMul/Gemm/Conv with static QDQ (int8 activations, symmetric int8 weights)"
            )
    if problems:
        raise CheckFailed(f"{name}: cannot lower for Ascend: {'; '.join(problems)}")
    names = {n.name for n in gr.g.node}
    recorded = next((facts[k] for k in _KEPT_FP32_KEYS if isinstance(facts.get(k), list)), None)
    if recorded is not None:
        # The quantize pass says which nodes it kept in FP32; nodes it merely skipped follow the precision.
        report.kept_fp32 = [n for n in recorded if n in names]
    elif report.quantized:
        # Without facts: layers with a constant weight that stayed float were kept in FP32; activation x
        # activation MatMuls (attention) were never candidates and follow the precision.
        lowered = set(report.quantized_layers) | set(report.weight_only_layers)
        report.kept_fp32 = [
            n.name
            for n in gr.g.node
            if n.op_type in QUANT_CORE_OPS
            and n.name not in lowered
            and not _is_int8_input(gr, n)
            and _const_subgraph(gr, n.input[1]) is not None
        ]
    return model, report


def _is_int8_input(gr: _Graph, node: onnx.NodeProto) -> bool:
    p = gr.producer.get(node.input[0])
    return p is not None and p.op_type == "AscendQuant"


def _lower_core(
    gr: _Graph, node: onnx.NodeProto, report: LowerReport, problems: list[str], quant_cache: dict[tuple, str]
) -> None:
    a_dq = gr.producer.get(node.input[0])
    w_dq = gr.producer.get(node.input[1])
    if not (
        a_dq is not None
        and a_dq.op_type == "DequantizeLinear"
        and w_dq is not None
        and w_dq.op_type == "DequantizeLinear"
    ):
        return
    q_node = gr.producer.get(a_dq.input[0])
    wq = gr.const(w_dq.input[0])
    if q_node is None or q_node.op_type != "QuantizeLinear" or wq is None:
        return
    a_params, q_params, w_params = _qparams(gr, a_dq), _qparams(gr, q_node), _qparams(gr, w_dq)
    where = f"{node.name} ({node.op_type})"
    if a_params is None or q_params is None or w_params is None:
        problems.append(f"{where}: quantization scales must be constants")
        return
    if not a_params.per_tensor:
        problems.append(f"{where}: AscendQuant quantizes activations per tensor only")
        return
    if not (
        np.allclose(a_params.scale, q_params.scale)
        and np.array_equal(a_params.zero_point, q_params.zero_point)
    ):
        problems.append(
            f"{where}: the activation's QuantizeLinear and DequantizeLinear disagree on scale/zero point"
        )
        return
    if np.dtype(wq.dtype) not in (np.int8, np.uint8) or np.dtype(a_params.zero_point.dtype) not in (
        np.int8,
        np.uint8,
    ):
        problems.append(
            f"{where}: only 8-bit QDQ is lowered (weights {wq.dtype}, activations "
            f"{a_params.zero_point.dtype}); use int8/uint8 quantization"
        )
        return
    s_x = float(a_params.scale.reshape(-1)[0])
    if s_x <= 0 or 1.0 / s_x > FP16_MAX:
        problems.append(
            f"{where}: activation scale {s_x:g} gives AscendQuant scale 1/s = {1 / s_x:g}, beyond fp16's "
            f"{FP16_MAX:g}; recalibrate (the activation range is too small)"
        )
        return
    zp_raw = a_params.zero_point.reshape(-1)[0]
    # AscendQuant produces int8; a uint8 zero point z is the int8 zero point z - 128.
    zp_x = int(zp_raw) - 128 if a_params.zero_point.dtype == np.uint8 else int(zp_raw)
    w_int = wq.astype(np.int32) - w_params.zero_point.astype(np.int32).reshape(
        _broadcast_shape(w_params, wq.ndim)
    )
    if w_int.min() < -128 or w_int.max() > 127:
        problems.append(
            f"{where}: weights must be symmetric int8 (zero point 0); quantize weights with "
            "weight_type=QInt8 and symmetric ranges"
        )
        return
    w_int = w_int.astype(np.int8)
    s_w = w_params.scale.reshape(-1).astype(np.float32)

    if node.op_type == "Conv":
        if not w_params.per_tensor and w_params.axis != 0:
            problems.append(f"{where}: Conv weights must be quantized per output channel (axis 0)")
            return
        pads = _attr(node, "pads", [0]) or [0]
        if zp_x != 0 and (
            any(pads) or _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
        ):
            problems.append(
                f"{where}: a padded Conv needs a symmetric activation quantization (zero point 0)"
            )
            return
        cout = w_int.shape[0]
        col_sum = w_int.astype(np.int64).reshape(cout, -1).sum(axis=1)
        bias_f = _folded_value(gr, node.input[2]) if len(node.input) > 2 and node.input[2] else None
        out_name, drop = node.output[0], []
        channels = cout
    else:
        if w_int.ndim != 2:
            problems.append(f"{where}: the quantized weight must be a 2-D constant")
            return
        if node.op_type == "Gemm":
            if _attr(node, "transA", 0):
                problems.append(f"{where}: Gemm with transA=1 is not lowered; export MatMul")
                return
            if _attr(node, "transB", 0):
                w_int = np.ascontiguousarray(w_int.T)
        if not w_params.per_tensor and not ALLOW_PER_CHANNEL_MATMUL:
            problems.append(
                f"{where}: AMCT quantizes {node.op_type} weights per tensor; quantize with per_channel=False"
            )
            return
        channels = w_int.shape[1]
        col_sum = w_int.astype(np.int64).sum(axis=0)
        alpha = float(_attr(node, "alpha", 1.0))
        if alpha != 1.0:
            s_w = s_w * np.float32(alpha)
        bias_f, out_name, drop = None, node.output[0], []
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias_f = _folded_value(gr, node.input[2])
            if bias_f is None:
                problems.append(f"{where}: the Gemm bias must be a constant")
                return
            bias_f = bias_f * np.float32(_attr(node, "beta", 1.0))
        elif node.op_type == "MatMul":
            bias_f, out_name, drop = _bias_add(gr, node, channels)
    s_deq = (s_w * np.float32(s_x)).astype(np.float32)
    if s_deq.size not in (1, channels):
        problems.append(f"{where}: weight scale has {s_deq.size} values for {channels} output channels")
        return
    bias_i = np.zeros(channels, dtype=np.int64)
    if bias_f is not None:
        b = np.asarray(bias_f, dtype=np.float64).reshape(-1)
        if b.size not in (1, channels):
            problems.append(f"{where}: bias has {b.size} values for {channels} output channels")
            return
        bias_i = np.rint(
            np.broadcast_to(b, (channels,)) / np.broadcast_to(s_deq.astype(np.float64), (channels,))
        )
        bias_i = bias_i.astype(np.int64)
    # AMCT folds the activation zero point into the bias: sum((q - zp) * w) = q @ w - zp * colsum(w).
    bias_i = bias_i - zp_x * col_sum
    if np.abs(bias_i).max(initial=0) >= 2**31:
        problems.append(f"{where}: the int32 bias overflows; the weight/activation scales are too small")
        return
    has_bias = bias_f is not None or zp_x != 0

    x = q_node.input[0]
    key = (x, s_x, zp_x)
    if key not in quant_cache:
        xq = gr.unique(f"{x}_int8")
        quant = helper.make_node(
            "AscendQuant",
            [x],
            [xq],
            name=gr.unique(f"{node.name}_AscendQuant"),
            scale=float(np.float32(1.0 / s_x)),
            offset=float(zp_x),
            dst_type="INT8",
            round_mode="Round",
        )
        _insert_before(gr, node, [quant])
        quant_cache[key] = xq
    xq = quant_cache[key]
    w_name = gr.add_init(f"{node.name}_weight_int8", w_int)
    acc = gr.unique(f"{node.name}_acc_int32")
    new: list[onnx.NodeProto] = []
    if node.op_type == "Conv":
        inputs = [xq, w_name] + (
            [gr.add_init(f"{node.name}_bias_int32", bias_i.astype(np.int32))] if has_bias else []
        )
        core = helper.make_node("Conv", inputs, [acc], name=node.name)
        core.attribute.extend(node.attribute)
        new.append(core)
        deq_in = acc
    else:
        new.append(helper.make_node("MatMul", [xq, w_name], [acc], name=node.name))
        deq_in = acc
        if has_bias:
            deq_in = gr.unique(f"{node.name}_acc_bias_int32")
            b_name = gr.add_init(f"{node.name}_bias_int32", bias_i.astype(np.int32))
            new.append(
                helper.make_node("Add", [acc, b_name], [deq_in], name=gr.unique(f"{node.name}_bias_add"))
            )
    deq = gr.add_init(f"{node.name}_deq_scale", ref.pack_deq_scale(s_deq))
    new.append(
        helper.make_node(
            "AscendDequant", [deq_in, deq], [out_name], name=gr.unique(f"{node.name}_AscendDequant"), dtype=0
        )
    )
    _replace(gr, node, new, drop)
    report.quantized_layers.append(node.name)


def _broadcast_shape(p: _QParams, ndim: int) -> tuple[int, ...]:
    if p.per_tensor:
        return (1,) * ndim
    shape = [1] * ndim
    shape[p.axis % ndim] = p.scale.size
    return tuple(shape)


def _folded_value(gr: _Graph, tensor: str) -> np.ndarray | None:
    """A float constant, looking through a DequantizeLinear of constants."""
    v = gr.const(tensor)
    if v is not None:
        return v.astype(np.float32)
    p = gr.producer.get(tensor)
    if p is not None and p.op_type == "DequantizeLinear":
        q = gr.const(p.input[0])
        params = _qparams(gr, p)
        if q is not None and params is not None:
            zp = params.zero_point.astype(np.float32).reshape(_broadcast_shape(params, q.ndim))
            return (q.astype(np.float32) - zp) * params.scale.reshape(_broadcast_shape(params, q.ndim))
    return None


def _bias_add(gr: _Graph, node: onnx.NodeProto, channels: int) -> tuple[np.ndarray | None, str, list]:
    """A constant bias Add after a MatMul (through the accumulator's Q/DQ), to fold before the dequant."""
    chain: list[onnx.NodeProto] = []
    t = node.output[0]
    nxt = gr.only_consumer(t)
    if nxt is not None and nxt.op_type == "QuantizeLinear":
        dq = gr.only_consumer(nxt.output[0])
        if dq is None or dq.op_type != "DequantizeLinear":
            return None, node.output[0], []
        chain += [nxt, dq]
        t = dq.output[0]
        nxt = gr.only_consumer(t)
    if nxt is None or nxt.op_type != "Add":
        return None, node.output[0], []
    other = nxt.input[1] if nxt.input[0] == t else nxt.input[0]
    b = _folded_value(gr, other)
    if (
        b is None
        or b.size not in (1, channels)
        or (b.ndim and b.shape[-1] not in (1, channels))
        or any(d != 1 for d in b.shape[:-1])
    ):
        return None, node.output[0], []
    return b.reshape(-1), nxt.output[0], chain + [nxt]


def _insert_before(gr: _Graph, anchor: onnx.NodeProto, nodes: list[onnx.NodeProto]) -> None:
    idx = list(gr.g.node).index(anchor)
    for k, n in enumerate(nodes):
        gr.g.node.insert(idx + k, n)
    gr.refresh()


def _replace(gr: _Graph, old: onnx.NodeProto, new: list[onnx.NodeProto], drop: list[onnx.NodeProto]) -> None:
    nodes = list(gr.g.node)
    idx = nodes.index(old)
    dropped = {id(n) for n in drop} | {id(old)}
    kept = (
        [n for n in nodes[:idx] if id(n) not in dropped]
        + new
        + [n for n in nodes[idx + 1 :] if id(n) not in dropped]
    )
    del gr.g.node[:]
    gr.g.node.extend(kept)
    gr.refresh()


def _dce(gr: _Graph) -> None:
    """Remove nodes whose outputs nobody uses, then unused initializers."""
    changed = True
    while changed:
        changed = False
        used = {i for n in gr.g.node for i in n.input} | gr.outputs
        keep = [n for n in gr.g.node if any(o in used for o in n.output if o)]
        if len(keep) != len(gr.g.node):
            del gr.g.node[:]
            gr.g.node.extend(keep)
            changed = True
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    dead = [t for t in gr.g.initializer if t.name not in used]
    for t in dead:
        gr.g.initializer.remove(t)
        gr.inits.pop(t.name, None)
    gr.refresh()


def _const_subgraph(gr: _Graph, tensor: str) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The nodes computing ``tensor`` from constants only (topological), and the initializers they read."""
    nodes: list[onnx.NodeProto] = []
    leaves: list[str] = []
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        if t in gr.inits:
            leaves.append(t)
            continue
        p = gr.producer.get(t)
        if p is None:
            return None  # a graph input: not constant
        if p not in nodes:
            nodes.append(p)
        stack.extend(p.input)
    order = {id(n): i for i, n in enumerate(gr.g.node)}
    nodes.sort(key=lambda n: order[id(n)])
    return nodes, leaves


def _lower_weight_only(
    gr: _Graph, node: onnx.NodeProto, report: LowerReport, problems: list[str], facts: dict
) -> None:
    w_name = node.input[1]
    if w_name in gr.inits:
        return
    sub = _const_subgraph(gr, w_name)
    if sub is None:
        return
    nodes, leaves = sub
    if not nodes or not any(n.op_type in ("DequantizeLinear", "Mul", "Sub", "Cast") for n in nodes):
        return
    ints = [
        numpy_helper.to_array(gr.inits[name])
        for name in leaves
        if np.issubdtype(numpy_helper.to_array(gr.inits[name]).dtype, np.integer)
    ]
    sm = helper.make_model(
        helper.make_graph(
            nodes,
            "w",
            [],
            [helper.make_tensor_value_info(w_name, onnx.TensorProto.FLOAT, None)],
            [gr.inits[n] for n in leaves],
        ),
        opset_imports=list(gr.model.opset_import),
    )
    sm.ir_version = gr.model.ir_version or sm.ir_version
    try:
        w = np.asarray(ortsession.from_model(sm).run(None, {})[0], dtype=np.float32)
    except Exception as exc:  # onnxruntime raises its own types; a weight it cannot fold is left alone
        logger.debug("%s: weight subgraph not folded: %s", node.name, exc)
        return
    if w.ndim != 2:
        return
    k, n = w.shape
    big = [c for q in ints if q.dtype in (np.int8, np.uint8) for c in _int_candidates(q, k * n)]
    where = f"{node.name} (MatMul)"
    if not big:
        return
    fit = next(
        (f for f in (_fit_antiquant(w, q, facts.get("group_size")) for q in big) if f is not None), None
    )
    if fit is None:
        problems.append(
            f"{where}: its weight-only dequantization does not reduce to (q + offset) * scale per channel "
            "or per group; vlmc cannot lower it to NPUWeightQuantBatchMatmulV2"
        )
        return
    q8, scale, offset, group = fit
    bits = 4 if (q8.min() >= -8 and q8.max() <= 7) or (q8.min() >= 0 and q8.max() <= 15) else 8
    report.weight_only_bits = max(report.weight_only_bits or 0, bits)
    wq = gr.add_init(f"{node.name}_weight_int{bits}", q8)
    sc = gr.add_init(f"{node.name}_antiquant_scale", scale)
    off = gr.add_init(f"{node.name}_antiquant_offset", offset)
    new = helper.make_node(
        "NPUWeightQuantBatchMatmulV2",
        [node.input[0], wq, sc, off],
        [node.output[0]],
        name=node.name,
        antiquant_group_size=int(group),
        transpose_x=0,
        transpose_weight=0,
    )
    _replace(gr, node, [new], [])
    report.weight_only_layers.append(node.name)
    if bits == 4 and "int4 container" not in " ".join(report.notes):
        report.notes.append(
            "int4 weights are stored in an int8 container (exact values; ATC's packed int4 "
            "ONNX form is unconfirmed)"
        )


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


def _fit_antiquant(w: np.ndarray, q_raw: np.ndarray, preferred_group: int | None):
    """Find int8 q (k, n), scale and offset with ``(q + offset) * scale == w`` per channel or per group."""
    k, n = w.shape
    layouts = [q_raw.reshape(k, n)]
    if k != n:
        layouts.append(q_raw.reshape(n, k).T)
    else:
        layouts.append(q_raw.reshape(n, k).T.copy())
    groups = [k] + [g for g in GROUP_SIZES if g < k and k % g == 0]
    if preferred_group and preferred_group in groups:
        groups.remove(preferred_group)
        groups.insert(0, preferred_group)
    tol = 1e-5 * max(float(np.abs(w).max()), 1e-30)
    for q in layouts:
        q8, _ = _as_int8(np.ascontiguousarray(q), np.zeros(1, np.uint8 if q.dtype == np.uint8 else np.int8))
        qf = q8.astype(np.float64)
        for g in groups:
            with np.errstate(
                divide="ignore", invalid="ignore"
            ):  # a wrong layout gives 0 scales; it fails the check
                fit = _fit_groups(qf, w, k, n, g, tol)
            if fit is not None:
                scale, zp = fit
                offset = -zp / ref.ANTIQUANT_OFFSET_SIGN
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


def _lower_fake_quant(gr: _Graph, dq: onnx.NodeProto, report: LowerReport, problems: list[str]) -> None:
    q = gr.producer.get(dq.input[0])
    if q is None or q.op_type != "QuantizeLinear":
        return
    params = _qparams(gr, dq)
    if params is None or not params.per_tensor:
        problems.append(
            f"{dq.name} (DequantizeLinear): an activation fake-quant pair needs constant per-tensor scales"
        )
        return
    s = float(params.scale.reshape(-1)[0])
    zp = float(params.zero_point.reshape(-1)[0])
    info = np.iinfo(params.zero_point.dtype)
    lo, hi = np.float32(s * (info.min - zp)), np.float32(s * (info.max - zp))
    opset = next((o.version for o in gr.model.opset_import if o.domain in ("", "ai.onnx")), 17)
    if opset >= 11:
        clip = helper.make_node(
            "Clip",
            [
                q.input[0],
                gr.add_init(f"{dq.name}_min", np.array(lo)),
                gr.add_init(f"{dq.name}_max", np.array(hi)),
            ],
            [dq.output[0]],
            name=dq.name,
        )
    else:
        clip = helper.make_node(
            "Clip", [q.input[0]], [dq.output[0]], name=dq.name, min=float(lo), max=float(hi)
        )
    _replace(gr, dq, [clip], [])
    report.fake_quant_clips += 1


def _lower_constant_dq(gr: _Graph, dq: onnx.NodeProto, report: LowerReport) -> None:
    q = gr.const(dq.input[0])
    params = _qparams(gr, dq)
    if q is None or params is None:
        return
    if params.per_tensor and q.dtype in (np.int8, np.uint8):
        q8, zp8 = _as_int8(q, params.zero_point.reshape(-1))
        anti = helper.make_node(
            "AscendAntiQuant",
            [gr.add_init(f"{dq.name}_int8", q8)],
            [dq.output[0]],
            name=dq.name,
            scale=float(params.scale.reshape(-1)[0]),
            offset=float(zp8[0]),
        )
        _replace(gr, dq, [anti], [])
        report.antiquant_constants += 1
        return
    value = _folded_value(gr, dq.output[0])
    if value is None:
        return
    c = helper.make_node(
        "Identity", [gr.add_init(f"{dq.name}_folded", value.astype(np.float32))], [dq.output[0]], name=dq.name
    )
    _replace(gr, dq, [c], [])
    report.folded_constants += 1


def strip_past(
    model: onnx.ModelProto, name: str, prefix: str = "past_key_values."
) -> tuple[onnx.ModelProto, int]:
    """Make the prefill form of a decoder: drop its past inputs (the past is empty in prefill).

    Each past input is removed from the Concat that appends the new keys/values; a Concat left with
    one input becomes Identity. Any other consumer (e.g. a Shape that measures the past) gets an
    empty tensor ``[batch, ..., 0, ...]`` built from ``inputs_embeds``' batch size.

    Returns:
        The rewritten model and how many non-Concat consumers were given an empty past.

    Raises:
        CheckFailed: a past input's shape has dims other than batch, past_sequence and constants.
    """
    gr = _Graph(model)
    past = [i for i in gr.g.input if i.name.startswith(prefix)]
    empties = 0
    for inp in past:
        for cons in list(gr.consumers.get(inp.name, [])):
            if cons.op_type == "Concat":
                rest = [i for i in cons.input if i != inp.name]
                if len(rest) == 1:
                    ident = helper.make_node("Identity", rest, list(cons.output), name=cons.name)
                    _replace(gr, cons, [ident], [])
                else:
                    del cons.input[:]
                    cons.input.extend(rest)
                    gr.refresh()
        if gr.consumers.get(inp.name):
            _feed_empty(gr, inp, name)
            empties += 1
        gr.g.input.remove(inp)
    gr.refresh()
    return model, empties


def _feed_empty(gr: _Graph, inp: onnx.ValueInfoProto, name: str) -> None:
    dims = []
    batch_at = None
    for i, d in enumerate(inp.type.tensor_type.shape.dim):
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.dim_param == "batch":
            dims.append(1)
            batch_at = i
        elif d.dim_param == "past_sequence":
            dims.append(0)
        else:
            raise CheckFailed(f"{name}: cannot build the prefill graph: {inp.name} has dim {d.dim_param!r}")
    dtype = helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
    out = inp.name
    fill = numpy_helper.from_array(np.zeros(1, dtype=dtype))
    if batch_at is None:
        shape = gr.add_init(f"{out}_empty_shape", np.array(dims, dtype=np.int64))
        nodes = [
            helper.make_node("ConstantOfShape", [shape], [out], name=gr.unique(f"{out}_empty"), value=fill)
        ]
    else:
        embeds = next((i.name for i in gr.g.input if i.name == "inputs_embeds"), gr.g.input[0].name)
        shp, bat = gr.unique(f"{out}_embeds_shape"), gr.unique(f"{out}_batch")
        full = gr.unique(f"{out}_empty_shape")
        before = gr.add_init(f"{out}_dims_before", np.array(dims[:batch_at], dtype=np.int64))
        after = gr.add_init(f"{out}_dims_after", np.array(dims[batch_at + 1 :], dtype=np.int64))
        start, end = (
            gr.add_init(f"{out}_b0", np.array([0], np.int64)),
            gr.add_init(f"{out}_b1", np.array([1], np.int64)),
        )
        nodes = [
            helper.make_node("Shape", [embeds], [shp], name=gr.unique(f"{out}_Shape")),
            helper.make_node("Slice", [shp, start, end], [bat], name=gr.unique(f"{out}_Slice")),
            helper.make_node("Concat", [before, bat, after], [full], name=gr.unique(f"{out}_Concat"), axis=0),
            helper.make_node("ConstantOfShape", [full], [out], name=gr.unique(f"{out}_empty"), value=fill),
        ]
    for k, n in enumerate(nodes):
        gr.g.node.insert(k, n)
    gr.refresh()
