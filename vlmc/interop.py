"""The one seam between vlmc's IR (onnx_ir.Model) and a graph's bytes: every ModelProto vlmc builds or
reads, the graph and data files, and the content hashes of what they store.

vlmc keeps every graph as an onnx-ir model whose weights stay in their files. Everything that
touches ``onnx.ModelProto`` is here; the rest of vlmc works on onnx-ir:

* :func:`tensor_hash` / :func:`weight_hashes` / :func:`fingerprint` — content hashes: a weight's
  sha256, computed once (kept on the tensor and by its stored location), and a graph's (its
  structure serialized with every weight as a stub naming its hash); :class:`TensorStore` — a data
  file for the tensors a pass makes, hashed as they are written; :func:`release` — a file-backed
  tensor's memory map closed; :data:`EXTERNAL_DATA_THRESHOLD` — from which size a tensor is stored
  as external data.

* :func:`weightless` — THE stub swap: a ModelProto of the graph with chosen initializers holding
  stub tensors (an external pointer, a sparse placeholder, a content hash), the very same tensor
  objects put back before the proto is handed out; :func:`serialized` and :func:`write` are it as
  bytes and as a file. Writers, fingerprints, checks, size estimates and sessions use it.
* :func:`save` / :func:`point_at` — the graph file writer and external-data pointing.
* :func:`open_checked` / :func:`check_external_data` — an untrusted graph file's header checked
  before it is opened as IR; :func:`check` / :func:`check_path` — onnx.checker and shape inference;
  :func:`protobuf_bytes` — the size a graph's .onnx file will have.
* :func:`as_proto` — for foreign tools (onnxsim, onnx-graphsurgeon, onnxruntime.quantization,
  onnx.utils.Extractor): a ModelProto in which every weight of ``weight_limit`` bytes or more is a
  graph *input* (a value the tool cannot know, so it never reads or copies it). On exit the tool's
  result, if given back, becomes an IR model holding the same weight tensors (nothing is read).
  ``weight_limit=None`` reads every weight in (only for tools that need all values and graphs known
  to be small).
* :func:`as_file` — the graph saved to a file (weights streamed one tensor at a time), for tools
  that take a path (quantize_static, calibrators, InferenceSession on graphs over 2 GB).
* :func:`load_result` — a file a tool wrote, opened as IR (weights memory-mapped, not read).
* :func:`session_bytes` / :func:`outputs_suffix` — serialized graphs for in-memory sessions.
* :func:`exported` — torch's exported graph file, read and cleaned up before the exporter writes it.

Usage::

    with interop.as_proto(model, weight_limit=1 << 20) as seam:
        seam.give_back(onnxsim.simplify(seam.proto)[0])
    simplified = seam.model  # onnx_ir.Model, or None if nothing was given back
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx.external_data_helper import uses_external_data

from vlmc import graphs, paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Tensors at least this large go to external data so that the .onnx protobuf stays small.
EXTERNAL_DATA_THRESHOLD = 1024
DEFAULT_WEIGHT_LIMIT = 1 << 20  # 1 MiB: shape arithmetic and small constants stay foldable
# int64 initializers up to this size stay inline in :func:`check`: shape inference's data
# propagation reads int64 constants (shape arithmetic, e.g. paged_kv's block offsets, 1 KiB at
# block_size 128) and fails on external ones. Weights (float, int8/int4, int32 biases) never are.
CHECK_INLINE_INT64_BYTES = 1 << 16

# ---- stored tensors: external data, content hashes, a data file for new tensors -----------------


def release(tensors) -> None:
    """Close the memory maps of tensors read from files (their pages count as resident while mapped).

    A released tensor maps its file again when it is next read, so this is always safe.
    """
    for t in tensors:
        if isinstance(t, ir.ExternalTensor):
            t.release()


# ---- content hashes of weights (fingerprint hashes the structure around them) ---------------

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


# ---- the stub swap -------------------------------------------------------------------------------


@contextlib.contextmanager
def weightless(
    model: ir.Model, stubs: Mapping[ir.Value, ir.TensorProtocol] | None = None
) -> Iterator[onnx.ModelProto]:
    """The graph's ModelProto built with the initializers in ``stubs`` holding their stub tensors.

    Each initializer (of any graph, subgraphs too) that ``stubs`` maps is serialized from its stub
    (an ExternalTensor pointing somewhere, a sparse placeholder, a small inline tensor) instead of
    its own tensor; the model gets back the very same tensor objects before the proto is handed
    out, even when serializing fails, so nothing is read or copied that the stubs do not hold.
    Initializers are left out of the proto's value_info (onnx-ir lists them there; onnx's own
    protos do not, and tools such as onnxruntime's float16 converter take a value_info entry for
    an activation).
    """
    swaps: list[tuple[ir.Value, ir.TensorProtocol | None]] = []
    try:
        for v, stub in (stubs or {}).items():
            swaps.append((v, v.const_value))
            v.const_value = stub
        proto = ir.to_proto(model)
    finally:
        for v, t in reversed(swaps):
            v.const_value = t
    del swaps
    _drop_initializer_infos(proto, model)
    yield proto


def serialized(
    model: ir.Model, stubs: Mapping[ir.Value, ir.TensorProtocol] | None = None, for_hash: bool = False
) -> bytes:
    """:func:`weightless`'s proto as bytes; ``for_hash``: deterministic, without the producer fields."""
    with weightless(model, stubs) as proto:
        if for_hash:
            proto.ClearField("producer_name")
            proto.ClearField("producer_version")
        return proto.SerializeToString(deterministic=for_hash)


