"""INT8 static (QDQ) and FP16 conversion for the quantize pass, built on onnxruntime's own tools.

INT8: onnxruntime.quantization.quantize_static writes the standard QDQ form (per-tensor int8
activations, symmetric by default; symmetric int8 weights, per output channel for Conv and per tensor for
MatMul/Gemm as AMCT deploys them; int32 Conv/Gemm bias). Two things it does
not do are written here: int32 bias for the MatMul + Add pairs transformers exports for nn.Linear
(ORT only quantizes a bias that is an input of the op itself), and the FP16 bound on activation
scales that Ascend's AscendQuant needs (it multiplies by 1/s in fp16, so 1/s must stay ≤ 65504).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmc import ascend_limits, graphs, interop

logger = logging.getLogger(__name__)

FP16_MAX = ascend_limits.FP16_MAX
# The smallest activation scale whose reciprocal is representable in fp16 (checked in float32).
MIN_ACT_SCALE = ascend_limits.MIN_ACT_SCALE

_WEIGHT_INPUT = {"MatMul": 1, "Gemm": 1, "Conv": 1}


# Ops whose CPU kernels onnxruntime registers for float32 but not float16 (onnxruntime's
# docs/OperatorKernels.md: Resize T1 = float, int32, int8, uint8). Converted anyway, a graph holding one
# (Qwen-VL's interpolated position embedding) crashed onnxruntime's session creation at ORT_ENABLE_ALL.
_NO_FP16_CPU_KERNEL = ("Resize",)


def _const(v: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor behind an initializer value (None for anything computed)."""
    return v.const_value if v is not None and v.is_initializer() else None


