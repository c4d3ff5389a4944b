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

The pools are stacked slot-major, ``[num_blocks, block_size, layers, kv_heads, head_dim]`` (layer axis 2):
a slot then holds the rows of every layer side by side, so a step's new rows, also stacked
(:func:`stack_outputs`: ``new_key`` / ``new_value`` ``[batch, sequence, layers, kv_heads, head_dim]``),
are stored into the pool with one device-to-device copy per run of consecutive slots for all layers at
once, instead of one per layer (vlmc.runtime.executors.acl.DevicePool). The contiguous past stays layer-major.

The KV outputs are stacked too, so that the KV stays on the device between steps: a contiguous decode
build returns ``present.key`` / ``present.value`` *rolled*, ``[layers, batch, kv_heads, past_sequence,
head_dim]``, each layer's ``concat(past, new)`` without its first position, i.e. exactly the shape of its
own stacked past input at the same gear; a step's output buffer is then the next step's input buffer
(aclUpdateDataBuffer swaps the two, no copy). Rolling drops a position, which is padding as long as the
past gear exceeds the real past; the runner picks such a gear (vlmc.runtime.executors.build.BuildExecutor._fit). A contiguous
prefill build (no past) returns its presents stacked as they are, ``[layers, batch, kv_heads,
total_sequence, head_dim]``.
"""

from __future__ import annotations

import logging

import numpy as np
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
        axis = tensor_names.layer_axis(stacked)
        dims = list(first.shape)
        value = ir.Value(
            name=stacked,
            shape=ir.Shape([*dims[:axis], len(layers), *dims[axis:]]),
            type=ir.TensorType(first.dtype),
        )
        nodes = []
        for i in layers:
            index = ir.node("Constant", [], attributes={"value_int": i}, name=f"{stacked}.index.{i}")
            index.outputs[0].name = f"{stacked}.index.{i}"
            out = ir.Value(
                name=f"{members[i].name}.slice", shape=first.shape, type=ir.TensorType(first.dtype)
            )
            gather = ir.node("Gather", [value, index.outputs[0]], attributes={"axis": axis}, outputs=[out],
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


def stack_outputs(model: ir.Model, graph: str) -> list[str]:
    """Replace each complete group of per-layer KV outputs by one stacked output, in place (see the module
    docstring: a present is rolled where the graph takes its stacked past). Returns the stacked names."""
    g = model.graph
    inputs = {v.name for v in g.inputs}
    outputs = {v.name: v for v in g.outputs}
    made = []
    for stacked in ("present.key", "present.value", "new_key", "new_value"):
        axis = tensor_names.layer_axis(stacked)
        layers = 0
        while tensor_names.output_members(stacked, layers + 1)[-1] in outputs:
            layers += 1
        if layers < 2 or tensor_names.output_members(stacked, layers + 2)[-1] in outputs:
            continue  # one layer (a tensor-parallel segment), or not layers 0..L-1
        members = [outputs[n] for n in tensor_names.output_members(stacked, layers)]
        first = members[0]
        if first.shape is None or any(
            m.dtype != first.dtype or list(m.shape or []) != list(first.shape) for m in members
        ):
            logger.info("%s: %s outputs are not layers 0..L-1 of one shape; left per layer", graph, stacked)
            continue
        past = tensor_names.rolled_input(stacked)
        rolled = past is not None and past in inputs
        nodes, parts = [], []
        axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([axis], np.int64))},
                       name=f"{stacked}.axes")  # fmt: skip
        nodes.append(axes)
        if rolled:
            start = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1], np.int64))},
                            name=f"{stacked}.roll.start")  # fmt: skip
            end = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([2**62], np.int64))},
                          name=f"{stacked}.roll.end")  # fmt: skip
            roll_axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([tensor_names.ROLLED_AXIS], np.int64))},
                                name=f"{stacked}.roll.axes")  # fmt: skip
            nodes += [start, end, roll_axes]
        for i, member in enumerate(members):
            source = member
            if rolled:
                cut = ir.node("Slice", [member, start.outputs[0], end.outputs[0], roll_axes.outputs[0]],
                              name=f"{stacked}.roll.{i}")  # fmt: skip
                nodes.append(cut)
                source = cut.outputs[0]
            up = ir.node("Unsqueeze", [source, axes.outputs[0]], name=f"{stacked}.unsqueeze.{i}")
            nodes.append(up)
            parts.append(up.outputs[0])
        if rolled:
            shape = next(v.shape for v in g.inputs if v.name == past)
        else:
            dims = list(first.shape)
            shape = ir.Shape([*dims[:axis], layers, *dims[axis:]])
        out = ir.Value(name=stacked, shape=shape, type=ir.TensorType(first.dtype))
        nodes.append(
            ir.node("Concat", parts, attributes={"axis": axis}, outputs=[out], name=f"{stacked}.concat")
        )
        g.extend(nodes)
        position = list(g.outputs).index(first)
        for m in members:
            g.outputs.remove(m)
        g.outputs.insert(position, out)
        made.append(stacked)
    return made