def _initializers(model: ir.Model) -> list[ir.Value]:
    return [v for g in model.graphs() for v in g.initializers.values() if v.const_value is not None]


def _drop_initializer_infos(proto: onnx.ModelProto, model: ir.Model) -> None:
    infos = [v for v in proto.graph.value_info if v.name not in model.graph.initializers]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(infos)


# ---- writing graph files -------------------------------------------------------------------------


def write(
    model: ir.Model, path: str | Path, stubs: Mapping[ir.Value, ir.TensorProtocol] | None = None
) -> None:
    """Write the graph file ``path`` from :func:`weightless`'s proto (``stubs`` say where the weights are)."""
    with open(path, "wb") as f:
        f.write(serialized(model, stubs))


def point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make a TensorProto external data stored at ``location`` (``offset``, ``length`` bytes)."""
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def save(model: ir.Model, path: str | Path) -> None:
    """Save a graph with its large tensors in one external data file named ``<file>.data``.

    onnx-ir streams each weight from where it lives (its source file, memory-mapped, or memory) to
    the data file one tensor at a time; the model is left unchanged. Offsets are 64-byte aligned so
    runtimes can map tensors in place.
    """
    path = Path(path)
    data = path.name + ".data"
    values = _initializers(model)
    big = [v for v in values if v.const_value.nbytes >= EXTERNAL_DATA_THRESHOLD]
    inline = [
        v
        for v in values
        if v.const_value.nbytes < EXTERNAL_DATA_THRESHOLD and isinstance(v.const_value, ir.ExternalTensor)
    ]
    # Small tensors stored in a file are read in first: the data file written next may be theirs.
    new = dict(zip(inline, ir.external_data.convert_tensors_from_external([v.const_value for v in inline])))
    new.update(
        zip(
            big,
            ir.external_data.convert_tensors_to_external(
                [v.const_value for v in big], path.parent, data, alignment=64, align_threshold=0
            ),
        )
    )
    try:
        write(model, path, new)
    finally:
        release([v.const_value for v in values])
    data_path = path.parent / data
    if data_path.exists() and data_path.stat().st_size == 0:
        data_path.unlink()


def fingerprint(model: ir.Model) -> str:
    """A content hash of a graph, used by the pass manager to see what a pass changed.

    Structure (nodes, attributes, IO, opsets, names, dtypes and shapes) and every weight's bytes are
    hashed exactly; a weight's hash is computed once (:func:`vlmc.tensor_hash`), so fingerprinting
    again after a pass that did not touch the weights reads nothing. The structure is hashed from a
    serialization with every initializer replaced by a stub that names its content hash
    (:func:`serialized`), so no weight bytes are serialized.
    """
    stubs = {
        v: ir.ExternalTensor(key, 0, (t := v.const_value).nbytes, t.dtype, shape=t.shape, name=t.name)
        for v, key in weight_hashes(model).items()
    }
    return hashlib.sha256(serialized(model, stubs, for_hash=True)).hexdigest()


def save_shared(models: dict[Path, ir.Model], data_path: Path) -> None:
    """Save graphs whose large tensors go to one data file, each distinct content stored once.

    Used for graphs that share weights (the merged ``vlm`` graph and the text-only decode path
    beside it). onnx-ir's writer handles one model per file, so the shared file is written here
    (keyed by :func:`tensor_hash`) and each model is then written (:func:`write`) with
    its tensors pointing into it.
    """
    data_path = Path(data_path)
    written: dict[str, tuple[int, int]] = {}
    with open(data_path, "wb") as data:
        for path, m in models.items():
            stubs = {}
            for v, key in weight_hashes(m).items():
                t = v.const_value
                if t.nbytes < EXTERNAL_DATA_THRESHOLD:
                    continue
                if key not in written:
                    data.write(b"\0" * (-data.tell() % 64))
                    offset = data.tell()
                    raw = t.tobytes()
                    data.write(raw)
                    written[key] = (offset, len(raw))
                    del raw
                off, length = written[key]
                stubs[v] = ir.ExternalTensor(
                    data_path.name,
                    off,
                    length,
                    t.dtype,
                    shape=t.shape,
                    name=t.name,
                    base_dir=data_path.parent,
                )
            data.flush()
            write(m, path, stubs)
    if not written:
        data_path.unlink(missing_ok=True)


# ---- opening and checking graph files ------------------------------------------------------------


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
    from onnx.external_data_helper import _get_all_tensors

    sizes: dict[Path, int] = {}
    for tensor in _get_all_tensors(model):
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


def check(model: ir.Model, name: str = "graph") -> None:
    """Run onnx.checker (full) and strict shape inference on a graph; raise a one-line VlmcError.

    The graph is written without its weights: every large initializer points into a sparse file of
    the right size (the checker and shape inference need only dtypes and shapes), so this works for
    models over the protobuf limit and reads no weight bytes. int64 tensors of at most
    :data:`CHECK_INLINE_INT64_BYTES` (shape data, not weights) are kept inline.
    """
    with tempfile.TemporaryDirectory() as tmp:
        size = 0
        stubs: dict[ir.Value, ir.TensorProtocol] = {}
        for v in _initializers(model):
            t = v.const_value
            if t.nbytes < EXTERNAL_DATA_THRESHOLD:
                continue
            if t.dtype == ir.DataType.INT64 and t.nbytes <= CHECK_INLINE_INT64_BYTES:
                # Shape arithmetic: data propagation needs the values (they are small, and read).
                stubs[v] = ir.tensor(np.array(t.numpy()), name=t.name)
                continue
            stubs[v] = ir.ExternalTensor(
                "weights", size, t.nbytes, t.dtype, shape=t.shape, name=t.name, base_dir=tmp
            )
            size += t.nbytes
        path = os.path.join(tmp, "graph.onnx")
        with open(path, "wb") as f:
            f.write(serialized(model, stubs, for_hash=True))  # deterministic
        del stubs
        with open(os.path.join(tmp, "weights"), "wb") as f:
            f.truncate(size)
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


def protobuf_bytes(model: ir.Model) -> int:
    """Size of the .onnx protobuf once large tensors are moved to external data (as :func:`save` does).

    The graph is serialized with every large initializer as a stub that only names its place, so
    no weight is read; what is left is what the file will hold (nodes, small tensors, IO).
    """

    stubs = {
        v: ir.ExternalTensor(f"{v.name}.data", 0, t.nbytes, t.dtype, shape=t.shape, name=t.name)
        for v in _initializers(model)
        if (t := v.const_value).nbytes >= EXTERNAL_DATA_THRESHOLD
    }
    with weightless(model, stubs) as proto:
        return proto.ByteSize()


# ---- foreign tools -------------------------------------------------------------------------------


class ProtoSeam:
    """What :func:`as_proto` yields: ``proto`` for the tool, ``held`` weights, ``model`` after exit."""

    def __init__(self, proto: onnx.ModelProto, held: dict[str, ir.Value], like: ir.Model) -> None:
        self.proto = proto
        self.held = held  # initializer name -> the IR value the proto sees as a graph input
        self._like = like
        self._result: onnx.ModelProto | None = None
        self.model: ir.Model | None = None

    def give_back(self, result: onnx.ModelProto) -> None:
        """Hand the tool's result back; on exit it becomes :attr:`model` with the held weights restored."""
        self._result = result

    def _finish(self) -> None:
        if self._result is not None:
            self.model = _with_held(self._result, self.held, self._like)
        self.proto = None  # type: ignore[assignment]  (let the tool's copy go)
        self._result = None


