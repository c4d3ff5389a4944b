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

import numpy as np
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


# ---- the LM head on the last position ------------------------------------------------------------

# The LM head forms recognised: a MatMul (FP32, or the portable weight-only dequant chain) or the
# MatMulNBits the ort lowering makes of it; both are position-wise in their first input.
_LM_HEADS = {("", "MatMul"), ("ai.onnx", "MatMul"), ("com.microsoft", "MatMulNBits")}


def _reads_graph_input(v: ir.Value, graph: ir.Graph) -> bool:
    """Whether ``v`` depends on any graph input (a weight, even a dequantized one, does not)."""
    inputs = {id(i) for i in graph.inputs}
    seen: set[int] = set()
    stack = [v]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if id(cur) in inputs:
            return True
        node = cur.producer()
        if node is not None:
            stack.extend(i for i in node.inputs if i is not None)
    return False


def slice_lm_head(model: ir.Model, output: str, through=frozenset(), name: str = "last_logits") -> dict:
    """Make the LM head behind graph output ``output`` compute the last position only, in place: a ``Slice``
    (axis 1, the last row) on its input. The output keeps its name and rank; its sequence axis becomes 1,
    so ``output[:, -1, :]`` is the same tensor as before. Between the head and the output may stand ops of
    ``through`` with one varying input and constant others (a softcap's Div/Tanh/Mul, a bias Add, a Cast:
    position-wise). Returns the facts: ``sliced`` (0 or 1) and ``head``, or ``skipped`` with the reason;
    nothing is changed when skipped. Initializers and the node are named after ``name``."""
    graph = model.graph
    out: dict = {"sliced": 0}
    logits = next((o for o in graph.outputs if o.name == output), None)
    if logits is None:
        out["skipped"] = f"no {output!r} output"
        return out
    head = logits.producer()
    while head is not None and head.op_type in through and (head.domain, head.op_type) not in _LM_HEADS:
        varying = [
            i for i in head.inputs if i is not None and i.const_value is None and not i.is_initializer()
        ]
        if len(varying) != 1:
            break
        head = varying[0].producer()
    if head is None or (head.domain, head.op_type) not in _LM_HEADS:
        out["skipped"] = f"{output!r} is not produced by a MatMul or MatMulNBits"
        return out
    hidden = head.inputs[0]
    # The exporters leave intermediate shapes unset; the graph output's rank is the interface.
    if (
        hidden is None
        or (hidden.shape is not None and len(hidden.shape) != 3)
        or len(logits.shape or ()) != 3
    ):
        out["skipped"] = "the LM head's input or output is not rank 3 [batch, sequence, hidden]"
        return out
    if _reads_graph_input(head.inputs[1], graph):
        out["skipped"] = "the LM head's weight is computed from a graph input"
        return out
    # Other readers of the hidden states (an output, a later op) keep every position: only the head's
    # read is sliced.
    consts = []
    for part, arr in (("starts", [-1]), ("ends", [np.iinfo(np.int64).max]), ("axes", [1])):
        arr = np.asarray(arr, np.int64)
        v = ir.Value(name=f"{name}_{part}", const_value=ir.tensor(arr, name=f"{name}_{part}"))
        v.shape, v.type = ir.Shape(arr.shape), ir.TensorType(ir.DataType.INT64)
        graph.register_initializer(v)
        consts.append(v)
    node = ir.node("Slice", [hidden, *consts], name=name)
    sliced = node.outputs[0]
    sliced.name = f"{name}_hidden"
    sliced.type = hidden.type
    if hidden.shape is not None:
        sliced.shape = ir.Shape([hidden.shape[0], 1, hidden.shape[2]])
    graph.insert_before(head, node)
    head.replace_input_with(0, sliced)
    logits.shape = ir.Shape([logits.shape[0], 1, logits.shape[2]])
    out["sliced"] = 1
    out["head"] = f"{head.domain + '.' if head.domain else ''}{head.op_type}"
    return out
