"""onnxruntime sessions for package graphs, on disk or in memory."""

from __future__ import annotations

import logging
import mmap
import os
import tempfile

import numpy as np
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
    if isinstance(model, onnx.ModelProto):  # a tool's or a test's proto: bounded by protobuf itself
        small = model.ByteSize() < MAX_IN_MEMORY_BYTES
    else:
        small = graphs.initializer_bytes(model) < STREAM_FROM_FILE_BYTES
    if small:
        return ort.InferenceSession(
            interop.session_bytes(model) + suffix,
            options(threads, precision),
            providers=["CPUExecutionProvider"],
            disabled_optimizers=_disabled(precision),
        )
    if isinstance(model, ir.Model):
        return _from_linked(model, suffix, threads, precision)
    with tempfile.TemporaryDirectory(prefix="vlmc-session-") as tmp:
        p = os.path.join(tmp, "m.onnx")
        graphs.save(model, p)
        with open(p, "ab") as f:
            f.write(suffix)
        return from_path(p, threads, precision)


def _from_linked(model: ir.Model, suffix: bytes, threads, precision) -> ort.InferenceSession:
    """A session on a large IR graph with nothing written to disk and no weight copied by vlmc.

    Weights that live in files (the package's data files, a pass's TensorStore) stay external: the
    graph proto names each data file by a short alias, and onnxruntime is given a read-only memory
    map of the real file under that alias (``add_external_initializers_from_files_in_memory``), which
    it computes from in place for its life (``_session``). Weights held in memory are handed over the
    same way, as their own buffers. Before, the whole graph was written
    to a temporary file first (26 GB of disk and write time for a 7B FP32 decoder). Symbolic links
    of the data files beside a temporary model do not work: onnxruntime 1.32 resolves them and
    refuses a target outside the model's directory; hard links make onnx-ir refuse the package's
    own data file (``st_nlink > 1``) while they exist.
    """
    proto, buffers, maps = _linked_proto(model)
    try:
        return _session(proto.SerializeToString() + suffix, buffers, options(threads, precision), precision)
    except BaseException:
        for m in maps:
            m.close()
        raise


def _session(data: bytes, buffers: list, so: ort.SessionOptions, precision) -> ort.InferenceSession:
    """A session whose external weights are ``buffers``, used in place for the session's life.

    onnxruntime copies in-memory external data by default, and MatMul prepacking keeps a packed copy
    of each float weight: either way the mapped file pages it read from and its own copy are both
    resident while the session is created (measured: 8 x 64 MiB FP32 weights, RSS +1034 MB at
    creation). With ``session.use_external_initializer_file_buffers_directly`` and no prepacking the
    session computes from the maps themselves (+10 MB at creation; pages count once, as they are
    read, and stay reclaimable page cache), with the same MLAS kernels. The buffers (and the maps
    they may be) are kept on the session so they outlive it; they are never closed while it lives.
    """
    if buffers:
        so.add_external_initializers_from_files_in_memory(
            [n for n, _ in buffers], [b for _, b in buffers], [len(b) for _, b in buffers]
        )
        so.add_session_config_entry("session.use_external_initializer_file_buffers_directly", "1")
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(
        data, so, providers=["CPUExecutionProvider"], disabled_optimizers=_disabled(precision)
    )
    sess._vlmc_weight_buffers = buffers  # the weights the session computes from: keep them alive
    return sess


def _linked_proto(model: ir.Model) -> tuple[onnx.ModelProto, list, list]:
    """The graph proto with large weights external under aliases, (alias, buffer) pairs, open maps."""
    aliases: dict[str, str] = {}
    buffers: list = []
    maps: list[mmap.mmap] = []
    swaps: list[tuple[ir.Value, object]] = []
    try:
        for g in model.graphs():
            for v in g.initializers.values():
                t = v.const_value
                if t is None:
                    continue
                if isinstance(t, ir.ExternalTensor):
                    target = os.path.realpath(t.path)
                    alias = aliases.get(target)
                    if alias is None:
                        alias = aliases[target] = f"vlmc-data-{len(aliases)}.bin"
                        with open(target, "rb") as f:
                            if os.fstat(f.fileno()).st_size:
                                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                                buffers.append((alias, maps[-1]))
                    new = ir.ExternalTensor(alias, t.offset, t.length, t.dtype, shape=t.shape, name=t.name)
                elif t.nbytes >= graphs.EXTERNAL_DATA_THRESHOLD:
                    alias = f"vlmc-memory-{len(buffers)}.bin"
                    raw = np.ascontiguousarray(t.numpy()).view(np.uint8).reshape(-1)
                    buffers.append((alias, raw))
                    new = ir.ExternalTensor(alias, 0, raw.nbytes, t.dtype, shape=t.shape, name=t.name)
                else:
                    continue
                swaps.append((v, t))
                v.const_value = new
        proto = ir.to_proto(model)
    except BaseException:
        for m in maps:
            m.close()
        raise
    finally:
        for v, t in swaps:
            v.const_value = t
    graphs.drop_initializer_infos(proto, model)
    return proto, buffers, maps


