"""ONNX graph helpers shared by the package, passes and backends: IO, signatures, fingerprints, checks."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# ATC parses ai.onnx opsets 9..18 (shared/ascend/atc-reference.md); exporters write 17.
EXPORT_OPSET = 17
# Tensors at least this large go to external data so that the .onnx protobuf stays small.
EXTERNAL_DATA_THRESHOLD = 1024


def dtype_name(elem_type: int) -> str:
    """ONNX TensorProto element type -> numpy-style name ('float32', 'int64', ...)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def elem_type(dtype_name_: str) -> int:
    """numpy-style dtype name -> ONNX TensorProto element type."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype_name_))


def _value_info_entry(vi: onnx.ValueInfoProto) -> dict:
    t = vi.type.tensor_type
    shape: list[int | str] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            shape.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            shape.append(d.dim_param)
        else:
            shape.append("?")
    return {"name": vi.name, "dtype": dtype_name(t.elem_type), "shape": shape}


def signature(model: onnx.ModelProto) -> dict:
    """The graph's inputs and outputs: names, dtypes and (symbolic) shapes, as stored in the manifest."""
    init_names = {i.name for i in model.graph.initializer}
    return {
        "inputs": [_value_info_entry(v) for v in model.graph.input if v.name not in init_names],
        "outputs": [_value_info_entry(v) for v in model.graph.output],
    }


def load(path: str | Path, load_weights: bool = True) -> onnx.ModelProto:
    """Load an ONNX file (with its external data) or raise a one-line VlmcError."""
    path = Path(path)
    if not path.is_file():
        raise VlmcError(f"graph file {path} is missing")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several types for truncated files
        raise VlmcError(
            f"{path} is not a readable ONNX file ({type(exc).__name__}); re-export the package"
        ) from exc
    if load_weights:
        _load_external(model, path.parent)
    return model


def check_external_data(model: onnx.ModelProto, base: Path) -> None:
    """Raise a one-line VlmcError if an external data file is missing or too short (nothing is read)."""
    from onnx.external_data_helper import uses_external_data

    sizes: dict[Path, int] = {}
    for tensor in _all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = (base / info.get("location", "")).resolve()
        if base.resolve() not in location.parents:
            raise VlmcError(
                f"tensor {tensor.name!r} points at external data {info.get('location')!r} outside "
                f"{base}; re-export the package"
            )
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


def _load_external(model: onnx.ModelProto, base: Path) -> None:
    from onnx.external_data_helper import uses_external_data

    for tensor in _all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = base / info.get("location", "")
        if not location.is_file():
            raise VlmcError(f"external data {location} for tensor {tensor.name!r} is missing")
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        if length >= 0 and offset + length > location.stat().st_size:
            raise VlmcError(
                f"external data {location} is truncated (tensor {tensor.name!r} needs bytes up to {offset + length})"
            )
        if base.resolve() not in location.resolve().parents:
            raise VlmcError(
                f"tensor {tensor.name!r} points at external data outside {base}; re-export the package"
            )
        # Read the bytes directly: the bounds and location were checked above, and one read per tensor
        # avoids onnx's loader reopening the file for every tensor.
        with open(location, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length) if length >= 0 else f.read()
        # ClearField, not "= DEFAULT": proto2 keeps an explicitly set field, which changes the bytes
        tensor.ClearField("data_location")
        del tensor.external_data[:]


