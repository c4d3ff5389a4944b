"""The precheck: what ATC would reject after minutes, found before anything is written."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from vlmc import interop
from vlmc.backends.ascend import ops

logger = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 1
# acl_mdl.h: aclmdlIODims.dims[ACL_MAX_DIM_CNT]; aclmdlSetInputDynamicDims takes every input's full shape in it.
ACL_MAX_DIM_CNT = 128  # protobuf cannot serialize a message of 2 GB or more
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


def check_ops(model: ir.Model, graph: str, lowered: bool) -> list[Finding]:
    """Every node's op type at the model's opset against ATC's parser table.

    Args:
        model: the graph.
        graph: its name, for messages.
        lowered: False for a portable graph (QDQ allowed: the lowering removes it), True for what ATC reads.
    """
    versions = {domain or "": int(version) for domain, version in model.opset_imports.items()}
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
    for i, n in enumerate(ir.traversal.RecursiveGraphIterator(model.graph)):
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


def _attr_str(node: ir.Node, name: str) -> str | None:
    a = node.attributes.get(name)
    if a is None:
        return None
    return a.value.decode() if isinstance(a.value, bytes) else str(a.value)


def check_size(model: ir.Model, graph: str) -> list[Finding]:
    size = interop.protobuf_bytes(model)  # serialized with weightless stubs: no weight is read
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
    """External data files referenced by an on-disk graph exist and are long enough (nothing is read)."""
    try:
        model = ir.load(str(path))
    except Exception as exc:  # protobuf raises several types for truncated files
        return [Finding(graph, f"{path.name} is not a readable ONNX file ({type(exc).__name__})")]
    tensors = [v.const_value for g in model.graphs() for v in g.initializers.values()]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        tensors += [a.value for a in node.attributes.values() if a.type == ir.AttributeType.TENSOR]
    out = []
    for t in tensors:
        if not isinstance(t, ir.ExternalTensor):
            continue
        loc = path.parent / t.location
        if not loc.is_file():
            out.append(
                Finding(
                    graph,
                    f"external data {loc.name} for tensor {t.name!r} is missing; copy the whole "
                    "package directory",
                )
            )
            break
        if t.offset + t.length > loc.stat().st_size:
            out.append(Finding(graph, f"external data {loc.name} is truncated (tensor {t.name!r})"))
            break
    return out


def check_inputs(model: ir.Model, graph: str, known: set[str], sample_inputs: set[str]) -> list[Finding]:
    """Every dynamic input axis must be a dim vlmc plans gears for, a dim the target sizes, or sampled."""
    out = []
    for vi in model.graph.inputs:
        if vi.is_initializer():
            continue
        if vi.shape is None:
            out.append(Finding(graph, f"input {vi.name} has no shape; export with named dynamic axes"))
            continue
        for i, d in enumerate(vi.shape):
            if isinstance(d, int):
                continue
            sym = d.value or f"{vi.name}[{i}]"
            if sym in KNOWN_DIMS or sym in known or vi.name in sample_inputs:
                continue
            out.append(
                Finding(
                    graph,
                    f"input {vi.name} dim {i} ({d.value or 'unnamed'}) is dynamic and vlmc "
                    f"cannot size it; name it at export or give target dims {{{sym!r}: N}}",
                )
            )
    return out


def check_dims_vector(build: str, input_shape: list[tuple[str, list[int]]], has_gears: bool) -> list[Finding]:
    """A build with gears passes every input's full shape to aclmdlSetInputDynamicDims in one aclmdlIODims,
    whose ``dims`` holds ACL_MAX_DIM_CNT = 128 values (acl_mdl.h; the aclmdlSetInputDynamicDims page,
    https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0312.html).
    A longer vector cannot be set at run time, so the build is refused here."""
    count = sum(len(dims) for _, dims in input_shape)
    if not has_gears or count <= ACL_MAX_DIM_CNT:
        return []
    return [
        Finding(
            build,
            f"its dims vector has {count} values ({len(input_shape)} inputs' full shapes) but "
            f"aclmdlSetInputDynamicDims takes at most ACL_MAX_DIM_CNT = {ACL_MAX_DIM_CNT}; use fewer gear "
            "symbols or static shapes for this build (one value per gear list: batch_sizes, buckets)",
        )
    ]