@contextlib.contextmanager
def as_proto(model: ir.Model, weight_limit: int | None = DEFAULT_WEIGHT_LIMIT) -> Iterator[ProtoSeam]:
    """A ModelProto of ``model`` with weights of ``weight_limit`` bytes or more held back as inputs.

    Args:
        model: the IR graph; it is not changed.
        weight_limit: bytes from which an initializer is held back (never read). ``None`` reads
            every weight into the proto.

    Yields:
        a :class:`ProtoSeam`; call ``give_back(result)`` to get ``seam.model`` after the block.
    """
    limit = float("inf") if weight_limit is None else weight_limit
    g = model.graph
    order = list(g.initializers.items())
    held = {n: v for n, v in order if v.const_value is not None and v.const_value.nbytes >= limit}
    n_inputs = len(g.inputs)
    try:
        for n in held:
            g.initializers.pop(n)
            g.inputs.append(held[n])
        proto = _full_proto(model)  # the small weights' bytes are read in: tools may need them
    finally:
        while len(g.inputs) > n_inputs:
            g.inputs.pop()
        g.initializers.clear()
        for _, v in order:
            g.register_initializer(v)
    seam = ProtoSeam(proto, held, model)
    del proto
    try:
        yield seam
    finally:
        seam._finish()


def _with_held(proto: onnx.ModelProto, held: dict[str, ir.Value], like: ir.Model) -> ir.Model:
    # The held weights go back as initializers (the same tensors: nothing is read), in ``like``'s order.
    model = ir.from_proto(proto)
    g = model.graph
    for v in [v for v in g.inputs if v.name in held]:
        g.inputs.remove(v)
        v.const_value = held[v.name].const_value
        g.register_initializer(v)
    order_initializers_like(g, like)
    return model


