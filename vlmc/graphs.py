"""ONNX graph helpers shared by the package, passes and backends: IO, signatures, fingerprints, checks.

Graphs live in memory as onnx-ir models (``onnx_ir.Model``) whose weights stay in their files and
are read (memory-mapped) only when something asks for their bytes; every helper here takes that
form. The only protobuf work left is reading a graph file's header to check it before it is opened
(:func:`open_checked`); tools written against ModelProto go through :mod:`vlmc.interop`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from vlmc import paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# ATC parses ai.onnx opsets 9..18 (docs/atc-facts.md); exporters write 17.
EXPORT_OPSET = 17
# Tensors at least this large go to external data so that the .onnx protobuf stays small.
EXTERNAL_DATA_THRESHOLD = 1024


def dtype_name(elem_type: int) -> str:
    """ONNX TensorProto element type -> numpy-style name ('float32', 'int64', ...)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def elem_type(dtype_name_: str) -> int:
    """numpy-style dtype name -> ONNX TensorProto element type."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype_name_))


def signature(model: ir.Model) -> dict:
    """The graph's inputs and outputs: names, dtypes and (symbolic) shapes, as stored in the manifest."""
    return {
        "inputs": [_value_entry(v) for v in model.graph.inputs if not v.is_initializer()],
        "outputs": [_value_entry(v) for v in model.graph.outputs],
    }


def open_checked(path: str | Path) -> ir.Model:
    """Open a graph file of an untrusted package as IR, after checking its external data entries.

    The file's protobuf is read without its weights, every external data entry is checked against
    the confinement rule and the data file's size (:func:`check_external_data`), and only then is
    it wrapped as an onnx-ir model (weights stay in the file). Raises a one-line VlmcError.
    """
    path = Path(path)
    if not path.is_file():
        raise VlmcError(f"graph file {path} is missing")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several types for truncated files
        raise VlmcError(
            f"{path} is not a readable ONNX file ({type(exc).__name__}); re-export the package"
        ) from exc
    check_external_data(proto, path.parent)
    model = ir.from_proto(proto)
    ir.external_data.set_base_dir(model.graph, path.parent)
    return model


def check_external_data(model: onnx.ModelProto, base: Path) -> None:
    """Raise a one-line VlmcError if an external data file is missing or too short (nothing is read)."""
    from onnx.external_data_helper import uses_external_data

    sizes: dict[Path, int] = {}
    for tensor in _all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        try:  # the one confinement rule (vlmc/paths.py), symlinks followed
            location = paths.inside(
                base, info.get("location", ""), f"external data of tensor {tensor.name!r}", str(base)
            )
        except VlmcError:
            raise VlmcError(
                f"tensor {tensor.name!r} points at external data {info.get('location')!r} outside "
                f"{base}; re-export the package"
            ) from None
        if location not in sizes:
            if not location.is_file():
                raise VlmcError(
                    f"external data {location} for tensor {tensor.name!r} is missing; "
                    "copy the whole package directory or re-export it"
                )
            sizes[location] = location.stat().st_size
        try:
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
        except ValueError:
            raise VlmcError(
                f"tensor {tensor.name!r} has a malformed external data entry; re-export the package"
            ) from None
        if end > sizes[location]:
            raise VlmcError(
                f"external data {location} is truncated (tensor {tensor.name!r} needs bytes up to {end}, "
                f"the file has {sizes[location]}); copy the whole package again or re-export it"
            )


def _value_entry(v: ir.Value) -> dict:
    shape: list[int | str] = []
    for d in v.shape or ():
        if isinstance(d, int):
            shape.append(d)
        else:
            shape.append(d.value if d.value is not None else "?")
    dtype = np.dtype(v.dtype.numpy()).name if v.dtype is not None else "undefined"
    return {"name": v.name, "dtype": dtype, "shape": shape}


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


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _large_initializers(model: ir.Model) -> list[ir.Value]:
    return [
        v
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None and v.const_value.nbytes >= EXTERNAL_DATA_THRESHOLD
    ]


def save(model: ir.Model, path: str | Path) -> None:
    """Save a graph with its large tensors in one external data file named ``<file>.data``.

    onnx-ir streams each weight from where it lives (its source file, memory-mapped, or memory) to
    the data file one tensor at a time; the model is left unchanged. Offsets are 64-byte aligned so
    runtimes can map tensors in place.
    """
    path = Path(path)
    m = model
    values = [v for g in m.graphs() for v in g.initializers.values()]
    tensors = [v.const_value for v in values]
    try:
        ir.external_data.unload_from_model(
            m,
            path.parent,
            path.name + ".data",
            size_threshold_bytes=EXTERNAL_DATA_THRESHOLD - 1,  # onnx-ir externalizes sizes above it
            alignment=64,
            align_threshold=0,
        )
        _write_proto(ir.to_proto(m), m, path)
    finally:
        for v, t in zip(values, tensors):
            v.const_value = t
        release(tensors)
    data = path.parent / (path.name + ".data")
    if data.exists() and data.stat().st_size == 0:
        data.unlink()


def release(tensors) -> None:
    """Close the memory maps of tensors read from files (their pages count as resident while mapped).

    A released tensor maps its file again when it is next read, so this is always safe.
    """
    for t in tensors:
        if isinstance(t, ir.ExternalTensor):
            t.release()


