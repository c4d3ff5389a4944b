"""Shared by the folding passes: which graphs they must skip, and folding without reading big weights."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from vlmc import graphs as G

logger = logging.getLogger(__name__)

# Quantized graphs keep int8/int4 weights behind a dequantize subgraph; folding that subgraph would
# turn them back into float weights and silently undo the compression.
_COMPRESSED = ("int8", "int8_weight_only", "int4_weight_only")


def foldable(package, names: list[str], pass_name: str) -> tuple[list[str], dict[str, str]]:
    """Split graph names into those a folding pass may touch and those it must skip (with reasons).

    A graph is skipped when it holds quantized weights: its own precision or quantization facts say
    so, or (for a merged graph) one of the stages it contains does. A merged graph of float stages
    (fp32/fp16, "mixed" or not) is folded like any other.
    """
    keep, skipped = [], {}
    for name in names:
        info = package.info(name)
        parts = [info] + list(info.get("stages") or [])
        quantized = [
            p.get("name", name)
            for p in parts
            if p.get("precision") in _COMPRESSED
            or p.get("quantization")
            or (p.get("extra") or {}).get("quantization")
        ]
        if quantized:
            where = "" if quantized == [name] else f" (stages {', '.join(quantized)})"
            skipped[name] = (
                f"quantized weights{where}; folding would undo the quantization (run {pass_name} before quantize)"
            )
            logger.warning("%s: skipping %s: %s", pass_name, name, skipped[name])
        else:
            keep.append(name)
    return keep, skipped


def without_big_weights(model: ir.Model, limit: int) -> tuple[onnx.ModelProto, dict[str, ir.Value]]:
    """A ModelProto of ``model`` in which every initializer of ``limit`` bytes or more is a graph input.

    Folding tools (onnx-graphsurgeon, onnxsim) then see those weights as values they cannot know, so
    they never read or copy them, and they fold everything else (shape arithmetic, masks, small
    constants). Weight-only expressions over big weights are left as they are: torch's exporter has
    already folded those (e.g. transposed Linear weights). The model itself is not changed.

    Returns the proto and the big initializers by name, for :func:`with_big_weights`.
    """
    g = model.graph
    order = list(g.initializers.items())
    big = {n: v for n, v in order if v.const_value is not None and v.const_value.nbytes >= limit}
    n_inputs = len(g.inputs)
    try:
        for n in big:
            g.initializers.pop(n)
            g.inputs.append(big[n])
        proto = G.to_proto(model)  # the small weights' bytes are read in: folding may need them
    finally:
        while len(g.inputs) > n_inputs:
            g.inputs.pop()
        g.initializers.clear()
        for _, v in order:
            g.register_initializer(v)
    return proto, big


def with_big_weights(proto: onnx.ModelProto, big: dict[str, ir.Value], like: ir.Model) -> ir.Model:
    """The IR model of a folded ``proto`` with the big weights set aside by :func:`without_big_weights`
    put back as initializers (the same tensors: nothing is read), in ``like``'s initializer order."""
    model = G.from_proto(proto)
    g = model.graph
    for v in [v for v in g.inputs if v.name in big]:
        g.inputs.remove(v)
        v.const_value = big[v.name].const_value
        g.register_initializer(v)
    rank = {n: i for i, n in enumerate(like.graph.initializers)}
    order = sorted(g.initializers.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    g.initializers.clear()
    for _, v in order:
        g.register_initializer(v)
    return model


def same_graph(a: ir.Model, b: ir.Model) -> bool:
    """True when two models differ at most in node order (onnxsim's topological sort is not stable)."""
    return _canonical(a) == _canonical(b)


def _canonical(m: ir.Model) -> tuple:
    nodes = sorted(
        (
            n.op_type,
            n.domain,
            tuple(v.name if v is not None else "" for v in n.inputs),
            tuple(v.name for v in n.outputs),
            tuple(sorted((k, _attr_key(a)) for k, a in n.attributes.items())),
        )
        for n in m.graph
    )
    inits = sorted(
        (n, G.tensor_hash(v.const_value))
        for n, v in m.graph.initializers.items()
        if v.const_value is not None
    )
    io = (tuple(v.name for v in m.graph.inputs), tuple(v.name for v in m.graph.outputs))
    return tuple(nodes), tuple(inits), io


def _attr_key(a: ir.Attr) -> str:
    if a.type == ir.AttributeType.TENSOR:
        return G.tensor_hash(a.value)
    return repr(a.value)
