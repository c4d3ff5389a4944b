"""onnx-ir graph helpers shared by the passes and backends: opening a file as IR, node names, facts.

Graphs live in memory as onnx-ir models (``onnx_ir.Model``) whose weights stay in their files and
are read (memory-mapped) only when something asks for their bytes; every helper here takes that
form, reads no weight and touches no protobuf. The bytes of a graph are :mod:`vlmc.interop`'s
(writing, checking, content hashes and fingerprints, data files, every ModelProto), which builds on
this module (never the reverse); the manifest's view of a graph (its signature) is
:mod:`vlmc.package`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# ATC parses ai.onnx opsets 9..18 (docs/atc-facts.md); exporters write 17.
EXPORT_OPSET = 17


# ---- node names ----------------------------------------------------------------------------------


class _IndexedNames:
    """NameFixPass naming: an unnamed node is ``<op_type>_<its index in the graph>``."""

    def __init__(self, graph: ir.Graph) -> None:
        self._index = {node: i for i, node in enumerate(graph)}

    def generate_node_name(self, node: ir.Node) -> str:
        return node.name or f"{node.op_type}_{self._index.get(node, 0)}"

    def generate_value_name(self, value: ir.Value) -> str:
        return value.name or "v"


def name_nodes(model: ir.Model) -> None:
    """Give every node a unique name, in place: an unnamed one is ``<op_type>_<index>`` (onnx-ir's NameFixPass).

    Node names are how users, quantize's facts and the backends refer to nodes (keep_fp32 lists,
    precheck messages). NameFixPass also names unnamed values; an omitted optional output ("")
    must stay omitted, so those keep their empty name.
    """
    omitted = [o for n in model.graph.all_nodes() for o in n.outputs if not o.name]
    NameFixPass(_IndexedNames(model.graph))(model)
    for o in omitted:
        o.name = ""


def node_names(model: ir.Model) -> list[str]:
    """The name :func:`name_nodes` gives each node of the main graph, in order; the model is not changed."""
    named = model.clone()  # shares the weight tensors: nothing is read
    name_nodes(named)
    return [n.name for n in named.graph]


# ---- the in-memory IR ---------------------------------------------------------------------------


def load_ir(path: str | Path) -> ir.Model:
    """Open a graph file as an onnx-ir model; weights stay in the file until their bytes are read."""
    path = Path(path)
    if not path.is_file():
        raise VlmcError(f"graph file {path} is missing")
    try:
        return ir.load(str(path))
    except Exception as exc:  # protobuf raises several types for truncated files
        raise VlmcError(
            f"{path} is not a readable ONNX file ({type(exc).__name__}); re-export the package"
        ) from exc


# ---- facts ----------------------------------------------------------------------------------------


def initializer_bytes(model: ir.Model) -> int:
    """Bytes of weight data in a graph (initializers plus Constant tensors)."""
    total = sum(
        v.const_value.nbytes
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )
    for node in model.graph:
        if node.op_type == "Constant" and node.domain == "":
            for a in node.attributes.values():
                if a.type == ir.AttributeType.TENSOR:
                    total += a.value.nbytes
    return total


def op_histogram(model: ir.Model) -> dict[str, int]:
    """Count of nodes per (domain-qualified) op type."""
    hist: dict[str, int] = {}
    for node in model.graph:
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))
