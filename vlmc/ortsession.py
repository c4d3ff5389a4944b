"""onnxruntime sessions for package graphs, on disk or in memory."""

from __future__ import annotations

import logging
import os
import tempfile

import onnx
import onnx_ir as ir
import onnxruntime as ort

from vlmc import graphs, interop

logger = logging.getLogger(__name__)

# onnxruntime's graph-optimizer warnings are noise for users; errors still surface as exceptions.
ort.set_default_logger_severity(3)
# Models at least this large are handed to onnxruntime as a file (protobuf messages stop at 2 GiB).
MAX_IN_MEMORY_BYTES = 1_800_000_000


def options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return so


def from_path(path: str | os.PathLike, threads: int | None = None) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), options(threads), providers=["CPUExecutionProvider"])


def from_model(
    model: onnx.ModelProto | ir.Model,
    threads: int | None = None,
    extra_outputs: list[str | onnx.ValueInfoProto] = (),
) -> ort.InferenceSession:
    """A CPU session for an in-memory model; models over the protobuf limit go through a temp file.

    Args:
        model: the graph (a ModelProto or an onnx-ir model); it is not changed.
        threads: intra-op threads (default: onnxruntime's).
        extra_outputs: internal tensors the session also returns (e.g. activations for calibration),
            by name (float32) or as value infos.
    """
    # Protobuf merges a message field that occurs twice, appending repeated fields: the bytes of a model
    # holding only the extra outputs, written after the graph's, add them to the graph's outputs. So
    # the session sees them without the model being touched or its weights copied once more.
    suffix = b""
    if extra_outputs:
        extra = onnx.ModelProto()
        extra.graph.output.extend(
            onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) if isinstance(o, str) else o
            for o in extra_outputs
        )
        suffix = extra.SerializeToString()
    if graphs.initializer_bytes(model) < MAX_IN_MEMORY_BYTES:
        return ort.InferenceSession(
            interop.session_bytes(model) + suffix, options(threads), providers=["CPUExecutionProvider"]
        )
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "m.onnx")
        graphs.save(model, p)
        with open(p, "ab") as f:
            f.write(suffix)
        return from_path(p, threads)


def for_graph(pkg, name: str, threads: int | None = None) -> ort.InferenceSession:
    """Session for a package graph: straight from disk when unmodified, else from memory."""
    path = pkg.path_of(name)
    if path is not None:
        return from_path(path, threads)
    return from_model(pkg.current(name), threads)
