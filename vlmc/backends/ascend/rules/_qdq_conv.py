"""Rule: QDQ Conv -> AscendQuant -> int8 Conv with int32 bias -> AscendDequant (per output channel)."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from . import _qdq_common
from ._base import Context, Rule
from ._graph import attr, folded_value, input_at

logger = logging.getLogger(__name__)

SOURCE = "; ".join(
    (
        "hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/capacity/capacity_config.csv (CHANNEL_WISE_ONNX_TYPES)",
        "hicann/amct amct_pytorch/classic/graph_based/amct_pytorch/optimizer/insert_bias_quant_pass.py (quant_bias)",
        "hicann/ge graph_metadef/register/graph_optimizer/graph_fusion/fusion_quant_util_impl.cc (SetQuantScaleAndOffset -> QuantBiasOptimization)",
        "hicann/ops-nn quant/ascend_quant/framework/ascend_quant_onnx_plugin.cpp",
        "hicann/ops-nn quant/ascend_dequant/framework/ascend_dequant_onnx_plugin.cpp",
    )
)


def _check(ctx: Context, m: _qdq_common.QdqMatch) -> str | None:
    node = m.node
    reason = _qdq_common.check_activation(ctx, m)
    if reason:
        return reason
    if not m.w_params.per_tensor and m.w_params.axis % m.wq.ndim != 0:
        return "Conv weights must be quantized per output channel (axis 0)"
    pads = attr(node, "pads", [0]) or [0]
    if m.zp_x != 0 and (
        any(pads) or attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
    ):
        # GE corrects the offset over every tap; padded taps would hold 0 rather than the offset.
        return "a padded Conv needs a symmetric activation quantization (zero point 0)"
    m.channels = m.w_int.shape[0]
    bias = input_at(node, 2)
    m.bias_f = folded_value(ctx.graph, bias) if bias is not None else None
    m.out, m.drop = node.outputs[0], []
    return _qdq_common.int_bias(m)


def _rewrite(ctx: Context, m: _qdq_common.QdqMatch) -> None:
    gr, node = ctx.graph, m.node
    xq = _qdq_common.ascend_quant(ctx, m)
    weight = _qdq_common.int8_weight(ctx, m)
    acc = gr.value(f"{node.name}_acc_int32")
    inputs = [xq, weight]
    if m.bias_f is not None:
        inputs.append(gr.add_init(f"{node.name}_bias_int32", m.bias_i.astype(np.int32)))
    core = ir.Node(
        "", "Conv", inputs, attributes=list(node.attributes.values()), outputs=[acc], name=node.name
    )
    deq, out = _qdq_common.dequant(ctx, m, acc)
    gr.replace(node, [core, deq], m.drop, [(m.out, out)])
    ctx.report.quantized_layers.append(node.name)


def _match(ctx: Context, node: ir.Node):
    return _qdq_common.match_qdq(ctx, node)


def qdq_conv_rule() -> Rule:
    """The QDQ Conv rule (weights per output channel or per tensor)."""
    return Rule("qdq_conv", ("Conv",), SOURCE, _match, _check, _rewrite)
