"""onnx-ir graph helpers shared by the package, passes and backends: opening, signatures, weight hashes.

Graphs live in memory as onnx-ir models (``onnx_ir.Model``) whose weights stay in their files and
are read (memory-mapped) only when something asks for their bytes; every helper here takes that
form and none touches protobuf: writing, checking, fingerprinting and every ModelProto are in
:mod:`vlmc.interop`, which builds on this module (never the reverse).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# ATC parses ai.onnx opsets 9..18 (docs/atc-facts.md); exporters write 17.
EXPORT_OPSET = 17
# Tensors at least this large go to external data so that the .onnx protobuf stays small.
EXTERNAL_DATA_THRESHOLD = 1024


def signature(model: ir.Model) -> dict:
    """The graph's inputs and outputs: names, dtypes and (symbolic) shapes, as stored in the manifest."""
    return {
        "inputs": [_value_entry(v) for v in model.graph.inputs if not v.is_initializer()],
        "outputs": [_value_entry(v) for v in model.graph.outputs],
    }


def _value_entry(v: ir.Value) -> dict:
    shape: list[int | str] = []
    for d in v.shape or ():
        if isinstance(d, int):
            shape.append(d)
        else:
            shape.append(d.value if d.value is not None else "?")
    dtype = np.dtype(v.dtype.numpy()).name if v.dtype is not None else "undefined"
    return {"name": v.name, "dtype": dtype, "shape": shape}


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


def release(tensors) -> None:
    """Close the memory maps of tensors read from files (their pages count as resident while mapped).

    A released tensor maps its file again when it is next read, so this is always safe.
    """
    for t in tensors:
        if isinstance(t, ir.ExternalTensor):
            t.release()


# ---- weight hashes (interop.fingerprint hashes the structure around them) -------------------

_HASH_KEY = "vlmc.sha256"
# Content hashes of external tensors by where they are stored. vlmc writes every data file once and
# never changes it, so a tensor read again from the same place is not hashed again.
_EXTERNAL_HASHES: dict[tuple, str] = {}


def tensor_hash(t) -> str:
    """sha256 of a tensor's dtype, shape and bytes, computed once per tensor.

    The hash is kept on the tensor (onnx-ir metadata) and, for tensors stored in a file, by their
    file, offset and length, so the manager's before/after fingerprints cost one read of each
    weight per build, not one per pass.
    """
    cached = t.meta.get(_HASH_KEY)
    if cached is not None:
        return cached
    key = None
    if isinstance(t, ir.ExternalTensor):
        p = Path(t.path)
        try:
            st = p.stat()
            key = (str(p.resolve()), st.st_ino, st.st_mtime_ns, t.offset, t.length)
        except OSError:
            key = None
        if key in _EXTERNAL_HASHES:
            t.meta[_HASH_KEY] = _EXTERNAL_HASHES[key]
            return _EXTERNAL_HASHES[key]
    # A file-backed weight mapped in only to be hashed is unmapped again (see _external_digest).
    if isinstance(t, ir.ExternalTensor):
        digest = _external_digest(t)
    else:
        digest = _digest(int(t.dtype), list(t.shape.numpy()), t.tobytes())
    t.meta[_HASH_KEY] = digest
    if key is not None:
        _EXTERNAL_HASHES[key] = digest
    return digest


def tensor_hashes(tensors) -> list[str]:
    """:func:`tensor_hash` of each tensor, in order."""
    return [tensor_hash(t) for t in tensors]


def weight_hashes(model: ir.Model) -> dict[ir.Value, str]:
    """:func:`tensor_hash` of every initializer (of every graph) that holds a tensor, by its value."""
    values = [v for g in model.graphs() for v in g.initializers.values() if v.const_value is not None]
    return dict(zip(values, tensor_hashes(v.const_value for v in values)))


def _external_digest(t: ir.ExternalTensor) -> str:
    """:func:`_digest` of a tensor stored in a file, hashed in place from its memory map.

    ``tobytes()`` would copy the tensor, and the map onnx-ir opens (the whole data file) would stay
    open with every page hashed still resident: after fingerprinting a package, its process would
    hold all its weights. A tensor that was not mapped before is released again at once, so hashing
    costs at most the tensor being hashed.
    """
    if t.nbytes == 0:
        return _digest(int(t.dtype), list(t.shape.numpy()), b"")
    mapped = t.raw is not None
    if not mapped:
        t.numpy()  # onnx-ir maps the file (checking the path is inside the base directory)
    try:
        h = digest_start(int(t.dtype), list(t.shape.numpy()))
        offset = t.offset or 0
        with memoryview(t.raw) as view, view[offset : offset + (t.length or t.nbytes)] as data:
            h.update(data)
        return h.hexdigest()
    finally:
        if not mapped:
            t.release()


def digest_start(dtype: int, dims: list[int]):
    """The sha256 :func:`tensor_hash` uses, before the tensor's bytes are fed to it."""
    return hashlib.sha256(f"{dtype}|{[int(d) for d in dims]}|".encode())


def _digest(dtype: int, dims: list[int], raw: bytes) -> str:
    h = digest_start(dtype, dims)
    h.update(raw)
    return h.hexdigest()


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


def remember_hashes(data_path: Path, entries: list[tuple[int, int, str]]) -> None:
    """Record content hashes of tensors just written to ``data_path`` as (offset, length, sha256)."""
    p = Path(data_path)
    st = p.stat()
    for offset, length, digest in entries:
        _EXTERNAL_HASHES[(str(p.resolve()), st.st_ino, st.st_mtime_ns, offset, length)] = digest


class TensorStore:
    """Tensors a pass makes, written to a data file as they are made and read back memory-mapped.

    A pass that rewrites weights one at a time (quantize) puts each result here, so it holds at most
    the tensor it is working on; saving the package later streams them into the package's data file.
    Small tensors (under :data:`EXTERNAL_DATA_THRESHOLD`) stay in memory. The content hash is
    computed while writing, so fingerprints never read the file back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close() or the finalizer)
        self._offset = 0
        import weakref

        weakref.finalize(self, self._f.close)

    def put(self, arr: np.ndarray, name: str) -> ir.TensorProtocol:
        arr = np.ascontiguousarray(arr)
        if arr.nbytes < EXTERNAL_DATA_THRESHOLD:
            return ir.tensor(arr, name=name)
        pad = (-self._offset) % 64
        self._f.write(b"\0" * pad)
        self._offset += pad
        raw = memoryview(arr).cast("B")
        self._f.write(raw)
        self._f.flush()
        dtype = ir.DataType.from_numpy(arr.dtype)
        t = ir.ExternalTensor(
            self.path.name,
            self._offset,
            arr.nbytes,
            dtype,
            shape=ir.Shape(arr.shape),
            name=name,
            base_dir=self.path.parent,
        )
        h = digest_start(int(dtype), list(arr.shape))
        h.update(raw)
        t.meta[_HASH_KEY] = h.hexdigest()
        self._offset += arr.nbytes
        return t

    def close(self) -> None:
        self._f.close()
