"""Rule: Q/DQ left after the int8 and weight-only rules -> Clip, AscendAntiQuant or a folded constant.

* An activation ``DQ(Q(x))`` pair becomes ``Clip`` to its representable range: the quantizer may have
  folded a Relu into the pair's zero point, and dropping the pair would lose it.
* ``DQ(int8 constant)`` per tensor becomes ``AscendAntiQuant`` (``y = (x - offset) * scale``, the
  default-domain op ATC parses from ONNX); per axis it is folded to a float constant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ._base import Context, NoMatch, Rule
from ._graph import QParams, as_int8, folded_value, qparams

logger = logging.getLogger(__name__)

SOURCE = "; ".join(
    (
        "hicann/ops-nn quant/ascend_anti_quant/framework/ascend_anti_quant_onnx_plugin.cpp",
        "ai.onnx Clip (vlmc/backends/ascend/data/onnx_ops.tsv)",
    )
)


@dataclass
class LeftoverMatch:
    dq: onnx.NodeProto
    kind: str  # "fake_quant" | "constant"
    q: onnx.NodeProto | None = None
    data: np.ndarray | None = None
    params: QParams | None = None


def _match(ctx: Context, dq: onnx.NodeProto) -> LeftoverMatch | NoMatch:
    gr = ctx.graph
    p = gr.producer.get(dq.input[0])
    if p is not None and p.op_type == "QuantizeLinear":
        return LeftoverMatch(dq, "fake_quant", q=p, params=qparams(gr, dq))
    data = gr.const(dq.input[0])
    if data is not None:
        return LeftoverMatch(dq, "constant", data=data, params=qparams(gr, dq))
    return NoMatch("neither a QuantizeLinear pair nor a constant")


def _check(ctx: Context, m: LeftoverMatch) -> str | None:
    if m.kind == "fake_quant" and (m.params is None or not m.params.per_tensor):
        return "an activation fake-quant pair needs constant per-tensor scales"
    if m.kind == "constant" and m.params is None:
        return "the scales of a constant DequantizeLinear must be constants"
    return None


def _rewrite(ctx: Context, m: LeftoverMatch) -> None:
    gr, dq, report = ctx.graph, m.dq, ctx.report
    params = m.params
    if m.kind == "fake_quant":
        s = float(params.scale.reshape(-1)[0])
        zp = float(params.zero_point.reshape(-1)[0])
        info = np.iinfo(params.zero_point.dtype)
        lo, hi = np.float32(s * (info.min - zp)), np.float32(s * (info.max - zp))
        opset = next((o.version for o in gr.model.opset_import if o.domain in ("", "ai.onnx")), 17)
        if opset >= 11:
            clip = helper.make_node(
                "Clip",
                [
                    m.q.input[0],
                    gr.add_init(f"{dq.name}_min", np.array(lo)),
                    gr.add_init(f"{dq.name}_max", np.array(hi)),
                ],
                [dq.output[0]],
                name=dq.name,
            )
        else:
            clip = helper.make_node(
                "Clip", [m.q.input[0]], [dq.output[0]], name=dq.name, min=float(lo), max=float(hi)
            )
        gr.replace(dq, [clip], [])
        report.fake_quant_clips += 1
        return
    if params.per_tensor and m.data.dtype in (np.int8, np.uint8):
        q8, zp8 = as_int8(m.data, params.zero_point.reshape(-1))
        anti = helper.make_node(
            "AscendAntiQuant",
            [gr.add_init(f"{dq.name}_int8", q8)],
            [dq.output[0]],
            name=dq.name,
            scale=float(params.scale.reshape(-1)[0]),
            offset=float(zp8[0]),
        )
        gr.replace(dq, [anti], [])
        report.antiquant_constants += 1
        return
    value = folded_value(gr, dq.output[0])
    c = helper.make_node(
        "Identity", [gr.add_init(f"{dq.name}_folded", value.astype(np.float32))], [dq.output[0]], name=dq.name
    )
    gr.replace(dq, [c], [])
    report.folded_constants += 1


def leftover_qdq_rule() -> Rule:
    """The leftover Q/DQ rule (runs after the int8 and weight-only rules)."""
    return Rule("leftover_qdq", ("DequantizeLinear",), SOURCE, _match, _check, _rewrite)
