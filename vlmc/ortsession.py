"""onnxruntime sessions for package graphs, on disk or in memory."""

from __future__ import annotations

import logging
import mmap
import os
import tempfile

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from vlmc import interop, memory

logger = logging.getLogger(__name__)

# onnxruntime's graph-optimizer warnings are noise for users; errors still surface as exceptions.
ort.set_default_logger_severity(3)
# An IR graph this large hands its weights over as memory maps (``_from_linked``): serializing it in
# memory would hold its weights three times at once (the proto, its bytes, and onnxruntime's copy).
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


def _disabled(precision: str | None, model=None) -> list[str]:
    off = ["ConstantFolding"] if precision in _KEEP_DEQUANT else []
    if precision == "fp16" or (model is not None and _float16_conv(model)):
        # The NCHWc layout transformer crashed onnxruntime 1.32's session creation (SIGSEGV at
        # ORT_ENABLE_ALL) on a vision graph with a float16 Conv (Qwen-VL's patch embedding after the
        # fp16 pass). Float32 graphs keep it: it changes their Conv numerics, which tests pin.
        off.append("NchwcTransformer")
    return off


def _float16_conv(model) -> bool:
    """True when a Conv of an onnx-ir model takes a float16 weight."""
    if not isinstance(model, ir.Model):  # a tool's ModelProto: its Convs are not looked at
        return False
    return any(
        node.op_type == "Conv"
        and len(node.inputs) > 1
        and node.inputs[1] is not None
        and node.inputs[1].dtype == ir.DataType.FLOAT16
        for node in model.graph.all_nodes()
    )


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
    model: ir.Model,
    threads: int | None = None,
    extra_outputs: list = (),  # names, or onnx ValueInfoProtos (see interop.outputs_suffix)
    precision: str | None = None,
) -> ort.InferenceSession:
    """A CPU session for an in-memory model; large IR graphs get their weights as memory maps.

    Args:
        model: the graph (an onnx-ir model, or a tool's ModelProto); it is not changed.
        threads: intra-op threads (default: onnxruntime's).
        extra_outputs: internal tensors the session also returns (e.g. activations for calibration),
            by name (float32) or as value infos.
        precision: the graph's manifest precision; weight-only graphs keep their dequantization
            unfolded (see ``_KEEP_DEQUANT``).
    """
    # A tool's or a test's ModelProto is bounded by protobuf itself (under 2 GiB): always in memory.
    data, suffix = interop.session_input(model, extra_outputs, in_memory_below=STREAM_FROM_FILE_BYTES)
    if data is not None:
        return ort.InferenceSession(
            data + suffix,
            options(threads, precision),
            providers=["CPUExecutionProvider"],
            disabled_optimizers=_disabled(precision, model),
        )
    return _from_linked(model, suffix, threads, precision)


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
    data, buffers, maps = _linked(model)
    try:
        return _session(data + suffix, buffers, options(threads, precision), precision)
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


def _linked(model: ir.Model) -> tuple[bytes, list, list]:
    """The serialized graph with large weights external under aliases, (alias, buffer) pairs, open maps."""
    aliases: dict[str, str] = {}
    buffers: list = []
    maps: list[mmap.mmap] = []
    stubs: dict[ir.Value, ir.TensorProtocol] = {}
    try:
        for g in model.graphs():
            for v in g.initializers.values():
                t = v.const_value
                if isinstance(t, ir.ExternalTensor):
                    target = os.path.realpath(t.path)
                    name = aliases.get(target)
                    if name is None:
                        name = aliases[target] = f"vlmc-data-{len(aliases)}.bin"
                        with open(target, "rb") as f:
                            if os.fstat(f.fileno()).st_size:
                                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                                buffers.append((name, maps[-1]))
                    stubs[v] = ir.ExternalTensor(
                        name, t.offset, t.length, t.dtype, shape=t.shape, name=t.name
                    )
                elif t is not None and t.nbytes >= interop.EXTERNAL_DATA_THRESHOLD:
                    name = f"vlmc-memory-{len(buffers)}.bin"
                    raw = np.ascontiguousarray(t.numpy()).view(np.uint8).reshape(-1)
                    buffers.append((name, raw))
                    stubs[v] = ir.ExternalTensor(name, 0, raw.nbytes, t.dtype, shape=t.shape, name=t.name)
        return interop.serialized(model, stubs), buffers, maps
    except BaseException:
        _close(maps)
        raise


def _close(maps: list[mmap.mmap]) -> None:
    for m in maps:
        m.close()


