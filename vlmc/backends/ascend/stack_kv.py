"""The stacked-KV build form: a decoder's per-layer KV inputs become one input per kind, [layers, ...].

``aclmdlSetInputDynamicDims`` takes every input's full shape (aclpythondevg_01_0168; GeExecutor::
GetCurDynamicDims in hicann/ge concatenates the dims of every input named in --input_shape), and
``aclmdlIODims.dims`` holds ACL_MAX_DIM_CNT = 128 values (acl_mdl.h). With one input per layer and kind
the vector of a contiguous decode build is 7 + 8 x layers values (135 at 16 layers); a paged build with
gears carries its 2 x layers pools the same way. Stacked, the count is fixed: a decode build takes
``past_key_values.key`` / ``past_key_values.value`` [layers, batch, kv_heads, past, head_dim] and a paged
build ``key_cache`` / ``value_cache`` [layers, num_blocks, block_size, kv_heads, head_dim]; each layer
reads its slice with ``Gather(axis=0)`` of a constant index. Outputs stay per layer. The host stacks and
binds (vlmc.runtime.executors.build.BuildExecutor), so the package's interface and the runtime are unchanged.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from vlmc import tensor_names

logger = logging.getLogger(__name__)


def stack_inputs(model: ir.Model, graph: str) -> list[str]:
    """Replace each complete group of per-layer KV inputs (layers 0..L-1, one shape and dtype) by one
    stacked input, in place. Returns the stacked input names (none for a graph without such inputs)."""
    g = model.graph
    groups: dict[str, dict[int, ir.Value]] = {}
    for value in g.inputs:
        key = tensor_names.stack_group(value.name)
        if key is not None and not value.is_initializer():
            groups.setdefault(key[0], {})[key[1]] = value
    made = []
    for stacked, members in groups.items():
        layers = sorted(members)
        first = members[layers[0]]
        same = all(
            members[i].dtype == first.dtype and list(members[i].shape) == list(first.shape) for i in layers
        )
        if len(layers) < 2:
            continue  # one layer (a tensor-parallel segment): nothing grows with depth
        if layers != list(range(len(layers))) or not same or first.shape is None:
            logger.info("%s: %s inputs are not layers 0..L-1 of one shape; left per layer", graph, stacked)
            continue
        value = ir.Value(
            name=stacked, shape=ir.Shape([len(layers), *first.shape]), type=ir.TensorType(first.dtype)
        )
        nodes = []
        for i in layers:
            index = ir.node("Constant", [], attributes={"value_int": i}, name=f"{stacked}.index.{i}")
            index.outputs[0].name = f"{stacked}.index.{i}"
            out = ir.Value(
                name=f"{members[i].name}.slice", shape=first.shape, type=ir.TensorType(first.dtype)
            )
            gather = ir.node("Gather", [value, index.outputs[0]], attributes={"axis": 0}, outputs=[out],
                             name=f"{stacked}.gather.{i}")  # fmt: skip
            ir.convenience.replace_all_uses_with(members[i], out)
            nodes += [index, gather]
        position = list(g.inputs).index(first)
        for i in layers:
            g.inputs.remove(members[i])
        g.inputs.insert(position, value)
        if len(g):
            g.insert_before(next(iter(g)), nodes)
        else:
            g.extend(nodes)
        made.append(stacked)
    return made
