"""Rule: QDQ MatMul/Gemm -> AscendQuant -> int8 MatMul (+ int32 bias Add) -> AscendDequant."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from . import _qdq_common
from ._base import Context, NoMatch, Rule
from ._graph import Graph, attr, folded_value, input_at

logger = logging.getLogger(__name__)

# AMCT deploys MatMul/Gemm weights per tensor only (hicann/amct amct_pytorch/classic/graph_based/
# amct_pytorch/capacity/capacity_config.csv: CHANNEL_WISE_ONNX_TYPES is Conv/ConvTranspose/LSTM/GRU;
# .../nn/module/quantization/linear.py refuses a channel-wise Linear), and which axis
# AscendDequant treats as the channel of an ND MatMul output is unconfirmed. Set True to lower
# per-channel MatMul weights to a Cout-length deq_scale once that is confirmed on hardware.
ALLOW_PER_CHANNEL_MATMUL = False
SOURCE = "; ".join(
    (
        "hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/capacity/capacity_config.csv (CHANNEL_WISE_ONNX_TYPES)",
        "hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/nn/module/quantization/linear.py (no channel_wise Linear)",
        "hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/optimizer/insert_bias_quant_pass.py (quant_bias)",
        "hicann/ge graph_metadef/register/graph_optimizer/graph_fusion/fusion_quant_util_impl.cc (SetQuantScaleAndOffset -> QuantBiasOptimization)",
        "hicann/ops-nn quant/ascend_quant/framework/ascend_quant_onnx_plugin.cpp",
        "hicann/ops-nn quant/ascend_dequant/framework/ascend_dequant_onnx_plugin.cpp",
    )
)


def _match(ctx: Context, node: ir.Node):
    m = _qdq_common.match_qdq(ctx, node)
    if isinstance(m, NoMatch):
        return m
    if m.wq.ndim != 2:
        return NoMatch(f"the quantized weight is {m.wq.ndim}-D, not a 2-D constant")
    return m


def _output_axis(node: ir.Node) -> int:
    """The weight axis that indexes output channels: 1 for MatMul [k, n] and Gemm, 0 for Gemm transB."""
    return 0 if node.op_type == "Gemm" and attr(node, "transB", 0) else 1


def _check(ctx: Context, m: _qdq_common.QdqMatch) -> str | None:
    node = m.node
    reason = _qdq_common.check_activation(ctx, m)
    if reason:
        return reason
    if node.op_type == "Gemm" and attr(node, "transA", 0):
        return "Gemm with transA=1 is not lowered; export MatMul"
    if not m.w_params.per_tensor:
        axis = m.w_params.axis % 2
        if axis != _output_axis(node):
            # A square weight quantized along its input axis has as many scales as output channels:
            # without this check it would be lowered as if the scales were per output channel.
            return (
                f"the weight is quantized along axis {axis}, its input axis; only the output-channel "
                f"axis {_output_axis(node)} (or per tensor) has an AscendDequant form"
            )
        if not ALLOW_PER_CHANNEL_MATMUL:
            return (
                f"AMCT quantizes {node.op_type} weights per tensor (one deq_scale value); requantize "
                "with the quantize pass (per tensor for MatMul/Gemm)"
            )
    if node.op_type == "Gemm" and attr(node, "transB", 0):
        m.w_int = np.ascontiguousarray(m.w_int.T)
    m.channels = m.w_int.shape[1]
    alpha = float(attr(node, "alpha", 1.0))
    if alpha != 1.0:
        m.s_w = m.s_w * np.float32(alpha)
    m.out, m.drop = node.outputs[0], []
    if node.op_type == "Gemm" and input_at(node, 2) is not None:
        m.bias_f = folded_value(ctx.graph, node.inputs[2])
        if m.bias_f is None:
            return "the Gemm bias must be a constant"
        m.bias_f = m.bias_f * np.float32(attr(node, "beta", 1.0))
    elif node.op_type == "MatMul":
        m.bias_f, m.out, m.drop = _bias_add(ctx.graph, node, m.channels)
    return _qdq_common.int_bias(m)


def _bias_add(gr: Graph, node: ir.Node, channels: int) -> tuple[np.ndarray | None, ir.Value, list]:
    """A constant bias Add after a MatMul (through the accumulator's Q/DQ), folded before the dequant."""
    chain: list[ir.Node] = []
    t = node.outputs[0]
    nxt = gr.only_consumer(t)
    if nxt is not None and nxt.op_type == "QuantizeLinear":
        dq = gr.only_consumer(nxt.outputs[0])
        if dq is None or dq.op_type != "DequantizeLinear":
            return None, node.outputs[0], []
        chain += [nxt, dq]
        t = dq.outputs[0]
        nxt = gr.only_consumer(t)
    if nxt is None or nxt.op_type != "Add":
        return None, node.outputs[0], []
    other = nxt.inputs[1] if nxt.inputs[0] is t else nxt.inputs[0]
    b = folded_value(gr, other)
    if (
        b is None
        or b.size not in (1, channels)
        or (b.ndim and b.shape[-1] not in (1, channels))
        or any(d != 1 for d in b.shape[:-1])
    ):
        return None, node.outputs[0], []
    return b.reshape(-1), nxt.outputs[0], chain + [nxt]


def _rewrite(ctx: Context, m: _qdq_common.QdqMatch) -> None:
    gr, node = ctx.graph, m.node
    xq = _qdq_common.ascend_quant(ctx, m)
    weight = _qdq_common.int8_weight(ctx, m)
    acc = gr.value(f"{node.name}_acc_int32")
    new = [ir.node("MatMul", [xq, weight], outputs=[acc], name=node.name)]
    deq_in = acc
    if m.bias_f is not None:
        deq_in = gr.value(f"{node.name}_acc_bias_int32")
        bias = gr.add_init(f"{node.name}_bias_int32", m.bias_i.astype(np.int32))
        new.append(ir.node("Add", [acc, bias], outputs=[deq_in], name=gr.unique(f"{node.name}_bias_add")))
    deq, out = _qdq_common.dequant(ctx, m, deq_in)
    new.append(deq)
    gr.replace(node, new, m.drop, [(m.out, out)])
    ctx.report.quantized_layers.append(node.name)


def qdq_matmul_rule() -> Rule:
    """The QDQ MatMul/Gemm rule (per-tensor weights; a following bias Add goes before the dequant)."""
    return Rule("qdq_matmul", ("MatMul", "Gemm"), SOURCE, _match, _check, _rewrite)
