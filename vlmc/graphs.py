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
        raise VlmcError(f"{path} is not a readable ONNX file ({type(exc).__name__}); re-export the package") from exc
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
            raise VlmcError(f"tensor {tensor.name!r} points at external data {info.get('location')!r} outside "
                            f"{base}; re-export the package")
        if location not in sizes:
            if not location.is_file():
                raise VlmcError(f"external data {location} for tensor {tensor.name!r} is missing; "
                                "copy the whole package directory or re-export it")
            sizes[location] = location.stat().st_size
        try:
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
        except ValueError:
            raise VlmcError(f"tensor {tensor.name!r} has a malformed external data entry; re-export the package") from None
        if end > sizes[location]:
            raise VlmcError(f"external data {location} is truncated (tensor {tensor.name!r} needs bytes up to {end}, "
                            f"the file has {sizes[location]}); copy the whole package again or re-export it")


def _load_external(model: onnx.ModelProto, base: Path) -> None:
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for tensor in _all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = base / info.get("location", "")
        if not location.is_file():
            raise VlmcError(f"external data {location} for tensor {tensor.name!r} is missing")
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        if length >= 0 and offset + length > location.stat().st_size:
            raise VlmcError(f"external data {location} is truncated (tensor {tensor.name!r} needs bytes up to {offset + length})")
        load_external_data_for_tensor(tensor, str(base))
        # ClearField, not "= DEFAULT": proto2 keeps an explicitly set field, which changes the bytes
        tensor.ClearField("data_location")
        del tensor.external_data[:]


def save(model: onnx.ModelProto, path: str | Path) -> None:
    """Save a graph with its large tensors in one external data file named ``<file>.data``.

    onnx.save_model's external-data writer strips the weights from the in-memory model, and copying
    the model first doubles peak memory. Here each large tensor's bytes are moved out, the small
    protobuf is written, and the bytes are put back, so the model stays usable and memory stays flat.
    """
    path = Path(path)
    data_name = path.name + ".data"
    data_path = path.parent / data_name
    moved: list[tuple[onnx.TensorProto, bytes]] = []
    offset = 0
    try:
        with open(data_path, "wb") as data:
            for tensor in _all_tensors(model):
                if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.raw_data) < EXTERNAL_DATA_THRESHOLD:
                    continue
                raw = tensor.raw_data
                pad = (-offset) % 64  # aligned offsets let runtimes mmap tensors
                data.write(b"\0" * pad)
                offset += pad
                data.write(raw)
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                offset += len(raw)
                moved.append((tensor, raw))
        with open(path, "wb") as f:
            f.write(model.SerializeToString(deterministic=True))
    finally:
        for tensor, raw in moved:
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            tensor.raw_data = raw
    if not moved:
        data_path.unlink(missing_ok=True)


def _all_tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)


def fingerprint(model: onnx.ModelProto) -> str:
    """A content hash of a graph, weights included, without serializing it as one message.

    Serializing a model over 2 GB fails, so weights are hashed tensor by tensor.
    """
    h = hashlib.sha256()
    for t in model.graph.initializer:
        raw = t.raw_data
        h.update((_header(t) if raw else t).SerializeToString(deterministic=True))
        h.update(raw)
    for part in (model.graph.node, model.graph.input, model.graph.output, model.opset_import):
        for item in part:
            h.update(item.SerializeToString(deterministic=True))
    for si in model.graph.sparse_initializer:
        h.update(si.SerializeToString(deterministic=True))
    return h.hexdigest()


def _header(t: onnx.TensorProto) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.name = t.name
    out.data_type = t.data_type
    out.dims.extend(t.dims)
    return out


def check(model: onnx.ModelProto, name: str = "graph") -> onnx.ModelProto:
    """Run onnx.checker (full) and strict shape inference; return the model with inferred shapes.

    Models above the protobuf limit are checked through a temporary file, which the checker needs.
    """
    try:
        if model.ByteSize() < 1_800_000_000:
            onnx.checker.check_model(model, full_check=True)
            return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False, data_prop=True)
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "m.onnx")
            save(model, p)
            onnx.checker.check_model(p, full_check=True)
        return model
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


def _tensor_nbytes(t: onnx.TensorProto) -> int:
    if t.raw_data:
        return len(t.raw_data)
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    try:
        return n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:
        return 0


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
