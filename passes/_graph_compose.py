"""Graph composition helpers shared by the merge and split passes: renaming, dedupe, extraction, cuts."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper

from vlmc import graphs as G
from vlmc import tensor_names
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Ops whose output depends only on the input's shape: dependence through them is not data flow.
SHAPE_OPS = ("Shape", "Size")
# Ops that pass a tensor through unchanged in shape (single-input Concat is what TorchScript emits for a
# DynamicCache update of an empty cache).
_SHAPE_TRANSPARENT = ("Identity", "Concat")


layer_of = tensor_names.layer_of


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out = []
    for attr in node.attribute:
        if attr.HasField("g"):
            out.append(attr.g)
        out.extend(attr.graphs)
    return out


def rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename tensors everywhere in a graph (nodes, IO, initializers, value_info, subgraph references)."""
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for i, name in enumerate(node.output):
            if name in mapping:
                node.output[i] = mapping[name]
        for sub in _subgraphs(node):
            rename(sub, mapping)
    for coll in (graph.input, graph.output, graph.value_info, graph.initializer):
        for item in coll:
            if item.name in mapping:
                item.name = mapping[item.name]


def prefixed(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """A copy of ``model`` whose internal names (nodes, edges, initializers) start with ``prefix``.

    Graph inputs and outputs keep their names: they are the stage interface that connects stages.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    # add_prefix renames every name that has a value_info, so value_info must not describe the IO
    io = {v.name for v in out.graph.input} | {v.name for v in out.graph.output}
    for v in [v for v in out.graph.value_info if v.name in io]:
        out.graph.value_info.remove(v)
    onnx.compose.add_prefix(
        out,
        prefix,
        rename_nodes=True,
        rename_edges=True,
        rename_inputs=False,
        rename_outputs=False,
        rename_initializers=True,
        rename_value_infos=True,
        rename_functions=False,
        inplace=True,
    )
    return out


def tensor_digest(t: onnx.TensorProto) -> str:
    """Content identity of a weight: dtype, dims and bytes (the name is not part of it)."""
    import hashlib

    h = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode())
    h.update(t.raw_data if t.raw_data else onnx.numpy_helper.to_array(t).tobytes())
    return h.hexdigest()


def dedupe_initializers(graph: onnx.GraphProto) -> dict:
    """Keep one initializer per content; rename references to the dropped copies. Returns counts."""
    first: dict[str, str] = {}
    mapping: dict[str, str] = {}
    keep = []
    saved = 0
    for t in graph.initializer:
        d = tensor_digest(t)
        if d in first:
            mapping[t.name] = first[d]
            saved += len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
        else:
            first[d] = t.name
            keep.append(t)
    if mapping:
        del graph.initializer[:]
        graph.initializer.extend(keep)
        # value_info of dropped names would now describe the kept name twice
        dropped = [v for v in graph.value_info if v.name in mapping]
        for v in dropped:
            graph.value_info.remove(v)
        rename(graph, mapping)
    return {"initializers_deduplicated": len(mapping), "bytes_saved": saved}


def value_info(entry: dict, name: str | None = None) -> onnx.ValueInfoProto:
    """A ValueInfoProto from a manifest signature entry ({name, dtype, shape})."""
    shape = [d if isinstance(d, int) else (None if d == "?" else d) for d in entry["shape"]]
    return helper.make_tensor_value_info(name or entry["name"], G.elem_type(entry["dtype"]), shape)


def merged_opsets(models: Iterable[onnx.ModelProto], where: str) -> list[onnx.OperatorSetIdProto]:
    """One opset_import list for graphs that will live in one model; differing versions are refused."""
    versions: dict[str, int] = {}
    for m in models:
        for o in m.opset_import:
            domain = "" if o.domain == "ai.onnx" else o.domain
            if domain in versions and versions[domain] != o.version:
                raise VlmcError(
                    f"{where}: the graphs use different opset versions for domain {domain or 'ai.onnx'!r} "
                    f"({versions[domain]} and {o.version}); re-export the package with one opset"
                )
            versions[domain] = int(o.version)
    return [helper.make_opsetid(d, v) for d, v in sorted(versions.items())]


def extract(model: onnx.ModelProto, inputs: list[str], outputs: list[str], where: str) -> onnx.ModelProto:
    """Cut the subgraph between ``inputs`` and ``outputs`` (onnx.utils.Extractor), checking it is closed.

    Extractor silently keeps nodes that read tensors outside the cut; here that is an error, because
    the result would not be a valid graph.
    """
    ex = onnx.utils.Extractor(model)
    try:
        out = ex.extract_model(inputs, outputs)
    except ValueError as exc:
        raise VlmcError(f"{where}: cannot cut the graph there ({exc})") from exc
    missing = sorted(free_inputs(out.graph) - set(inputs))
    if missing:
        raise VlmcError(
            f"{where}: the cut needs tensors outside it ({', '.join(missing[:4])}); "
            "the graph does not have the expected stage structure"
        )
    out.ir_version = model.ir_version
    return out


def free_inputs(graph: onnx.GraphProto) -> set[str]:
    """Tensor names nodes read that no node in the graph produces and that are not initializers."""
    produced = {o for n in graph.node for o in n.output if o}
    produced |= {t.name for t in graph.initializer}
    free: set[str] = set()
    for n in graph.node:
        free.update(i for i in n.input if i and i not in produced)
    return free


def backward_reach(graph: onnx.GraphProto, outputs: Iterable[str], stop: set[str]) -> set[str]:
    """Tensors the walk back from ``outputs`` ends at: graph inputs, and ``stop`` tensors it meets."""
    producer = {o: n for n in graph.node for o in n.output if o}
    inits = {t.name for t in graph.initializer}
    seen: set[str] = set()
    stack = list(outputs)
    reached: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in inits:
            continue
        if t in stop:
            reached.add(t)
            continue
        node = producer.get(t)
        if node is None:
            reached.add(t)
            continue
        stack.extend(i for i in node.input if i)
    return reached


def only_shape_used(graph: onnx.GraphProto, name: str) -> bool:
    """True if every use of ``name`` ends in Shape/Size, possibly through shape-transparent ops."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    stack, seen = [name], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in outputs:
            return False
        for n in consumers.get(t, []):
            if n.op_type in SHAPE_OPS:
                continue
            if n.op_type in _SHAPE_TRANSPARENT and len([i for i in n.input if i]) == 1:
                stack.extend(o for o in n.output if o)
                continue
            return False
    return True


def residual_cuts(graph: onnx.GraphProto, source: str, sink: str) -> list[str]:
    """Tensors every data path from ``source`` to ``sink`` passes through, in topological order.

    For a decoder (source inputs_embeds, sink logits) these are the residual stream between and inside
    layers. Paths through Shape/Size do not count as data flow: the causal mask is built from the
    input's shape and reaches every layer, but carries none of its values. Nodes are in topological
    order (ONNX requires it); a tensor is a cut when, at some point of that order, it is the only
    on-path tensor still waiting for a consumer.
    """
    nodes = list(graph.node)
    fwd = {source}
    for n in nodes:
        if n.op_type not in SHAPE_OPS and any(i in fwd for i in n.input):
            fwd.update(o for o in n.output if o)
    bwd = {sink}
    for n in reversed(nodes):
        if any(o in bwd for o in n.output):
            bwd.update(i for i in n.input if i)
    on = fwd & bwd
    order = [n for n in nodes if any(o in on for o in n.output)]
    start = {source: -1}
    end: dict[str, int] = {}
    for pos, n in enumerate(order):
        for o in n.output:
            if o in on:
                start[o] = pos
        if n.op_type in SHAPE_OPS:
            continue
        for i in n.input:
            if i in on:
                end[i] = pos
    end[sink] = len(order)
    # crossing[g]: on-path tensors alive between order[g] and order[g + 1] (g = -1 is before the first node)
    diff = np.zeros(len(order) + 2, np.int64)
    for t, s in start.items():
        e = end.get(t, s)
        if e > s:
            diff[s + 1] += 1
            diff[e + 1] -= 1
    crossing = np.cumsum(diff)[:-1]  # index g + 1 for gap g
    cuts = []
    for t, s in sorted(start.items(), key=lambda kv: kv[1]):
        e = end.get(t, s)
        if e > s and int(crossing[s + 1 : e + 1].min()) == 1:
            cuts.append(t)
    return cuts


def depends_on(graph: onnx.GraphProto, sources: set[str]) -> set[str]:
    """Every tensor whose value depends on one of ``sources`` (not through Shape/Size)."""
    reach = set(sources)
    for n in graph.node:
        if n.op_type not in SHAPE_OPS and any(i in reach for i in n.input):
            reach.update(o for o in n.output if o)
    return reach
