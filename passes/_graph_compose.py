"""Graph composition on the IR, shared by the merge and split passes: extraction, naming, dedupe, cuts.

Everything here works on ``onnx_ir`` graphs and never reads a weight: a cut or a copy of a graph
gets new nodes and values whose initializers hold the *same* tensor objects (memory-mapped
``ExternalTensor`` s stay where they are, and are written once when the package is saved).
Dependencies are followed through ``Value.producer()`` / ``Value.uses()``; names matter only at the
graph interfaces (stage inputs and outputs), because IR edges are object references.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from vlmc import interop
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Ops whose output depends only on the input's shape: dependence through them is not data flow.
SHAPE_OPS = ("Shape", "Size")
# Ops that pass a tensor through unchanged in shape (single-input Concat is what TorchScript emits for a
# DynamicCache update of an empty cache).
_SHAPE_TRANSPARENT = ("Identity", "Concat")


# ---- reading the graph ----------------------------------------------------------------------------


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    out: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            out.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            out.extend(attr.as_graphs())
    return out


def reads(node: ir.Node) -> list[ir.Value]:
    """The values a node depends on: its inputs, and outer-scope values its subgraphs (If/Loop) use."""
    vals = [v for v in node.inputs if v is not None]
    subs = _subgraphs(node)
    if subs:
        inner: set[ir.Graph] = set()
        for sub in subs:
            inner.update(sub.subgraphs())
            inner.add(sub)
        for sub in subs:
            for n in sub.all_nodes():
                vals.extend(v for v in n.inputs if v is not None and v.graph not in inner)
    return vals


def lookup(graph: ir.Graph, names: Iterable[str], where: str) -> list[ir.Value]:
    """The values named ``names`` (in that order); a missing one is a one-line error."""
    by_name = ir.convenience.create_value_mapping(graph, include_subgraphs=False)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise VlmcError(f"{where}: cannot cut the graph there ({', '.join(missing[:4])} not in the graph)")
    return [by_name[n] for n in names]


# ---- extraction -----------------------------------------------------------------------------------


def extract(
    graph: ir.Graph,
    inputs: Sequence[ir.Value],
    outputs: Sequence[ir.Value],
    where: str,
    name: str | None = None,
) -> ir.Graph:
    """A new graph computing ``outputs`` from ``inputs``: the nodes reached walking producers back.

    ``onnx_ir.convenience.extract`` does the walk (it stops at ``inputs``) and copies the result
    (``ir.GraphView.clone``: new nodes and values, ``graph`` untouched, the same tensor objects for
    the initializers, so nothing is read or copied). A cut that needs a graph input it was not given
    is not closed and is refused; the initializers are put back in ``graph``'s order (the library
    collects them in a set), so the saved file does not change from run to run.
    """
    try:
        sub = ir.convenience.extract(graph, inputs=list(inputs), outputs=list(outputs))
    except ValueError as exc:
        raise VlmcError(
            f"{where}: the cut needs tensors outside it ({str(exc).rsplit(': ', 1)[-1]}); "
            "the graph does not have the expected stage structure"
        ) from exc
    rank = {n: i for i, n in enumerate(graph.initializers)}
    ordered = sorted(sub.initializers.values(), key=lambda v: rank.get(v.name, len(rank)))
    sub.initializers.clear()
    for v in ordered:
        sub.register_initializer(v)
    sub.name = name or graph.name
    return sub


def model_like(graph: ir.Graph, *sources: ir.Model, producer: str | None = None) -> ir.Model:
    """An ``ir.Model`` around ``graph`` with the IR version and functions of the model(s) it came from."""
    functions: dict = {}
    for m in sources:
        functions.update(m.functions)
    return ir.Model(
        graph,
        ir_version=max(m.ir_version for m in sources),
        producer_name=producer or sources[0].producer_name,
        producer_version=None if producer else sources[0].producer_version,
        functions=list(functions.values()),
    )


def copy_model(model: ir.Model) -> ir.Model:
    """A structural copy of a model: new nodes and values, the same weight tensors (nothing read)."""
    return model_like(model.graph.clone(), model)


def prefix_internal(graph: ir.Graph, prefix: str) -> None:
    """Give every node and every value except the graph's own inputs and outputs a ``prefix``.

    The inputs and outputs are the stage interface that connects stages; internal names only have
    to be unique once several stages live in one graph. Subgraphs (If/Loop bodies) are renamed too.
    """
    interface = set(graph.inputs) | set(graph.outputs)
    for v in list(graph.initializers.values()):
        if v not in interface:
            v.name = prefix + v.name
    for sub in graph.subgraphs():
        for v in dict.fromkeys((*sub.inputs, *sub.initializers.values())):
            if v.name:
                v.name = prefix + v.name
    for node in graph.all_nodes():
        if node.name:
            node.name = prefix + node.name
        for v in node.outputs:
            if v.name and v not in interface:
                v.name = prefix + v.name


def take_nodes(graph: ir.Graph) -> list[ir.Node]:
    """Detach every node of ``graph`` (kept connected to its values) so another graph can own it."""
    nodes = list(graph)
    graph.remove(nodes)
    return nodes


# ---- weights ------------------------------------------------------------------------------------


def dedupe_initializers(graph: ir.Graph) -> dict:
    """Keep one initializer per content; the uses of the others move to it. Returns counts.

    Written here rather than with onnx-ir's DeduplicateInitializersPass /
    DeduplicateHashedInitializersPass because both read every weight's bytes again (to compare or
    sha512 them). The content identity used here is the package's own (:func:`vlmc.interop.tensor_hash`),
    computed once per build per stored tensor and cached on it and by its file location: the pass
    manager fingerprints every graph with it anyway, so deduplicating reads no weight bytes of its own.
    """
    first: dict[str, ir.Value] = {}
    dropped = 0
    saved = 0
    for value in list(graph.initializers.values()):
        t = value.const_value
        if t is None or value.is_graph_input() or value.is_graph_output():
            continue
        keep = first.setdefault(interop.tensor_hash(t), value)
        if keep is value:
            continue
        value.replace_all_uses_with(keep)
        graph.initializers.pop(value.name)
        dropped += 1
        saved += t.nbytes
    return {"initializers_deduplicated": dropped, "bytes_saved": saved}


def merged_opsets(models: Iterable[ir.Model], where: str) -> dict[str, int]:
    """One opset import for graphs that will live in one model; differing versions are refused."""
    versions: dict[str, int] = {}
    for m in models:
        for domain, version in m.graph.opset_imports.items():
            domain = "" if domain == "ai.onnx" else domain
            if domain in versions and versions[domain] != version:
                raise VlmcError(
                    f"{where}: the graphs use different opset versions for domain {domain or 'ai.onnx'!r} "
                    f"({versions[domain]} and {version}); re-export the package with one opset"
                )
            versions[domain] = int(version)
    return dict(sorted(versions.items()))


# ---- types from the manifest ----------------------------------------------------------------------


def set_signature(value: ir.Value, entry: dict) -> None:
    """Give a value the dtype and (symbolic) shape of a manifest signature entry ({name, dtype, shape})."""
    value.dtype = ir.DataType.from_numpy(np.dtype(entry["dtype"]))
    value.shape = ir.Shape([None if d == "?" else d for d in entry["shape"]])


def same_type(value: ir.Value, like: ir.Value) -> None:
    """Copy another value's type and shape."""
    value.type = like.type
    value.shape = like.shape.copy() if like.shape is not None else None


