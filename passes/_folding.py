"""Shared by the folding passes: which graphs they must skip, and comparing a folded graph with its source."""

from __future__ import annotations

import logging

import onnx_ir as ir

from vlmc import ascend_limits, interop

logger = logging.getLogger(__name__)

# Quantized graphs keep int8/int4 weights behind a dequantize subgraph; folding that subgraph would
# turn them back into float weights and silently undo the compression.
_COMPRESSED = ascend_limits.QUANTIZED_PRECISIONS


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


def same_graph(a: ir.Model, b: ir.Model) -> bool:
    """True when two models differ at most in node order (onnxsim's topological sort is not stable)."""
    return _canonical(a) == _canonical(b)


def _canonical(m: ir.Model) -> tuple:
    tensors = [a.value for n in m.graph for a in n.attributes.values() if a.type == ir.AttributeType.TENSOR]
    hashes = dict(zip(map(id, tensors), interop.tensor_hashes(tensors)))
    nodes = sorted(
        (
            n.op_type,
            n.domain,
            tuple(v.name if v is not None else "" for v in n.inputs),
            tuple(v.name for v in n.outputs),
            tuple(sorted((k, _attr_key(a, hashes)) for k, a in n.attributes.items())),
        )
        for n in m.graph
    )
    weights = interop.weight_hashes(m)
    inits = sorted((n, weights[v]) for n, v in m.graph.initializers.items() if v in weights)
    io = (tuple(v.name for v in m.graph.inputs), tuple(v.name for v in m.graph.outputs))
    return tuple(nodes), tuple(inits), io


def _attr_key(a: ir.Attr, hashes: dict[int, str]) -> str:
    if a.type == ir.AttributeType.TENSOR:
        return hashes[id(a.value)]
    return repr(a.value)
