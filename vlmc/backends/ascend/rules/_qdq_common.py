"""What the QDQ MatMul/Gemm and QDQ Conv rules share: the activation side and the deploy-form emission.

The target is AMCT's deploy form (hicann/amct, the ONNX deploy model ATC builds):
``AscendQuant(x; scale=1/s_x, offset=zp)`` -> int8 op with int8 weights and an int32 bias
``round(b/(s_w*s_x))`` -> ``AscendDequant(deq_scale = s_w*s_x packed in UINT64)``. The bias carries no
``-zp*sum(w)`` term: AMCT's ``quant_bias`` (hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/
optimizer/insert_bias_quant_pass.py) never folds it, and GE's quant fusion
applies the AscendQuant offset itself (hicann/ge graph_metadef/register/graph_optimizer/graph_fusion/
fusion_quant_util_impl.cc, SetQuantScaleAndOffset -> QuantBiasOptimization). Folding it here as well
would apply it twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from vlmc import ascend_limits
from vlmc.runtime.executors import reference

from ._base import Context, NoMatch
from ._graph import QParams, qparams, release

logger = logging.getLogger(__name__)

# AscendQuant computes x * (1/s) in fp16 on 910B: a scale of 1/s above fp16's max overflows.
FP16_MAX = ascend_limits.FP16_MAX
ASYMMETRIC_NOTE = (
    "asymmetric int8 activations are lowered in AMCT's deploy form (AscendQuant offset = zero point, "
    "bias not corrected; GE's quant fusion applies the offset); unverified on hardware"
)


@dataclass
class QdqMatch:
    """A ``DQ(Q(x)) -> op <- DQ(int8 weight)`` pattern, as found (nothing checked yet)."""

    node: ir.Node
    q_node: ir.Node
    a_dq: ir.Node
    w_dq: ir.Node
    wq: np.ndarray  # memory-mapped from the weight's file
    # filled by check():
    s_x: float = 0.0
    zp_x: int = 0
    w_int: np.ndarray | None = None
    s_w: np.ndarray | None = None
    bias_f: np.ndarray | None = None
    out: ir.Value | None = None  # the value the rewrite's dequant output takes over
    drop: list = field(default_factory=list)
    channels: int = 0
    bias_i: np.ndarray | None = None
    s_deq: np.ndarray | None = None
    w_params: QParams | None = None


def match_qdq(ctx: Context, node: ir.Node) -> QdqMatch | NoMatch:
    gr = ctx.graph
    if len(node.inputs) < 2:
        return NoMatch("fewer than two inputs")
    a_dq = node.inputs[0].producer() if node.inputs[0] is not None else None
    w_dq = node.inputs[1].producer() if node.inputs[1] is not None else None
    if a_dq is None or a_dq.op_type != "DequantizeLinear":
        return NoMatch("input 0 is not a DequantizeLinear")
    if w_dq is None or w_dq.op_type != "DequantizeLinear":
        return NoMatch("input 1 is not a DequantizeLinear")
    q_node = a_dq.inputs[0].producer()
    if q_node is None or q_node.op_type != "QuantizeLinear":
        return NoMatch("the activation DequantizeLinear is not fed by a QuantizeLinear")
    wq = gr.const(w_dq.inputs[0])
    if wq is None:
        return NoMatch("the weight DequantizeLinear does not read a constant")
    return QdqMatch(node, q_node, a_dq, w_dq, wq)


def check_activation(ctx: Context, m: QdqMatch) -> str | None:
    """Activation and weight parameters common to every int8 op; fills s_x, zp_x, w_int, s_w."""
    gr = ctx.graph
    a_params, q_params, w_params = qparams(gr, m.a_dq), qparams(gr, m.q_node), qparams(gr, m.w_dq)
    if a_params is None or q_params is None or w_params is None:
        return "quantization scales must be constants"
    if not a_params.per_tensor:
        return "AscendQuant quantizes activations per tensor only"
    if not (
        np.allclose(a_params.scale, q_params.scale)
        and np.array_equal(a_params.zero_point, q_params.zero_point)
    ):
        return "the activation's QuantizeLinear and DequantizeLinear disagree on scale/zero point"
    if np.dtype(m.wq.dtype) not in (np.int8, np.uint8) or np.dtype(a_params.zero_point.dtype) not in (
        np.int8,
        np.uint8,
    ):
        return (
            f"only 8-bit QDQ is lowered (weights {m.wq.dtype}, activations {a_params.zero_point.dtype}); "
            "use int8/uint8 quantization"
        )
    s_x = float(a_params.scale.reshape(-1)[0])
    if s_x <= 0 or 1.0 / s_x > FP16_MAX:
        return (
            f"activation scale {s_x:g} gives AscendQuant scale 1/s = {1 / s_x:g}, beyond fp16's "
            f"{FP16_MAX:g}; recalibrate (the activation range is too small)"
        )
    zp_raw = a_params.zero_point.reshape(-1)[0]
    # AscendQuant produces int8; a uint8 zero point z is the int8 zero point z - 128.
    m.zp_x = int(zp_raw) - 128 if a_params.zero_point.dtype == np.uint8 else int(zp_raw)
    m.s_x = s_x
    if m.wq.dtype == np.int8 and not np.any(w_params.zero_point):
        # Symmetric int8 (quantize's QInt8 weights): the deploy weight is the stored one, byte for byte
        # (int8_weight points at it instead of copying it).
        m.w_int = m.wq
        m.s_w = w_params.scale.reshape(-1).astype(np.float32)
        m.w_params = w_params
        return None
    zp_w = w_params.zero_point.astype(np.int32)
    if w_params.per_tensor:
        zp_w = zp_w.reshape((1,) * m.wq.ndim)
    else:
        shape = [1] * m.wq.ndim
        shape[w_params.axis % m.wq.ndim] = w_params.scale.size
        zp_w = zp_w.reshape(shape)
    w_int = m.wq.astype(np.int32) - zp_w
    if w_int.min() < -128 or w_int.max() > 127:
        return "weights must be symmetric int8 (zero point 0); quantize weights with weight_type=QInt8"
    m.w_int = w_int.astype(np.int8)
    m.s_w = w_params.scale.reshape(-1).astype(np.float32)
    m.w_params = w_params
    return None


def int_bias(m: QdqMatch) -> str | None:
    """``round(b/(s_w*s_x))`` per channel, with no zero-point term (AMCT insert_bias_quant_pass)."""
    m.s_deq = (m.s_w * np.float32(m.s_x)).astype(np.float32)
    if m.s_deq.size not in (1, m.channels):
        return f"weight scale has {m.s_deq.size} values for {m.channels} output channels"
    bias_i = np.zeros(m.channels, dtype=np.int64)
    if m.bias_f is not None:
        b = np.asarray(m.bias_f, dtype=np.float64).reshape(-1)
        if b.size not in (1, m.channels):
            return f"bias has {b.size} values for {m.channels} output channels"
        bias_i = np.rint(
            np.broadcast_to(b, (m.channels,)) / np.broadcast_to(m.s_deq.astype(np.float64), (m.channels,))
        ).astype(np.int64)
    if np.abs(bias_i).max(initial=0) >= 2**31:
        return "the int32 bias overflows; the weight/activation scales are too small"
    m.bias_i = bias_i
    return None


def ascend_quant(ctx: Context, m: QdqMatch) -> ir.Value:
    """The int8 tensor of ``x``: one AscendQuant per (tensor, scale, offset), shared by its consumers."""
    gr = ctx.graph
    x = m.q_node.inputs[0]
    key = (x, m.s_x, m.zp_x)
    if key not in ctx.quant_cache:
        xq = gr.value(f"{x.name}_int8")
        quant = ir.node(
            "AscendQuant",
            [x],
            # in name order, as onnx.helper.make_node writes attributes
            {
                "dst_type": "INT8",
                "offset": float(m.zp_x),
                "round_mode": "Round",
                "scale": float(np.float32(1.0 / m.s_x)),
            },
            outputs=[xq],
            name=gr.unique(f"{m.node.name}_AscendQuant"),
        )
        gr.insert_before(m.node, [quant])
        ctx.quant_cache[key] = xq
    if m.zp_x != 0 and ASYMMETRIC_NOTE not in ctx.report.notes:
        ctx.report.notes.append(ASYMMETRIC_NOTE)
    if m.zp_x != 0:
        ctx.report.asymmetric_layers.append(m.node.name)
    return ctx.quant_cache[key]


def dequant(ctx: Context, m: QdqMatch, acc: ir.Value) -> tuple[ir.Node, ir.Value]:
    """The AscendDequant of ``acc`` and its output (which takes over ``m.out``)."""
    gr = ctx.graph
    deq = gr.add_init(f"{m.node.name}_deq_scale", reference.pack_deq_scale(m.s_deq))
    out = ir.Value(name=m.out.name)
    node = ir.node(
        "AscendDequant",
        [acc, deq],
        {"dtype": 0},
        outputs=[out],
        name=gr.unique(f"{m.node.name}_AscendDequant"),
    )
    return node, out


def int8_weight(ctx: Context, m: QdqMatch) -> ir.Value:
    """The int8 weight initializer (written to the store), and the source weight's map dropped."""
    gr, source = ctx.graph, m.w_dq.inputs[0].const_value
    if m.w_int is m.wq and gr.store is not None and isinstance(source, ir.ExternalTensor):
        # the deploy bytes are the source's (check_activation): the build's writer copies them from
        # the package's data file in the kernel (copy_file_range); nothing is made or stored here
        value = gr.add_alias_init(f"{m.node.name}_weight_int8", source)
    else:
        w_int = np.array(m.w_int) if m.w_int is m.wq else m.w_int  # never keep the source's map
        value = gr.add_init(f"{m.node.name}_weight_int8", w_int)
    m.w_int = m.wq = None  # the deploy weight is in the store; neither copy is kept
    release(m.w_dq.inputs[0])
    return value
