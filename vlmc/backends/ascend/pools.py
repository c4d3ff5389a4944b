"""Paged KV pools in float16 on the device: the lowered decoder takes float16 pools and returns float16 rows.

The pools never leave the NPU: the host binds the same device buffers every step and stores each step's
rows into them with ATB ReshapeAndCache or aclnnScatterPaKvCache (compile.json ``paged_kv.write``). Both
take float16/bfloat16/int8 only, with the rows and both caches in one dtype (ATB ReshapeAndCacheOperation,
ascendtb_01_0073; hicann/ops-transformer ``attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache.md``
rejects FLOAT on Atlas A2). So the paged builds' ``key_cache.*`` / ``value_cache.*`` inputs and
``new_key.*`` / ``new_value.*`` outputs must be float16 in the .om.

That is done in the graph's IO, not with ``--input_fp16_nodes`` / ``--output_type``: ATC keeps a graph's
IO dtypes when neither flag is given (hicann/ge ``docs/zh/user_guides/atc_tools/CLI_options/--output_type.md``),
so the .om's IO is exactly what the lowered ONNX file declares, which is also what compile.json lists and
what the CPU reference executor runs. The ``--input_fp16_nodes`` page says only that the named inputs are
float16 (``--input_fp16_nodes.md``), nothing about how a float32 graph input is converted, so relying on
it would leave the CPU check unable to model the build. A float32 graph gets a Cast to float32 right
after each pool input and a Cast to float16 right before each row output; everything between computes
as before (on the NPU in the build's --precision_mode_v2, fp16 by default, anyway).
"""

from __future__ import annotations

import logging
import re

import onnx
from onnx import TensorProto, helper

logger = logging.getLogger(__name__)

POOL_RE = re.compile(r"^(key|value)_cache\.\d+$")
ROWS_RE = re.compile(r"^new_(key|value)\.\d+$")
POOL_DTYPE = "float16"


def fp16_pool_io(model: onnx.ModelProto) -> list[str]:
    """Make a paged decoder's float32 pool inputs and row outputs float16, in place.

    Returns:
        The inputs and outputs retyped (empty for a graph without pools, or one already in float16).
    """
    g = model.graph
    changed: list[str] = []
    head: list[onnx.NodeProto] = []
    for inp in g.input:
        if not POOL_RE.match(inp.name) or inp.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        inner = f"{inp.name}__fp32"
        _rename_uses(g, inp.name, inner)
        head.append(
            helper.make_node("Cast", [inp.name], [inner], name=f"{inp.name}__to_fp32", to=TensorProto.FLOAT)
        )
        inp.type.tensor_type.elem_type = TensorProto.FLOAT16
        changed.append(inp.name)
    tail: list[onnx.NodeProto] = []
    for out in g.output:
        if not ROWS_RE.match(out.name) or out.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        inner = f"{out.name}__fp32"
        for node in g.node:
            node.output[:] = [inner if o == out.name else o for o in node.output]
        _rename_uses(g, out.name, inner)
        tail.append(
            helper.make_node("Cast", [inner], [out.name], name=f"{out.name}__to_fp16", to=TensorProto.FLOAT16)
        )
        out.type.tensor_type.elem_type = TensorProto.FLOAT16
        changed.append(out.name)
    if changed:
        nodes = head + list(g.node) + tail
        del g.node[:]
        g.node.extend(nodes)
        logger.info("paged pools in float16: %d inputs/outputs retyped", len(changed))
    return changed


def _rename_uses(g: onnx.GraphProto, old: str, new: str) -> None:
    """Point every node input (and value_info entry) that reads ``old`` at ``new``."""
    for node in g.node:
        if old in node.input:
            node.input[:] = [new if i == old else i for i in node.input]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_uses(attr.g, old, new)
    for vi in g.value_info:
        if vi.name == old:
            vi.name = new