def weighted_nodes(
    model: ir.Model, op_types, keep, names: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Names of nodes with a constant weight to quantize, and of such nodes kept in float32.

    ``names`` gives every node's name (see :func:`vlmc.graphs.node_names`); default: the names in the graph.
    """
    nodes = list(model.graph)
    names = names if names is not None else [n.name for n in nodes]
    take, kept = [], []
    for node, name in zip(nodes, names):
        idx = _WEIGHT_INPUT.get(node.op_type)
        if node.op_type not in op_types or idx is None or len(node.inputs) <= idx:
            continue
        w = _const(node.inputs[idx])
        if w is None or w.dtype != ir.DataType.FLOAT:
            continue
        (kept if keep.matches(node, name) else take).append(name)
    return take, kept


@contextlib.contextmanager
def _named(model: ir.Model, names: list[str]):
    """The model with every node named as :func:`vlmc.graphs.node_names` listed them, for the length of the block.

    quantize_static and the fp16 converter select nodes by name; the package's graph keeps its own.
    """
    nodes = list(model.graph)
    old = [n.name for n in nodes]
    for n, name in zip(nodes, names):
        n.name = name
    try:
        yield model
    finally:
        for n, name in zip(nodes, old):
            n.name = name


def quantize_int8(
    model: ir.Model, reader, scheme, seed: int = 0, directory: str | Path | None = None
) -> tuple[ir.Model, dict]:
    """Static INT8 QDQ quantization of ``model``; returns the new model and the facts for the manifest.

    onnxruntime's quantizer works on a file the graph is streamed to. Calibration runs one sample at a
    time (``CalibStridedMinMax``), so the calibrator holds one sample's activations and running
    statistics (min/max, or histograms that grow bin by bin), never every activation of every sample.
    The result's weights stay in its file under ``directory`` (memory-mapped); without a directory
    they are read into memory.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    import vlmc.ortsession  # noqa: F401  (quiets onnxruntime's logger)

    names = graphs.node_names(model)
    nodes, kept = weighted_nodes(model, scheme.op_types, scheme.keep_fp32, names)
    if not nodes:
        return model, {"mode": "int8", "nodes_kept_fp32": kept, "nodes_quantized": []}
    facts = {"mode": "int8", "nodes_kept_fp32": kept}
    method = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }[scheme.calibration.method]
    if not scheme.activation_symmetric and scheme.target == "ascend":
        logger.warning(
            "quantize: %s: asymmetric int8 activations lower to AMCT's deploy form (AscendQuant offset, "
            "bias not corrected; GE applies the offset); this form is unverified on hardware",
            scheme.key,
        )
    # Conv weights per output channel, MatMul/Gemm weights per tensor: the forms AMCT deploys
    # (hicann/amct: CHANNEL_WISE_ONNX_TYPES is Conv/ConvTranspose/LSTM/GRU; convert_qat_model's
    # LinearQAT refuses channel-wise). per_channel=False and a per-channel override on each Conv weight
    # gives exactly that with onnxruntime's own quantizer.
    wanted = set(nodes)
    # The op types of the nodes quantized, given to quantize_static: its calibrator then records
    # min/max of those ops' inputs and outputs only, not of every float tensor of every op type it
    # can quantize (the 24-layer CLIP ViT-L/14-336: 1657 tensors). The ranges quantize_static uses,
    # those of the quantized nodes' inputs, are the same values either way: each is its own
    # ReduceMin/ReduceMax of the same tensor.
    op_types = sorted({n.op_type for n, name in zip(model.graph, names) if name in wanted})
    conv_weights = {
        n.inputs[1].name
        for n, name in zip(model.graph, names)
        if n.op_type == "Conv" and name in wanted and len(n.inputs) > 1 and n.inputs[1] is not None
    }
    out_dir = Path(directory) if directory is not None else None
    with tempfile.TemporaryDirectory(prefix="vlmc-quant-") as tmp:
        dst = (out_dir or Path(tmp)) / "int8.onnx"
        with _named(model, names), interop.as_file(model, tmp, "fp32.onnx") as src:
            pass
        np.random.seed(seed)  # the entropy/percentile calibrators subsample with numpy's global RNG
        cache = None
        if method == CalibrationMethod.MinMax:
            cache = _minmax_cache(model, names, wanted, reader, src)
        with _quiet_root_logger(), _calibration_without_arena():
            quantize_static(
                str(src),
                str(dst),
                None if cache is not None else _OneAtATime(reader),
                calibration_cache_path=cache,
                quant_format=QuantFormat.QDQ,
                per_channel=False,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=nodes,
                op_types_to_quantize=op_types,
                calibrate_method=method,
                use_external_data_format=True,
                extra_options={
                    "WeightSymmetric": True,
                    # AscendQuant's offset: 0 unless asked (see GraphScheme.activation_symmetric)
                    "ActivationSymmetric": bool(scheme.activation_symmetric),
                    "MatMulConstBOnly": True,
                    # AscendDequant gives float out of the int32 accumulator: no requantized output
                    "OpTypesToExcludeOutputQuantization": list(_WEIGHT_INPUT),
                    "TensorQuantOverrides": {w: [{"axis": 0}] for w in sorted(conv_weights)},
                    # One calibration sample per collect step: running statistics, bounded memory.
                    "CalibStridedMinMax": 1,
                },
            )
        out = interop.load_result(dst, in_memory=out_dir is None)
    clamped = clamp_activation_scales(out)
    biases = int32_matmul_bias(out)
    facts.update(collect_int8_facts(out))
    facts["activations"]["symmetric"] = bool(scheme.activation_symmetric)
    facts.update(
        {
            "target": scheme.target,
            "nodes_quantized": nodes,
            "clamped_scales": clamped,
            "matmul_bias_int32": biases,
        }
    )
    return out, facts