def dequantized(model: ir.Model, threads: int | None = None) -> ort.InferenceSession:
    """A session on a weight-only graph with each weight's dequantization run once, not per call.

    Used to measure fidelity, where the same graph runs many times (every greedy token). A weight-only
    graph's float weights are computed by constant chains (Cast -> Sub -> Mul -> Reshape per MatMul);
    run per call (``_KEEP_DEQUANT``) they cost a whole-model dequantization per decoder step
    (measured: 12 x 2048^2 INT4 MatMuls, one token, 0.51 s per call against 0.032 s for FP32), and
    onnxruntime's own constant folding holds every chain's intermediates at once (+1.87 GB of RSS for
    those 201 MB of FP32 weights). Here each chain runs alone on onnxruntime (the same kernels, so the
    same float weights), its result goes to a temporary data file, and the session is opened on the
    graph with the chains replaced by those weights: the session then holds the FP32 model's size,
    as the FP32 reference run did, and runs at its speed.
    """
    proto, buffers, maps = _linked_proto(model)
    try:
        graph = proto.graph
        const = {t.name for t in graph.initializer}
        inits = {t.name: t for t in graph.initializer}
        constant_nodes = []
        for node in graph.node:
            if (
                node.input
                and all(i == "" or i in const for i in node.input)
                and not any(
                    a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
                )
                and not node.op_type.startswith("Random")
            ):
                constant_nodes.append(node)
                const.update(node.output)
        if not constant_nodes:
            return _session(proto.SerializeToString(), buffers, options(threads), None)
        folded = {o for n in constant_nodes for o in n.output}
        live = [n for n in graph.node if not any(o in folded for o in n.output)]
        used = {i for n in live for i in n.input} | {o.name for o in graph.output}
        frontier = [o for n in constant_nodes for o in n.output if o in used]
        producer = {o: n for n in constant_nodes for o in n.output}
        with tempfile.TemporaryDirectory(prefix="vlmc-dequant-") as tmp:
            data_path = os.path.join(tmp, "weights.bin")
            new_inits = []
            with open(data_path, "wb") as out:
                for name in frontier:
                    cone, stack, seen = [], [name], set()
                    while stack:
                        v = stack.pop()
                        n = producer.get(v)
                        if n is None or id(n) in seen:
                            continue
                        seen.add(id(n))
                        cone.append(n)
                        stack.extend(i for i in n.input if i)
                    order = {id(n): k for k, n in enumerate(graph.node)}
                    cone.sort(key=lambda n: order[id(n)])
                    needs = {i for n in cone for i in n.input if i in inits}
                    mini = onnx.helper.make_model(
                        onnx.helper.make_graph(
                            cone,
                            "chain",
                            [],
                            [onnx.ValueInfoProto(name=name)],
                            [inits[i] for i in sorted(needs)],
                        ),
                        opset_imports=proto.opset_import,
                        ir_version=proto.ir_version,
                    )
                    # Run at call time (not folded at creation) so the kernels are the per-call path's.
                    sess = _session(mini.SerializeToString(), buffers, options(threads), "int4_weight_only")
                    (arr,) = sess.run([name], {})
                    del sess
                    offset = -out.tell() % 64 + out.tell()
                    out.seek(offset)
                    raw = np.ascontiguousarray(arr)
                    out.write(raw.reshape(-1).view(np.uint8).data)  # no bytes copy of the weight
                    t = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(raw.dtype))
                    t.dims.extend(raw.shape)
                    t.data_location = onnx.TensorProto.EXTERNAL
                    graphs._point_at(t, "vlmc-dequantized.bin", offset, raw.nbytes)
                    new_inits.append(t)
                    del arr, raw
            keep = [t for t in graph.initializer if t.name in used]
            del graph.node[:]
            graph.node.extend(live)
            del graph.initializer[:]
            graph.initializer.extend(keep + new_inits)
            with open(data_path, "rb") as f:
                if os.fstat(f.fileno()).st_size:
                    maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                    buffers.append(("vlmc-dequantized.bin", maps[-1]))
            # The session computes from the maps in place (``_session``: no prepacked or copied
            # weights); the temporary file is unlinked when this block ends, its map lives on with
            # the session, so its pages are the only copy of the dequantized weights.
            return _session(proto.SerializeToString(), buffers, options(threads), None)
    except BaseException:
        for m in maps:
            m.close()
        raise


def for_graph(pkg, name: str, threads: int | None = None) -> ort.InferenceSession:
    """Session for a package graph: straight from disk when unmodified, else from memory."""
    path = pkg.path_of(name)
    precision = pkg.info(name).get("precision")
    if path is not None:
        return from_path(path, threads, precision)
    return from_model(pkg.model(name), threads, precision=precision)