def order_initializers_like(graph: ir.Graph, like: ir.Model) -> None:
    """Register ``graph``'s initializers again in ``like``'s order, new ones last: a foreign tool's
    result keeps the package's weight order, so its data file is laid out as before."""
    rank = {n: i for i, n in enumerate(like.graph.initializers)}
    order = sorted(graph.initializers.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    graph.initializers.clear()
    for _, v in order:
        graph.register_initializer(v)


def _full_proto(model: ir.Model) -> onnx.ModelProto:
    """A ModelProto with every initializer's bytes inside (read one tensor at a time)."""
    with weightless(model) as proto:
        pass
    tensors = {name: v.const_value for name, v in model.graph.initializers.items()}
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        src = tensors.get(t.name)
        if src is None:
            raise VlmcError(f"weight {t.name!r} has no data")
        t.raw_data = src.tobytes()
        t.ClearField("data_location")  # ClearField: proto2 keeps an explicitly set default
        del t.external_data[:]
    return proto


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    """A tool's ModelProto as an IR model (tensor bytes are referenced, not copied)."""
    return ir.from_proto(proto)


def is_proto(model: object) -> bool:
    """True for a ModelProto (a tool's or a test's graph), False for an IR model."""
    return isinstance(model, onnx.ModelProto)


def outputs_suffix(extra_outputs) -> bytes:
    """Bytes that, appended to a serialized graph, add ``extra_outputs`` to its outputs.

    Protobuf merges a message field that occurs twice, appending repeated fields: the bytes of a
    model holding only the extra outputs, written after the graph's, add them to the graph's
    outputs, so a session sees them without the graph being touched or its weights copied again.
    Each output is a name (float32) or a ValueInfoProto.
    """
    if not extra_outputs:
        return b""
    extra = onnx.ModelProto()
    extra.graph.output.extend(
        onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) if isinstance(o, str) else o
        for o in extra_outputs
    )
    return extra.SerializeToString()