def _minmax_cache(model: ir.Model, names: list[str], wanted: set[str], reader, src: Path) -> Path | None:
    """MinMax ranges of the quantized nodes' activation inputs, written as onnxruntime's calibration cache.

    quantize_static takes ranges from ``calibration_cache_path`` instead of calibrating itself
    (onnxruntime.quantization's own cache: save_tensors_data / load_tensors_data). Its MinMax
    calibrator would load the model a second time (weights and all), add a ReduceMin and a ReduceMax
    per input and output of every calibrated op, write that augmented copy with all its weights and
    open a session on it (for the 24-layer CLIP ViT-L/14-336: 1.25 GB held twice more, written and
    read again, and 1657 tensors reduced per sample). Here one session on ``src`` (the graph file
    quantize_static reads) returns just the tensors the quantizer uses: the float activation inputs
    of the quantized nodes, added as outputs in a second small model file beside ``src`` that shares
    its data file. The numbers are the calibrator's: its session options (from a file, no graph
    optimisation, arena off as :func:`_calibration_without_arena` sets it), so the same kernels give
    the same activations; each sample's min and max of each tensor, the least and greatest over the
    samples, stored as 1-element arrays of the tensor's dtype as the calibrator stores them. Returns
    None (the calibrator then runs) if a tensor is empty or not finite, where onnxruntime's
    ReduceMin/ReduceMax and numpy could differ.
    """
    import onnxruntime
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        TensorData,
        TensorsData,
        save_tensors_data,
    )

    # The quantized nodes (MatMul, Gemm, Conv) have a float32 weight (weighted_nodes), and each op's
    # inputs share one type: the activations they read are float32 whether or not the graph says so.
    tensors: list[str] = []
    for node, name in zip(model.graph, names):
        if name not in wanted:
            continue
        for v in node.inputs:
            if v is None or v.is_initializer() or v.const_value is not None:
                continue
            tensors.append(v.name)
    tensors = list(dict.fromkeys(tensors))
    inputs = {v.name for v in model.graph.inputs}
    outputs = {v.name for v in model.graph.outputs}
    fetch = [t for t in tensors if t not in inputs]
    # The graph's bytes followed by these are the graph with the extra outputs (interop.outputs_suffix).
    calib = src.with_name(src.stem + "-ranges.onnx")
    calib.write_bytes(src.read_bytes() + interop.outputs_suffix([t for t in fetch if t not in outputs]))
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_cpu_mem_arena = False
    sess = onnxruntime.InferenceSession(str(calib), sess_options=so, providers=["CPUExecutionProvider"])
    low: dict[str, np.ndarray] = {}
    high: dict[str, np.ndarray] = {}
    reader.rewind()
    try:
        while (feed := reader.get_next()) is not None:
            values = dict(zip(fetch, sess.run(fetch, feed))) if fetch else {}
            for t in tensors:
                a = values[t] if t in values else np.asarray(feed[t])
                if a.size == 0:
                    return None
                lo, hi = a.min(keepdims=True).reshape(-1), a.max(keepdims=True).reshape(-1)
                if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
                    return None
                low[t] = lo if t not in low else np.minimum(low[t], lo)
                high[t] = hi if t not in high else np.maximum(high[t], hi)
            del values
    finally:
        del sess
        calib.unlink()
        reader.rewind()
    if not low:
        return None
    path = src.with_name("ranges.json")
    ranges = {t: TensorData(lowest=low[t], highest=high[t]) for t in tensors}
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), path)
    return path


