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

import onnx_ir as ir

from vlmc import tensor_names

logger = logging.getLogger(__name__)

POOL_DTYPE = "float16"


# new_key.{i} / new_value.{i}: a paged step's rows out (tensor_names.new_rows)
_ROWS_RE = re.compile("^(?:" + "|".join(re.escape(p) for p in tensor_names.NEW_PREFIX.values()) + r")\d+$")


def _is_rows(name: str) -> bool:
    return _ROWS_RE.match(name) is not None


def fp16_pool_io(model: ir.Model) -> list[str]:
    """Make a paged decoder's float32 pool inputs and row outputs float16, in place.

    Returns:
        The inputs and outputs retyped (empty for a graph without pools, or one already in float16).
    """
    g = model.graph
    changed: list[str] = []
    head: list[ir.Node] = []
    for inp in g.inputs:
        if not tensor_names.is_cache(inp.name) or inp.dtype != ir.DataType.FLOAT:
            continue
        inner = ir.Value(name=f"{inp.name}__fp32")
        inp.replace_all_uses_with(inner)
        head.append(
            ir.node("Cast", [inp], {"to": ir.DataType.FLOAT}, outputs=[inner], name=f"{inp.name}__to_fp32")
        )
        inp.dtype = ir.DataType.FLOAT16
        changed.append(inp.name)
    tail: list[ir.Node] = []
    for i, out in enumerate(list(g.outputs)):
        if not _is_rows(out.name) or out.dtype != ir.DataType.FLOAT:
            continue
        rows = ir.Value(name=out.name, type=ir.TensorType(ir.DataType.FLOAT16), shape=out.shape)
        # the float32 value stays where it is computed, under a new name and without the output's type
        out.name, out.type, out.shape = f"{out.name}__fp32", None, None
        tail.append(
            ir.node("Cast", [out], {"to": ir.DataType.FLOAT16}, outputs=[rows], name=f"{rows.name}__to_fp16")
        )
        g.outputs[i] = rows
        changed.append(rows.name)
    if changed:
        first = next(iter(g), None)
        if head and first is not None:
            g.insert_before(first, head)
        else:
            g.extend(head)
        g.extend(tail)
        logger.info("paged pools in float16: %d inputs/outputs retyped", len(changed))
    return changed