def _constant_chains(graph: ir.Graph) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes computed from initializers alone, and those of their outputs the rest of the graph reads."""
    const: set[ir.Value] = set(graph.initializers.values())
    chains: list[ir.Node] = []
    for node in graph:
        if (
            node.inputs
            and all(i is None or i in const for i in node.inputs)
            and not any(
                a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()
            )
            and not node.op_type.startswith("Random")
        ):
            chains.append(node)
            const.update(node.outputs)
    folded = {id(n) for n in chains}
    outputs = set(graph.outputs)
    frontier = [
        o
        for n in chains
        for o in n.outputs
        if o in outputs or any(id(user) not in folded for user, _ in o.uses())
    ]
    return chains, frontier


def dequantized(model: ir.Model, threads: int | None = None) -> ort.InferenceSession:
    """A session on a weight-only graph with each weight's dequantization run once, not per call.

    Used to measure fidelity, where the same graph runs many times (every greedy token). A weight-only
    graph's float weights are computed by constant chains (Cast -> Sub -> Mul -> Reshape per MatMul);
    run per call (``_KEEP_DEQUANT``) they cost a whole-model dequantization per decoder step
    (measured: 12 x 2048^2 INT4 MatMuls, one token, 0.51 s per call against 0.032 s for FP32), and
    onnxruntime's own constant folding holds every chain's intermediates at once (+1.87 GB of RSS for
    those 201 MB of FP32 weights). Here each chain (onnx-ir's ``extract`` of it, weights shared, not
    read) runs alone on onnxruntime (the same kernels, so the same float weights), its result goes to
    a temporary data file, and the session is opened on a clone of the graph (weights shared) with
    the chains replaced by those weights: the session then holds the FP32 model's size, as the FP32
    reference run did, and runs at its speed. The model is not changed.
    """
    work = model.clone()  # shares the weight tensors: nothing is read
    graph = work.graph
    chains, frontier = _constant_chains(graph)
    if not chains:
        data, buffers, _ = _linked(work)
        return _session(data, buffers, options(threads), None)
    with tempfile.TemporaryDirectory(prefix="vlmc-dequant-") as tmp:
        out = open(os.path.join(tmp, "weights.bin"), "wb")  # noqa: SIM115 (closed below, before it is mapped)
        for k, value in enumerate(frontier):
            chain = ir.Model(ir.convenience.extract(graph, [], [value]), ir_version=work.ir_version)
            data, buffers, maps = _linked(chain)
            try:
                # Run at call time (not folded at creation) so the kernels are the per-call path's.
                sess = _session(data, buffers, options(threads), "int4_weight_only")
                (arr,) = sess.run(None, {})
                del sess
            finally:
                _close(maps)  # the integer weights' pages this chain read are not kept resident
            name = value.name or f"vlmc_dequantized_{k}"
            raw = np.ascontiguousarray(arr)
            out.seek(-out.tell() % 64 + out.tell())
            offset = out.tell()
            out.write(raw.reshape(-1).view(np.uint8).data)  # no bytes copy of the weight
            dtype = ir.DataType.from_numpy(raw.dtype)
            tensor = ir.ExternalTensor(
                "weights.bin", offset, raw.nbytes, dtype, shape=ir.Shape(raw.shape), name=name, base_dir=tmp
            )
            folded = ir.Value(name=name, const_value=tensor, type=ir.TensorType(dtype), shape=tensor.shape)
            del arr, raw
            ir.convenience.replace_all_uses_with(value, folded, replace_graph_outputs=True)
            graph.register_initializer(folded)
        out.close()
        graph.remove(chains, safe=True)
        for name in [n for n, v in graph.initializers.items() if not v.uses() and v not in graph.outputs]:
            graph.initializers.pop(name)
        # The session computes from the maps in place (``_session``: no prepacked or copied
        # weights); the temporary file is unlinked when this block ends, its map lives on with
        # the session, so its pages are the only copy of the dequantized weights. Without the
        # arena a run's activations go back to the system after the run instead of staying
        # reserved (at the arena's rounded-up high-water mark) for the session's life: fidelity
        # holds this session beside the recorded FP32 outputs. Allocation only: same kernels.
        memory.release_free()  # the chains' intermediates
        so = options(threads)
        so.enable_cpu_mem_arena = False
        data, buffers, maps = _linked(work)
        try:
            return _session(data, buffers, so, None)
        except BaseException:
            _close(maps)
            raise


def for_graph(pkg, name: str, threads: int | None = None) -> ort.InferenceSession:
    """Session for a package graph: straight from disk when unmodified, else from memory."""
    source, info = pkg.source(name)  # one question to the package: its file or its IR, and its facts
    precision = info.get("precision")
    if (info.get("ort") or {}).get("nodes_lowered"):
        precision = None  # MatMulNBits by the ort target: no dequant chain is left to keep unfolded
    if isinstance(source, ir.Model):
        return from_model(source, threads, precision=precision)
    return from_path(source, threads, precision)