def _copy_fields(src, dst, skip: str = "") -> None:
    """Copy every set field of a message except ``skip`` (CopyFrom cannot leave one field out)."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def weightless_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[tuple[onnx.TensorProto, object]]]:
    """A copy of a graph without the bytes of its large tensors; the model itself is not touched.

    Returns the copy and ``(tensor in the copy, source)`` pairs for every tensor whose bytes were
    left out (marked external, with no location yet): ``source`` is the original initializer (read
    its ``raw_data`` when the bytes are needed) or, for tensors inside node attributes, the bytes.
    Initializer bytes are never copied, so checking or saving a multi-GB graph costs no extra
    copy of its weights, and (unlike taking the bytes out and putting them back) nothing is added
    to the model's protobuf arena.
    """
    copy = onnx.ModelProto()
    _copy_fields(model, copy, skip="graph")
    _copy_fields(model.graph, copy.graph, skip="initializer")
    moved: list[tuple[onnx.TensorProto, object]] = []
    for tensor in model.graph.initializer:
        large = (
            tensor.data_location != onnx.TensorProto.EXTERNAL
            and tensor.HasField("raw_data")
            and _tensor_nbytes(tensor) >= EXTERNAL_DATA_THRESHOLD
        )
        if not large:
            copy.graph.initializer.add().CopyFrom(tensor)
            continue
        out = copy.graph.initializer.add()
        _copy_fields(tensor, out, skip="raw_data")
        out.data_location = onnx.TensorProto.EXTERNAL
        moved.append((out, tensor))
    # Tensors in node attributes and subgraphs were copied with the nodes (they are rarely large);
    # their bytes move out of the copy, which is private, so nothing needs to go back.
    for tensor in _all_tensors(copy):
        if (
            tensor.data_location == onnx.TensorProto.EXTERNAL
            or len(tensor.raw_data) < EXTERNAL_DATA_THRESHOLD
        ):
            continue
        raw = tensor.raw_data
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        moved.append((tensor, raw))
    return copy, moved


def _source_bytes(source: object) -> bytes:
    return source.raw_data if isinstance(source, onnx.TensorProto) else source


def _source_nbytes(source: object) -> int:
    return _tensor_nbytes(source) if isinstance(source, onnx.TensorProto) else len(source)


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def save(model: onnx.ModelProto, path: str | Path) -> None:
    """Save a graph with its large tensors in one external data file named ``<file>.data``.

    onnx.save_model's external-data writer strips the weights from the in-memory model, and copying
    the model first doubles peak memory; writing a weightless copy (see :func:`weightless_copy`)
    does neither.
    """
    save_shared({Path(path): model}, Path(str(path) + ".data"), dedupe=False)


def save_shared(models: dict[Path, onnx.ModelProto], data_path: Path, dedupe: bool = True) -> None:
    """Save graphs with their large tensors in one data file; with ``dedupe`` each distinct content once.

    Used for graphs that share weights (the merged ``vlm`` graph and the text-only decode path beside
    it): a tensor whose dtype, dims and bytes were already written points at the first copy.
    """
    data_path = Path(data_path)
    written: dict[str, tuple[int, int]] = {}
    offset = 0
    copies = {path: weightless_copy(model) for path, model in models.items()}
    any_moved = False
    with open(data_path, "wb") as data:
        for _, moved in copies.values():
            for tensor, source in moved:
                any_moved = True
                raw = _source_bytes(source)  # one tensor's bytes at a time
                key = (
                    hashlib.sha256(f"{tensor.data_type}:{list(tensor.dims)}:".encode() + raw).hexdigest()
                    if dedupe
                    else str(len(written))
                )
                if key not in written:
                    pad = (-offset) % 64  # aligned offsets let runtimes mmap tensors
                    data.write(b"\0" * pad)
                    offset += pad
                    data.write(raw)
                    written[key] = (offset, len(raw))
                    offset += len(raw)
                _point_at(tensor, data_path.name, *written[key])
                del raw
    for path, (copy, _) in copies.items():
        with open(path, "wb") as f:
            f.write(copy.SerializeToString(deterministic=True))
    if not any_moved:
        data_path.unlink(missing_ok=True)


def weight_regions(model: onnx.ModelProto, base: Path | None = None) -> dict[str, int]:
    """Stored weight copies of a graph: identity -> bytes (initializers and Constant tensors).

    External tensors are identified by where they are stored (file, offset, length), so graphs that
    share a data file count a shared weight once; in-memory tensors by content.
    """
    out: dict[str, int] = {}
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            tensors.extend(a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL and base is not None:
            info = {e.key: e.value for e in t.external_data}
            key = f"{(Path(base) / info.get('location', '')).resolve()}@{info.get('offset', 0)}+{info.get('length')}"
        else:
            raw = (
                t.raw_data
                if t.raw_data or t.data_location == onnx.TensorProto.EXTERNAL
                else to_array(t).tobytes()
            )
            key = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode() + raw).hexdigest()
        out[key] = _tensor_nbytes(t)
    return out


def _all_tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


# Tensors up to this size are hashed whole; larger ones by evenly spaced windows (see fingerprint).
_FULL_HASH_BYTES = 1 << 20
_WINDOWS, _WINDOW_BYTES = 64, 4096


def fingerprint(model: onnx.ModelProto) -> str:
    """A content hash of a graph, used by the pass manager to see what a pass changed.

    Structure (nodes, IO, opsets, tensor names, dtypes and shapes) is hashed exactly. Tensor bytes
    are hashed whole up to 1 MiB; larger tensors by 64 evenly spaced 4 KiB windows plus their
    length. Hashing every byte of a multi-GB model after every pass cost more than the passes; the
    windows catch any rewrite of a weight (requantization, rescaling, a different tensor), and the
    structure catches every graph edit. A pass that changed one value deep inside a large weight in
    place, and nothing else, would go unseen; vlmc's passes replace tensors instead.
    """
    h = hashlib.sha256()
    for t in model.graph.initializer:
        raw = t.raw_data  # one read; detaching and restoring would copy the bytes twice
        if not raw:
            h.update(t.SerializeToString(deterministic=True))
            continue
        h.update(f"{t.name}|{t.data_type}|{list(t.dims)}|{len(raw)}|".encode())
        if len(raw) <= _FULL_HASH_BYTES:
            h.update(raw)
        else:
            view = memoryview(raw)
            step = (len(raw) - _WINDOW_BYTES) // (_WINDOWS - 1)
            for i in range(_WINDOWS):
                h.update(view[i * step : i * step + _WINDOW_BYTES])
    for part in (
        model.graph.node,
        model.graph.input,
        model.graph.output,
        model.opset_import,
        model.graph.sparse_initializer,
    ):
        for item in part:
            h.update(item.SerializeToString(deterministic=True))
    return h.hexdigest()


def check(model: onnx.ModelProto, name: str = "graph") -> None:
    """Run onnx.checker (full) and strict shape inference on a graph; raise a one-line VlmcError.

    A weightless copy is checked (the checker and shape inference need only dtypes and shapes), so
    this works for models over the protobuf limit and never copies the weights.
    """
    copy, moved = weightless_copy(model)
    with tempfile.TemporaryDirectory() as tmp:
        # The checker insists that external data is a regular file inside the model's directory:
        # a sparse file of the right size stands in for the weights (no bytes are written).
        size = 0
        for tensor, source in moved:
            n = _source_nbytes(source)
            _point_at(tensor, "weights", size, n)
            size += n
        with open(os.path.join(tmp, "weights"), "wb") as f:
            f.truncate(size)
        path = os.path.join(tmp, "graph.onnx")
        with open(path, "wb") as f:
            f.write(copy.SerializeToString(deterministic=True))
        del copy
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


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of weight data in a graph (initializers plus Constant tensors)."""
    total = sum(_tensor_nbytes(t) for t in model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    total += _tensor_nbytes(a.t)
    return total


# 4-bit types store two values per byte in raw_data.
_PACKED_4BIT = {
    getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(onnx.TensorProto, n)
}


def _tensor_nbytes(t: onnx.TensorProto) -> int:
    # From dims and dtype, not len(t.raw_data): reading raw_data copies the bytes (upb returns a new
    # bytes object), which costs a full copy of the weights per call on a large graph.
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    if t.data_type in _PACKED_4BIT:
        return (n + 1) // 2
    try:
        return n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:
        return len(t.raw_data) if t.HasField("raw_data") else 0


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Count of nodes per (domain-qualified) op type."""
    hist: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))


def opset(model: onnx.ModelProto, domain: str = "") -> int | None:
    """The model's opset version for a domain ('' is ai.onnx)."""
    for o in model.opset_import:
        if o.domain in (domain, "ai.onnx" if domain == "" else domain):
            return int(o.version)
    return None


def to_array(t: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(t)
