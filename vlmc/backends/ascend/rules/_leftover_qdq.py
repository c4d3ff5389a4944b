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
import onnx_ir as ir

from ._base import Context, NoMatch, Rule
from ._graph import QParams, as_int8, folded_value, qparams, release

logger = logging.getLogger(__name__)

SOURCE = "; ".join(
    (
        "hicann/ops-nn quant/ascend_anti_quant/framework/ascend_anti_quant_onnx_plugin.cpp",
        "ai.onnx Clip (vlmc/backends/ascend/data/onnx_ops.tsv)",
    )
)


@dataclass
class LeftoverMatch:
    dq: ir.Node
    kind: str  # "fake_quant" | "constant"
    q: ir.Node | None = None
    data: np.ndarray | None = None
    params: QParams | None = None


def _match(ctx: Context, dq: ir.Node) -> LeftoverMatch | NoMatch:
    gr = ctx.graph
    p = dq.inputs[0].producer()
    if p is not None and p.op_type == "QuantizeLinear":
        return LeftoverMatch(dq, "fake_quant", q=p, params=qparams(gr, dq))
    data = gr.const(dq.inputs[0])
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
    out = ir.Value(name=dq.outputs[0].name)
    if m.kind == "fake_quant":
        s = float(params.scale.reshape(-1)[0])
        zp = float(params.zero_point.reshape(-1)[0])
        info = np.iinfo(params.zero_point.dtype)
        lo, hi = np.float32(s * (info.min - zp)), np.float32(s * (info.max - zp))
        if gr.opset() >= 11:
            bounds = [
                gr.add_init(f"{dq.name}_min", np.array(lo)),
                gr.add_init(f"{dq.name}_max", np.array(hi)),
            ]
            clip = ir.node("Clip", [m.q.inputs[0], *bounds], outputs=[out], name=dq.name)
        else:
            clip = ir.node(
                "Clip", [m.q.inputs[0]], {"max": float(hi), "min": float(lo)}, outputs=[out], name=dq.name
            )
        gr.replace(dq, [clip], [], [(dq.outputs[0], out)])
        report.fake_quant_clips += 1
        return
    if params.per_tensor and m.data.dtype in (np.int8, np.uint8):
        q8, zp8 = as_int8(m.data, params.zero_point.reshape(-1))
        anti = ir.node(
            "AscendAntiQuant",
            [gr.add_init(f"{dq.name}_int8", q8)],
            {"offset": float(zp8[0]), "scale": float(params.scale.reshape(-1)[0])},
            outputs=[out],
            name=dq.name,
        )
        m.data = None
        release(dq.inputs[0])
        gr.replace(dq, [anti], [], [(dq.outputs[0], out)])
        report.antiquant_constants += 1
        return
    value = folded_value(gr, dq.outputs[0])
    folded = gr.add_init(f"{dq.name}_folded", value.astype(np.float32))
    del value
    m.data = None
    release(dq.inputs[0])
    gr.replace(dq, [ir.node("Identity", [folded], outputs=[out], name=dq.name)], [], [(dq.outputs[0], out)])
    report.folded_constants += 1


def leftover_qdq_rule() -> Rule:
    """The leftover Q/DQ rule (runs after the int8 and weight-only rules)."""
    return Rule("leftover_qdq", ("DequantizeLinear",), SOURCE, _match, _check, _rewrite)