class _OneAtATime:
    """A calibration reader onnxruntime's strided calibration walks one sample at a time."""

    def __init__(self, reader) -> None:
        reader.rewind()
        self._feeds = []
        while (f := reader.get_next()) is not None:
            self._feeds.append(f)
        self._range = (0, len(self._feeds))
        self._i = 0

    def __len__(self) -> int:
        return len(self._feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._range, self._i = (start_index, end_index), start_index

    def get_next(self):
        if self._i >= self._range[1]:
            return None
        self._i += 1
        return self._feeds[self._i - 1]

    def rewind(self) -> None:
        self._i = self._range[0]


@contextlib.contextmanager
def _calibration_without_arena():
    """Run onnxruntime's calibrator with the CPU memory arena off.

    onnxruntime.quantization takes no SessionOptions for its calibration session
    (calibrate.py ``CalibraterBase.create_inference_session`` builds its own), and with the arena
    on the session keeps the high-water mark of every sample's intermediates: measured on the
    24-layer CLIP ViT-L/14-336 at LLaVA-1.5-7B widths, +2 to 3.4 GiB per calibration sample, flat
    at about 2.3 GiB with the arena off. The session is built as the library builds it (same
    graph, optimisation level and providers), only with ``enable_cpu_mem_arena = False``.
    """
    import onnxruntime
    from onnxruntime.quantization.calibrate import CalibraterBase

    original = CalibraterBase.create_inference_session

    def create_inference_session(self):
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.enable_cpu_mem_arena = False
        self.infer_session = onnxruntime.InferenceSession(
            self.augmented_model_path, sess_options=options, providers=self.execution_providers
        )

    CalibraterBase.create_inference_session = create_inference_session
    try:
        yield
    finally:
        CalibraterBase.create_inference_session = original


@contextlib.contextmanager
def _quiet_root_logger():
    # quantize_static logs "Please consider pre-processing" on the root logger for every model; the
    # pre-processing it means (symbolic shape inference + ORT graph optimisation) would rewrite the
    # graph into ORT-specific fused ops, which the Ascend backend must not receive.
    class _Drop(logging.Filter):
        def filter(self, record):
            return "pre-processing" not in record.getMessage() and "pre-process" not in record.getMessage()

    root, f = logging.getLogger(), _Drop()
    root.addFilter(f)
    try:
        with contextlib.redirect_stdout(None):  # the histogram collector prints progress lines
            yield
    finally:
        root.removeFilter(f)


def clamp_activation_scales(model: ir.Model) -> list[dict]:
    """Raise QuantizeLinear scales below 1/65504 so that 1/s fits fp16; return what was clamped."""
    clamped, done = [], set()
    for node in model.graph:
        if node.op_type != "QuantizeLinear":
            continue
        sv = node.inputs[1]
        t = _const(sv)
        if t is None or sv.name in done:
            continue
        s = t.numpy()
        if s.size and float(s.min()) < MIN_ACT_SCALE:
            new = np.maximum(s, np.float32(MIN_ACT_SCALE)).astype(s.dtype)
            sv.const_value = ir.tensor(new, name=sv.name)
            clamped.append(
                {"tensor": node.inputs[0].name, "scale": float(s.min()), "clamped_to": MIN_ACT_SCALE}
            )
        done.add(sv.name)
    if clamped:
        logger.warning(
            "quantize: %d activation scale(s) raised to 1/65504 so that AscendQuant's fp16 1/s fits",
            len(clamped),
        )
    return clamped


def _producer_op(v: ir.Value | None) -> ir.Node | None:
    return v.producer() if v is not None else None


def int32_matmul_bias(model: ir.Model) -> int:
    """Turn the float bias of quantized MatMul -> Add into int32 + DequantizeLinear (scale s_x*s_w).

    This is the form Conv/Gemm bias already has after quantize_static, and what AscendDequant after
    the bias Add expects. Returns the number of biases converted.
    """
    g = model.graph
    count = 0
    for node in list(g):
        if node.op_type != "MatMul":
            continue
        dqs = [_producer_op(i) for i in node.inputs]
        if not all(d is not None and d.op_type == "DequantizeLinear" for d in dqs):
            continue
        users = node.outputs[0].uses()
        if len(users) != 1 or users[0].node.op_type != "Add":
            continue
        add = users[0].node
        bias_v = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
        src = _producer_op(bias_v)
        # Packages exported before the exporter inlined shared small constants route some biases
        # through Identity(initializer); read the initializer behind it.
        b = _const(src.inputs[0]) if src is not None and src.op_type == "Identity" else _const(bias_v)
        sx, sw = _const(dqs[0].inputs[1]), _const(dqs[1].inputs[1])
        if b is None or sx is None or sw is None or b.dtype != ir.DataType.FLOAT or len(b.shape) != 1:
            continue
        bias = b.numpy().astype(np.float64)
        scale = sx.numpy().astype(np.float64).reshape(-1)[0] * sw.numpy().astype(np.float64).reshape(-1)
        if scale.size not in (1, bias.size):
            continue
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        q = np.clip(np.rint(bias / np.maximum(scale.astype(np.float64), 1e-30)), -(2**31), 2**31 - 1).astype(
            np.int32
        )
        base = f"{bias_v.name}_{node.name}"
        qv = ir.Value(name=f"{base}_int32", const_value=ir.tensor(q, name=f"{base}_int32"))
        sv = ir.Value(name=f"{base}_scale", const_value=ir.tensor(scale, name=f"{base}_scale"))
        for v in (qv, sv):
            v.shape, v.dtype = v.const_value.shape, v.const_value.dtype
            g.register_initializer(v)
        dq = ir.node(
            "DequantizeLinear",
            [qv, sv],
            {"axis": 0},
            name=f"{add.name}_bias_DequantizeLinear",
            outputs=[ir.Value(name=f"{base}_dq")],
        )
        g.insert_before(add, dq)  # keeps topological order: the DQ goes right before its Add
        for k, i in enumerate(add.inputs):
            if i is bias_v:
                add.replace_input_with(k, dq.outputs[0])
        count += 1
    if count:  # the float biases (and Identity nodes that fed them) are now unused
        RemoveUnusedNodesPass()(model)
    return count


def collect_int8_facts(model: ir.Model) -> dict:
    """Activation scales/zero points by tensor and weight quantization per node, read from the QDQ graph."""
    acts = {}
    for node in model.graph:
        if node.op_type == "QuantizeLinear" and _const(node.inputs[1]) is not None:
            s = _const(node.inputs[1]).numpy().reshape(-1)
            zpt = _const(node.inputs[2]) if len(node.inputs) > 2 else None
            zp = zpt.numpy().reshape(-1) if zpt is not None else np.zeros(1)
            acts[node.inputs[0].name] = {"scale": float(s[0]), "zero_point": int(zp[0])}
    weights = {}
    for node in model.graph:
        idx = _WEIGHT_INPUT.get(node.op_type)
        if idx is None or len(node.inputs) <= idx:
            continue
        dq = _producer_op(node.inputs[idx])
        if dq is None or dq.op_type != "DequantizeLinear" or _const(dq.inputs[0]) is None:
            continue
        axis = dq.attributes.get_int("axis", 1)
        src = _producer_op(node.inputs[0])
        scale = _const(dq.inputs[1])
        per_tensor = scale is None or scale.size == 1
        entry = {
            "weight": dq.inputs[0].name,
            "scale": dq.inputs[1].name,
            "granularity": "per_tensor" if per_tensor else "per_channel",
            "axis": None if per_tensor else int(axis),
            "symmetric": True,
            "input": src.inputs[0].name
            if src is not None and src.op_type == "DequantizeLinear"
            else node.inputs[0].name,
        }
        if node.op_type in ("Conv", "Gemm") and len(node.inputs) > 2:
            bdq = _producer_op(node.inputs[2])
            if bdq is not None and bdq.op_type == "DequantizeLinear":
                entry["bias"] = bdq.inputs[0].name
        weights[node.name] = entry
    return {
        "weights": {
            "dtype": "int8",
            "symmetric": True,
            # per output channel for Conv only; MatMul/Gemm per tensor (see quantize_int8)
            "per_channel_axis": {"Conv": 0},
            "nodes": weights,
        },
        "activations": {"dtype": "int8", "granularity": "per_tensor", "tensors": acts},
        "bias_dtype": "int32",
    }


# Weights of at least this many bytes never enter the converter's proto (a 4-byte stub stands in);
# the converter's verdict on each stub (float16 or float32) is applied to the real weight, one at a time.
FP16_STREAM_LIMIT = 1024


def convert_fp16(model: ir.Model, scheme, store=None) -> tuple[ir.Model, dict]:
    """FP16 conversion with onnxruntime's float16 tool; keep_fp32 ops/nodes stay float32.

    ``model`` is returned as it is when no node would be converted; otherwise a new model replaces it.
    The converter decides which nodes, value types and initializers become float16 and where Casts go;
    it never sees a weight's values. Every initializer of :data:`FP16_STREAM_LIMIT` bytes or more is
    handed to it as a one-element stub of the same name and dtype, and the weights it turned into
    float16 are converted afterwards one at a time, in row blocks, with the converter's own
    ``convert_np_to_float16`` (same clamping), and written to ``store`` (a
    :class:`vlmc.interop.TensorStore`; without it they stay in memory). Weights it kept float32 keep
    their memory-mapped tensors. Shape inference runs on the proto with those weights as typed inputs,
    so it sees their true shapes without their bytes.
    """
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    names = graphs.node_names(model)
    nodes = list(model.graph)
    kept = [name for node, name in zip(nodes, names) if scheme.keep_fp32.matches(node, name)]
    op_block = list(DEFAULT_OP_BLOCK_LIST) + [
        t for t in (*scheme.keep_fp32.op_types, *_NO_FP16_CPU_KERNEL) if t not in DEFAULT_OP_BLOCK_LIST
    ]
    facts = {"mode": "fp16", "keep_io_fp32": scheme.keep_io_fp32, "nodes_kept_fp32": kept}
    blocked = set(kept)
    if all(name in blocked or node.op_type in op_block for node, name in zip(nodes, names)):
        return model, {**facts, "nodes_converted": 0}
    with _named(model, names), interop.as_proto(model, weight_limit=FP16_STREAM_LIMIT) as seam:
        work = onnx.shape_inference.infer_shapes(seam.proto)  # small: the held weights are inputs
        _stub_held(work, seam.held)
        result = convert_float_to_float16(
            work,
            keep_io_types=scheme.keep_io_fp32,
            op_block_list=op_block,
            node_block_list=kept,
            disable_shape_infer=True,
        )
        out = _restore_fp16(result, seam.held, model, store)
        del work, result
    # convert_float_to_float16 appends the Casts it inserts for graph inputs (keep_io_types) after
    # nodes that read them; onnx-ir's stable sort puts them first and keeps every other node's order.
    TopologicalSortPass()(out)
    return out, {**facts, "nodes_converted": len(names) - len(kept)}


def _stub_held(proto, held: dict[str, ir.Value]) -> None:
    """Turn the held weights (graph inputs of ``proto``) back into initializers holding one zero each."""
    import onnx

    keep = [i for i in proto.graph.input if i.name not in held]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)
    for name, v in held.items():
        dtype = v.const_value.dtype
        stub = onnx.TensorProto(name=name, data_type=int(dtype), dims=[1])
        stub.raw_data = np.zeros(1, dtype.numpy()).tobytes()
        proto.graph.initializer.append(stub)


