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
# An IR graph this large goes through a file too: serializing it in memory would hold its weights
# three times at once (the proto, its bytes, and onnxruntime's copy); streamed to a file, only
# onnxruntime's copy is resident (a 1.33 GB decoder: 4 GB less at the peak).
STREAM_FROM_FILE_BYTES = 64 << 20


def options(threads: int | None = None, precision: str | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if precision in _KEEP_DEQUANT:
        # The per-call dequantized weights are the largest buffers; without the arena they go back to
        # the system after each call instead of staying reserved for the session's life.
        so.enable_cpu_mem_arena = False
        # Every dequantization chain is ready at the start of a call; priority order runs each nearer
        # its MatMul instead of all first, so fewer float weights are alive at once (measured: the
        # 512 M real-width INT4 decoder's prefill peak 2.23 -> 1.91 GB).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if threads:
        so.intra_op_num_threads = threads
    return so


# Weight-only graphs dequantize their integer weights with plain ops; onnxruntime's constant folding
# would materialize every weight in float32 (and its integer intermediates) inside the session, which
# is the FP32 model's size again. Without it the dequantization runs per call, with the same numerics.
_KEEP_DEQUANT = ("int8_weight_only", "int4_weight_only", "mixed")


def _disabled(precision: str | None) -> list[str]:
    return ["ConstantFolding"] if precision in _KEEP_DEQUANT else []


def from_path(
    path: str | os.PathLike, threads: int | None = None, precision: str | None = None
) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(path),
        options(threads, precision),
        providers=["CPUExecutionProvider"],
        disabled_optimizers=_disabled(precision),
    )


def from_model(
    model: onnx.ModelProto | ir.Model,
    threads: int | None = None,
    extra_outputs: list[str | onnx.ValueInfoProto] = (),
    precision: str | None = None,
) -> ort.InferenceSession:
    """A CPU session for an in-memory model; models over the protobuf limit go through a temp file.

    Args:
        model: the graph (a ModelProto or an onnx-ir model); it is not changed.
        threads: intra-op threads (default: onnxruntime's).
        extra_outputs: internal tensors the session also returns (e.g. activations for calibration),
            by name (float32) or as value infos.
        precision: the graph's manifest precision; weight-only graphs keep their dequantization
            unfolded (see ``_KEEP_DEQUANT``).
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
    limit = MAX_IN_MEMORY_BYTES if isinstance(model, onnx.ModelProto) else STREAM_FROM_FILE_BYTES
    if graphs.initializer_bytes(model) < limit:
        return ort.InferenceSession(
            interop.session_bytes(model) + suffix,
            options(threads, precision),
            providers=["CPUExecutionProvider"],
            disabled_optimizers=_disabled(precision),
        )
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "m.onnx")
        graphs.save(model, p)
        with open(p, "ab") as f:
            f.write(suffix)
        return from_path(p, threads, precision)


def for_graph(pkg, name: str, threads: int | None = None) -> ort.InferenceSession:
    """Session for a package graph: straight from disk when unmodified, else from memory."""
    path = pkg.path_of(name)
    precision = pkg.info(name).get("precision")
    if path is not None:
        return from_path(path, threads, precision)
    return from_model(pkg.model(name), threads, precision=precision)