# ---- dependence -----------------------------------------------------------------------------------


def backward_reach(outputs: Iterable[ir.Value], stop: set[ir.Value]) -> set[ir.Value]:
    """Values the walk back from ``outputs`` ends at: graph inputs, and ``stop`` values it meets."""
    seen: set[ir.Value] = set()
    reached: set[ir.Value] = set()
    visited: set[ir.Node] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.is_initializer():
            continue
        if v in stop:
            reached.add(v)
            continue
        node = v.producer()
        if node is None:
            reached.add(v)
            continue
        if node not in visited:
            visited.add(node)
            stack.extend(reads(node))
    return reached


def only_shape_used(value: ir.Value) -> bool:
    """True if every use of ``value`` ends in Shape/Size, possibly through shape-transparent ops."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.is_graph_output():
            return False
        for node, _ in v.uses():
            if node.op_type in SHAPE_OPS:
                continue
            if node.op_type in _SHAPE_TRANSPARENT and len([i for i in node.inputs if i is not None]) == 1:
                stack.extend(node.outputs)
                continue
            return False
    return True


def residual_cuts(graph: ir.Graph, source: ir.Value, sink: ir.Value) -> list[ir.Value]:
    """Values every data path from ``source`` to ``sink`` passes through, in topological order.

    For a decoder (source inputs_embeds, sink logits) these are the residual stream between and inside
    layers. Paths through Shape/Size do not count as data flow: the causal mask is built from the
    input's shape and reaches every layer, but carries none of its values. Nodes are in topological
    order (ONNX requires it); a value is a cut when, at some point of that order, it is the only
    on-path value still waiting for a consumer.
    """
    nodes = list(graph)
    fwd = {source}
    for n in nodes:
        if n.op_type not in SHAPE_OPS and any(i in fwd for i in reads(n)):
            fwd.update(n.outputs)
    bwd = {sink}
    for n in reversed(nodes):
        if any(o in bwd for o in n.outputs):
            bwd.update(reads(n))
    on = fwd & bwd
    order = [n for n in nodes if any(o in on for o in n.outputs)]
    start: dict[ir.Value, int] = {source: -1}
    end: dict[ir.Value, int] = {}
    for pos, n in enumerate(order):
        for o in n.outputs:
            if o in on:
                start[o] = pos
        if n.op_type in SHAPE_OPS:
            continue
        for i in reads(n):
            if i in on:
                end[i] = pos
    end[sink] = len(order)
    # crossing[g]: on-path values alive between order[g] and order[g + 1] (g = -1 is before the first node)
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


def depends_on(graph: ir.Graph, sources: set[ir.Value]) -> set[ir.Value]:
    """Every value whose content depends on one of ``sources`` (not through Shape/Size)."""
    reach = set(sources)
    for n in graph:
        if n.op_type not in SHAPE_OPS and any(i in reach for i in reads(n)):
            reach.update(n.outputs)
    return reach