def _restore_fp16(result, held: dict[str, ir.Value], like: ir.Model, store) -> ir.Model:
    """The converter's result as IR with the real weights in place of the stubs (float16 where it chose)."""
    out = ir.from_proto(result)
    g = out.graph
    for name, v in g.initializers.items():
        if name not in held:
            continue
        src = held[name].const_value
        if v.dtype == ir.DataType.FLOAT16 and src.dtype == ir.DataType.FLOAT:
            v.const_value = _fp16_streamed(src, name, store)
        else:
            v.const_value = src
        v.dtype, v.shape = v.const_value.dtype, ir.Shape(v.const_value.shape)
        for use in v.uses():  # the Casts the converter put before float32 readers copied the stub's shape
            if use.node.op_type == "Cast":
                use.node.outputs[0].shape = ir.Shape(v.const_value.shape)
    interop.order_initializers_like(g, like)
    return out


_FP16_BLOCK = 1 << 22  # elements converted at a time (16 MiB of float32)


def _fp16_streamed(src: ir.TensorProtocol, name: str, store) -> ir.TensorProtocol:
    """``convert_np_to_float16`` of one weight, a block of elements at a time; into ``store`` if given."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    flat = src.numpy().reshape(-1)  # memory-mapped for a weight in a file
    out = np.empty(flat.shape, np.float16)
    for i in range(0, flat.size, _FP16_BLOCK):
        out[i : i + _FP16_BLOCK] = convert_np_to_float16(np.asarray(flat[i : i + _FP16_BLOCK]))
    del flat
    if isinstance(src, ir.ExternalTensor):
        src.release()
    out = out.reshape(tuple(src.shape.numpy()))
    return store.put(out, name) if store is not None else ir.tensor(out, name=name)