def session_input(
    model: ir.Model | onnx.ModelProto, extra_outputs=(), in_memory_below: int = 0
) -> tuple[bytes | None, bytes]:
    """What an onnxruntime session on ``model`` is made from, asked in one call.

    Returns ``(graph, suffix)``: ``graph`` is the serialized graph with its weights when it is a
    ModelProto (bounded by protobuf itself) or an IR graph whose weights are under
    ``in_memory_below`` bytes, else None (the caller links the weight files instead); ``suffix`` is
    :func:`outputs_suffix` of ``extra_outputs``.
    """
    suffix = outputs_suffix(extra_outputs)
    if isinstance(model, onnx.ModelProto) or graphs.initializer_bytes(model) < in_memory_below:
        return session_bytes(model), suffix
    return None, suffix


def session_bytes(model: ir.Model | onnx.ModelProto) -> bytes:
    """The serialized graph with its weights, for an in-memory onnxruntime session (< 2 GiB graphs)."""
    proto = model if isinstance(model, onnx.ModelProto) else _full_proto(model)
    return proto.SerializeToString()


@contextlib.contextmanager
def as_file(model: ir.Model, directory: str | Path | None = None, name: str = "graph.onnx") -> Iterator[Path]:
    """The graph saved to ``<dir>/<name>`` with its weights streamed there, for tools that take a path.

    Without ``directory`` a temporary one is made and removed on exit (results a tool writes there
    must be read, or loaded with :func:`load_result` into a directory that outlives the block).
    """
    if directory is not None:
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        save(model, path)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="vlmc-seam-") as tmp:
        path = Path(tmp) / name
        save(model, path)
        yield path


def load_result(path: str | Path, in_memory: bool = False) -> ir.Model:
    """A graph file a tool wrote, as IR; its weights stay in the file (memory-mapped when read).

    ``in_memory`` reads every weight in, for results written to a directory about to be removed.
    """
    model = graphs.load_ir(path)
    # Tools write Constant node tensors as external data too; they are small, and an in-memory
    # session or proto of the graph needs them inline.
    for node in model.graph.all_nodes():
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                t = attr.value
                node.attributes[attr.name] = ir.AttrTensor(
                    attr.name, ir.tensor(np.array(t.numpy()), name=t.name)
                )
                t.release()
    if in_memory:
        for g in model.graphs():
            for v in g.initializers.values():
                t = v.const_value
                if isinstance(t, ir.ExternalTensor):
                    v.const_value = ir.tensor(np.array(t.numpy()), name=t.name)
                    t.release()
    return model


# ---- torch's exported graph ----------------------------------------------------------------------


def exported(path: str | Path) -> onnx.ModelProto:
    """The graph torch.onnx wrote to ``path`` (its small constants only), cleaned up for the exporter.

    Every node gets a unique name (:func:`vlmc.graphs.name_nodes`, read off the graph as IR), and
    small weights the tracer shared through Identity nodes get their own initializer. The exporter
    then grows the layer stacks it cut and writes the weights into the proto before saving it.
    """
    model = onnx.load(str(path))
    for node, name in zip(model.graph.node, graphs.node_names(ir.from_proto(model))):
        node.name = name
    _inline_shared_small_constants(model)
    return model


def save_exported(model: onnx.ModelProto, path: str | Path) -> None:
    """Write the exporter's graph proto (its weights already pointing at the data file) to ``path``."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def _inline_shared_small_constants(model: onnx.ModelProto, limit: int = 1 << 16) -> None:
    """Give small weights that the tracer shared through Identity nodes their own initializer.

    torch's exporter stores equal parameters once and feeds the copies through Identity (random
    tiny models have many identical zero biases). Quantizers and the Ascend lowering need a Gemm or
    MatMul bias to be an initializer, so small ones are materialized; large shared tensors keep the
    Identity so no weight bytes are duplicated.
    """
    inits = {t.name: t for t in model.graph.initializer}
    keep = []
    for node in model.graph.node:
        src = inits.get(node.input[0]) if node.op_type == "Identity" and node.input else None
        if src is not None and len(src.raw_data) <= limit:
            copy = onnx.TensorProto()
            copy.CopyFrom(src)
            copy.name = node.output[0]
            model.graph.initializer.append(copy)
        else:
            keep.append(node)
    if len(keep) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(keep)
