"""The precheck: what ATC would reject after minutes, found before anything is written."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import onnx

from vlmc import graphs as G
from vlmc.backends.ascend import ops

logger = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 1  # protobuf cannot serialize a message of 2 GB or more
# Ops the lowering turns into Ascend forms; in a portable graph they are expected, not errors.
LOWERED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
DATA_DEPENDENT = frozenset({"NonZero", "Compress", "Unique"})
KNOWN_DIMS = frozenset(
    {"batch", "sequence", "past_sequence", "total_sequence", "images", "patches", "num_blocks", "max_blocks"}
)


@dataclass(frozen=True)
class Finding:
    """One precheck result; errors stop the compile, warnings are reported."""

    graph: str
    message: str
    node: str | None = None
    severity: str = "error"

    def __str__(self) -> str:
        where = f"{self.graph}: node {self.node!r}" if self.node else self.graph
        return f"{where}: {self.message}"


def _iter_nodes(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _iter_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from _iter_nodes(sub)


def check_ops(model: onnx.ModelProto, graph: str, lowered: bool) -> list[Finding]:
    """Every node's op type at the model's opset against ATC's parser table.

    Args:
        model: the graph.
        graph: its name, for messages.
        lowered: False for a portable graph (QDQ allowed: the lowering removes it), True for what ATC reads.
    """
    versions = {o.domain or "": int(o.version) for o in model.opset_import}
    if "ai.onnx" in versions and "" not in versions:
        versions[""] = versions["ai.onnx"]
    opset = versions.get("")
    out: list[Finding] = []
    if opset is None or not ops.MIN_OPSET <= opset <= ops.MAX_OPSET:
        out.append(
            Finding(
                graph,
                f"ai.onnx opset {opset} is outside ATC's {ops.MIN_OPSET}-{ops.MAX_OPSET}; every op "
                f"fails to parse; export at opset {ops.RECOMMENDED_OPSET}",
            )
        )
    unsupported: dict[str, list[str]] = {}
    for i, n in enumerate(_iter_nodes(model.graph)):
        name = n.name or f"{n.op_type}_{i}"
        domain = n.domain or ""
        label = f"{domain}::{n.op_type}" if domain not in ("", "ai.onnx") else n.op_type
        if not lowered and domain in ("", "ai.onnx") and n.op_type in LOWERED_OPS:
            continue
        if not ops.supported(n.op_type, domain, versions):
            unsupported.setdefault(label, []).append(name)
            continue
        if n.op_type == "ScatterND" and _attr_str(n, "reduction") == "mul":
            out.append(
                Finding(graph, "ScatterND reduction=mul has no ATC parser; use reduction none or add", name)
            )
        if n.op_type in DATA_DEPENDENT:
            out.append(
                Finding(
                    graph,
                    f"{n.op_type} has a data-dependent output shape, which defeats static compilation",
                    name,
                    "warning",
                )
            )
    for label, names in unsupported.items():
        op_type = label.split("::")[-1]
        domain = label.split("::")[0] if "::" in label else ""
        shown = ", ".join(repr(n) for n in names[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
        out.append(
            Finding(
                graph,
                f"{label} at opset {opset} is not supported by ATC (nodes {shown}); "
                f"{ops.suggestion(op_type, domain, opset)}",
                names[0],
            )
        )
    return out


def _attr_str(node: onnx.NodeProto, name: str) -> str | None:
    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def protobuf_bytes(model: onnx.ModelProto) -> int:
    """Size of the .onnx protobuf once large tensors are moved to external data (as graphs.save does)."""
    total = 0
    for t in model.graph.initializer:
        size = t.ByteSize()
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= G.EXTERNAL_DATA_THRESHOLD:
            size -= len(t.raw_data)
        total += size
    for part in (model.graph.node, model.graph.input, model.graph.output, model.graph.value_info):
        total += sum(p.ByteSize() for p in part)
    return total


def check_size(model: onnx.ModelProto, graph: str) -> list[Finding]:
    size = protobuf_bytes(model)
    if size >= PROTOBUF_LIMIT:
        return [
            Finding(
                graph,
                f"the .onnx protobuf would be {size / 2**30:.2f} GB; ATC reads protobufs under 2 GB; "
                "move Constant-node tensors into initializers so they go to external data",
            )
        ]
    return []


def check_external_data(path: Path, graph: str) -> list[Finding]:
    """External data files referenced by an on-disk graph exist and are long enough."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several types for truncated files
        return [Finding(graph, f"{path.name} is not a readable ONNX file ({type(exc).__name__})")]
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    out = []
    for t in _get_all_tensors(model):
        if not uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        loc = path.parent / info.get("location", "")
        if not loc.is_file():
            out.append(
                Finding(
                    graph,
                    f"external data {loc.name} for tensor {t.name!r} is missing; copy the whole "
                    "package directory",
                )
            )
            break
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > loc.stat().st_size:
            out.append(Finding(graph, f"external data {loc.name} is truncated (tensor {t.name!r})"))
            break
    return out


def check_inputs(
    model: onnx.ModelProto, graph: str, known: set[str], sample_inputs: set[str]
) -> list[Finding]:
    """Every dynamic input axis must be a dim vlmc plans gears for, a dim the target sizes, or sampled."""
    out = []
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            out.append(Finding(graph, f"input {vi.name} has no shape; export with named dynamic axes"))
            continue
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                continue
            sym = d.dim_param or f"{vi.name}[{i}]"
            if sym in KNOWN_DIMS or sym in known or vi.name in sample_inputs:
                continue
            out.append(
                Finding(
                    graph,
                    f"input {vi.name} dim {i} ({d.dim_param or 'unnamed'}) is dynamic and vlmc "
                    f"cannot size it; name it at export or give target dims {{{sym!r}: N}}",
                )
            )
    return out