def _write_proto(proto: onnx.ModelProto, m: ir.Model, path: Path) -> None:
    drop_initializer_infos(proto, m)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def drop_initializer_infos(proto: onnx.ModelProto, m: ir.Model) -> None:
    """Leave initializers out of a proto's value_info (onnx-ir lists them there), in place."""
    # onnx-ir describes initializers in value_info too; tools such as onnxruntime's float16 converter
    # take a value_info entry for an activation, so they are left out, as onnx's own protos do.
    infos = [v for v in proto.graph.value_info if v.name not in m.graph.initializers]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(infos)


def save_shared(models: dict[Path, ir.Model], data_path: Path) -> None:
    """Save graphs whose large tensors go to one data file, each distinct content stored once.

    Used for graphs that share weights (the merged ``vlm`` graph and the text-only decode path
    beside it). onnx-ir's writer handles one model per file, so the shared file is written here and
    each model is then serialized with its tensors pointing into it.
    """
    data_path = Path(data_path)
    irs = {Path(p): m for p, m in models.items()}
    written: dict[str, tuple[int, int]] = {}
    offset = 0
    swaps: list[tuple[ir.Value, object]] = []
    try:
        with open(data_path, "wb") as data:
            for m in irs.values():
                for v in _large_initializers(m):
                    t = v.const_value
                    key = tensor_hash(t)
                    if key not in written:
                        pad = (-offset) % 64
                        data.write(b"\0" * pad)
                        offset += pad
                        raw = t.tobytes()
                        data.write(raw)
                        written[key] = (offset, len(raw))
                        offset += len(raw)
                        del raw
                    off, length = written[key]
                    ext = ir.ExternalTensor(
                        data_path.name,
                        off,
                        length,
                        t.dtype,
                        shape=t.shape,
                        name=t.name,
                        base_dir=data_path.parent,
                    )
                    swaps.append((v, t))
                    v.const_value = ext
        for path, m in irs.items():
            _write_proto(ir.to_proto(m), m, path)
    finally:
        for v, t in reversed(swaps):
            v.const_value = t
    if not written:
        data_path.unlink(missing_ok=True)


def _all_tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


# ---- fingerprints --------------------------------------------------------------------------------

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


def fingerprint(model: ir.Model) -> str:
    """A content hash of a graph, used by the pass manager to see what a pass changed.

    Structure (nodes, attributes, IO, opsets, names, dtypes and shapes) and every weight's bytes are
    hashed exactly; a weight's hash is computed once (see :func:`tensor_hash`), so fingerprinting
    again after a pass that did not touch the weights reads nothing.
    """
    m = model
    h = hashlib.sha256()
    swaps = []
    try:
        # The structure is hashed from a serialization with every initializer replaced by a stub that
        # names its content hash, so no weight bytes are serialized.
        for g in m.graphs():
            for v in g.initializers.values():
                t = v.const_value
                if t is None:
                    continue
                stub = ir.ExternalTensor(tensor_hash(t), 0, t.nbytes, t.dtype, shape=t.shape, name=t.name)
                swaps.append((v, t))
                v.const_value = stub
        proto = ir.to_proto(m)
    finally:
        for v, t in reversed(swaps):
            v.const_value = t
    proto.ClearField("producer_name")
    proto.ClearField("producer_version")
    h.update(proto.SerializeToString(deterministic=True))
    return h.hexdigest()


# ---- checks --------------------------------------------------------------------------------------


# int64 initializers up to this size stay inline in :func:`check`: shape inference's data
# propagation reads int64 constants (shape arithmetic, e.g. paged_kv's block offsets, 1 KiB at
# block_size 128) and fails on external ones. Weights (float, int8/int4, int32 biases) never are.
CHECK_INLINE_INT64_BYTES = 1 << 16


def check(model: ir.Model, name: str = "graph") -> None:
    """Run onnx.checker (full) and strict shape inference on a graph; raise a one-line VlmcError.

    The graph is written without its weights: every large initializer points into a sparse file of
    the right size (the checker and shape inference need only dtypes and shapes), so this works for
    models over the protobuf limit and reads no weight bytes. int64 tensors of at most
    :data:`CHECK_INLINE_INT64_BYTES` (shape data, not weights) are kept inline.
    """
    m = model
    with tempfile.TemporaryDirectory() as tmp:
        swaps = []
        size = 0
        try:
            for v in _large_initializers(m):
                t = v.const_value
                swaps.append((v, t))
                if t.dtype == ir.DataType.INT64 and t.nbytes <= CHECK_INLINE_INT64_BYTES:
                    # Shape arithmetic: data propagation needs the values (they are small, and read).
                    v.const_value = ir.tensor(np.array(t.numpy()), name=t.name)
                    continue
                v.const_value = ir.ExternalTensor(
                    "weights", size, t.nbytes, t.dtype, shape=t.shape, name=t.name, base_dir=tmp
                )
                size += t.nbytes
            with open(os.path.join(tmp, "weights"), "wb") as f:
                f.truncate(size)
            path = os.path.join(tmp, "graph.onnx")
            proto = ir.to_proto(m)
        finally:
            for v, t in reversed(swaps):
                v.const_value = t
        with open(path, "wb") as f:
            f.write(proto.SerializeToString(deterministic=True))
        del proto
        check_path(path, name)


def check_path(path: str | Path, name: str = "graph") -> None:
    """:func:`check` on a graph file; its external data is only located, never read."""
    path = str(path)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            onnx.checker.check_model(path, full_check=True)
            onnx.shape_inference.infer_shapes_path(
                path, os.path.join(tmp, "inferred.onnx"), check_type=True, strict_mode=True, data_prop=True
            )
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VlmcError(f"{name}: ONNX check failed: {first}") from exc


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
