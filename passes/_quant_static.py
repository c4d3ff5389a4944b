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
import onnx
from onnx import helper, numpy_helper

from vlmc import graphs as G

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0
# The smallest activation scale whose reciprocal is representable in fp16 (checked in float32).
MIN_ACT_SCALE = float(np.float32(1.0 / FP16_MAX))
while 1.0 / np.float32(MIN_ACT_SCALE) > FP16_MAX:
    MIN_ACT_SCALE = float(np.nextafter(np.float32(MIN_ACT_SCALE), np.float32(1)))

_WEIGHT_INPUT = {"MatMul": 1, "Gemm": 1, "Conv": 1}


def weighted_nodes(
    model: onnx.ModelProto, op_types, keep, names: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Names of nodes with a constant weight to quantize, and of such nodes kept in float32.

    ``names`` gives every node's name (see :func:`node_names`); default: the names in the graph.
    """
    inits = {t.name: t for t in model.graph.initializer}
    names = names if names is not None else [n.name for n in model.graph.node]
    take, kept = [], []
    for node, name in zip(model.graph.node, names):
        idx = _WEIGHT_INPUT.get(node.op_type)
        if node.op_type not in op_types or idx is None or len(node.input) <= idx:
            continue
        w = inits.get(node.input[idx])
        if w is None or w.data_type != onnx.TensorProto.FLOAT:
            continue
        (kept if keep.matches(node, name) else take).append(name)
    return take, kept


def quantize_int8(model: onnx.ModelProto, reader, plan, seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """Static INT8 QDQ quantization of ``model``; returns the new model and the facts for the manifest."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    import vlmc.ortsession  # noqa: F401  (quiets onnxruntime's logger)

    names = node_names(model)
    nodes, kept = weighted_nodes(model, plan.op_types, plan.keep_fp32, names)
    if not nodes:
        return model, {"mode": "int8", "nodes_kept_fp32": kept, "nodes_quantized": []}
    facts = {"mode": "int8", "nodes_kept_fp32": kept}
    method = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }[plan.calibration.method]
    if not plan.activation_symmetric and plan.target == "ascend":
        logger.warning(
            "quantize: %s: asymmetric int8 activations lower to AMCT's deploy form (AscendQuant offset, "
            "bias not corrected; GE applies the offset); this form is unverified on hardware",
            plan.key,
        )
    # Conv weights per output channel, MatMul/Gemm weights per tensor: the forms AMCT deploys
    # (hicann/amct: CHANNEL_WISE_ONNX_TYPES is Conv/ConvTranspose/LSTM/GRU; convert_qat_model's
    # LinearQAT refuses channel-wise). per_channel=False and a per-channel override on each Conv weight
    # gives exactly that with onnxruntime's own quantizer.
    conv_weights = {
        n.input[1]
        for n, name in zip(model.graph.node, names)
        if n.op_type == "Conv" and name in nodes and len(n.input) > 1
    }
    with tempfile.TemporaryDirectory(prefix="vlmc-quant-") as tmp:
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        G.save(model, src)
        _name_saved_nodes(src, names)
        np.random.seed(seed)  # the entropy/percentile calibrators subsample with numpy's global RNG
        with _quiet_root_logger():
            quantize_static(
                str(src),
                str(dst),
                reader,
                quant_format=QuantFormat.QDQ,
                per_channel=False,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=nodes,
                calibrate_method=method,
                use_external_data_format=True,
                extra_options={
                    "WeightSymmetric": True,
                    # AscendQuant's offset: 0 unless asked (see GraphPlan.activation_symmetric)
                    "ActivationSymmetric": bool(plan.activation_symmetric),
                    "MatMulConstBOnly": True,
                    # AscendDequant gives float out of the int32 accumulator: no requantized output
                    "OpTypesToExcludeOutputQuantization": list(_WEIGHT_INPUT),
                    "TensorQuantOverrides": {w: [{"axis": 0}] for w in sorted(conv_weights)},
                },
            )
        out = G.load(dst)
    clamped = clamp_activation_scales(out)
    biases = int32_matmul_bias(out)
    facts.update(collect_int8_facts(out))
    facts["activations"]["symmetric"] = bool(plan.activation_symmetric)
    facts.update(
        {
            "target": plan.target,
            "nodes_quantized": nodes,
            "clamped_scales": clamped,
            "matmul_bias_int32": biases,
        }
    )
    return out, facts


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
        yield
    finally:
        root.removeFilter(f)


def node_names(model: onnx.ModelProto) -> list[str]:
    """Every node's name, with a unique made-up one for unnamed nodes; the model is not changed.

    quantize_static and the fp16 converter select nodes by name, so unnamed nodes would be ambiguous.
    The names are applied to the copy the tools work on, never to the package's graph.
    """
    used = {n.name for n in model.graph.node if n.name}
    names = []
    for i, node in enumerate(model.graph.node):
        name = node.name
        if not name:
            name = f"{node.op_type}_{i}"
            while name in used:
                name += "_"
            used.add(name)
        names.append(name)
    return names


def _apply_names(model: onnx.ModelProto, names: list[str]) -> bool:
    """Name the nodes as :func:`node_names` listed them; True if any name changed."""
    changed = False
    for node, name in zip(model.graph.node, names):
        if node.name != name:
            node.name = name
            changed = True
    return changed


def _name_saved_nodes(path: Path, names: list[str]) -> None:
    # Only the protobuf is rewritten: its weights stay in the external data file beside it.
    skeleton = G.load(path, load_weights=False)
    if _apply_names(skeleton, names):
        path.write_bytes(skeleton.SerializeToString())


def clamp_activation_scales(model: onnx.ModelProto) -> list[dict]:
    """Raise QuantizeLinear scales below 1/65504 so that 1/s fits fp16; return what was clamped."""
    inits = {t.name: t for t in model.graph.initializer}
    clamped, done = [], set()
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[1] in done or node.input[1] not in inits:
            continue
        t = inits[node.input[1]]
        s = numpy_helper.to_array(t)
        if s.size and float(s.min()) < MIN_ACT_SCALE:
            new = np.maximum(s, np.float32(MIN_ACT_SCALE)).astype(s.dtype)
            t.CopyFrom(numpy_helper.from_array(new, t.name))
            clamped.append({"tensor": node.input[0], "scale": float(s.min()), "clamped_to": MIN_ACT_SCALE})
        done.add(node.input[1])
    if clamped:
        logger.warning(
            "quantize: %d activation scale(s) raised to 1/65504 so that AscendQuant's fp16 1/s fits",
            len(clamped),
        )
    return clamped


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def int32_matmul_bias(model: onnx.ModelProto) -> int:
    """Turn the float bias of quantized MatMul -> Add into int32 + DequantizeLinear (scale s_x*s_w).

    This is the form Conv/Gemm bias already has after quantize_static, and what AscendDequant after
    the bias Add expects. Returns the number of biases converted.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    prod = _producers(model)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    new_nodes: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    count = 0
    for node in g.node:
        if node.op_type != "MatMul":
            continue
        dqs = [prod.get(i) for i in node.input]
        if not all(d is not None and d.op_type == "DequantizeLinear" for d in dqs):
            continue
        users = consumers.get(node.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add":
            continue
        add = users[0]
        bias_name = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        src = prod.get(bias_name)
        # Packages exported before the exporter inlined shared small constants route some biases
        # through Identity(initializer); read the initializer behind it.
        b = inits.get(src.input[0]) if src is not None and src.op_type == "Identity" else inits.get(bias_name)
        sx, sw = inits.get(dqs[0].input[1]), inits.get(dqs[1].input[1])
        if b is None or sx is None or sw is None or b.data_type != onnx.TensorProto.FLOAT or len(b.dims) != 1:
            continue
        bias = numpy_helper.to_array(b).astype(np.float64)
        scale = numpy_helper.to_array(sx).astype(np.float64).reshape(-1)[0] * numpy_helper.to_array(
            sw
        ).astype(np.float64).reshape(-1)
        if scale.size not in (1, bias.size):
            continue
        scale = np.broadcast_to(scale, bias.shape).astype(np.float32)
        q = np.clip(np.rint(bias / np.maximum(scale.astype(np.float64), 1e-30)), -(2**31), 2**31 - 1).astype(
            np.int32
        )
        qname, sname, out = (
            f"{bias_name}_{node.name}_int32",
            f"{bias_name}_{node.name}_scale",
            f"{bias_name}_{node.name}_dq",
        )
        g.initializer.extend([numpy_helper.from_array(q, qname), numpy_helper.from_array(scale, sname)])
        dq = helper.make_node(
            "DequantizeLinear", [qname, sname], [out], name=f"{add.name}_bias_DequantizeLinear", axis=0
        )
        for k, i in enumerate(add.input):
            if i == bias_name:
                add.input[k] = out
        new_nodes.append((add, dq))
        count += 1
    for add, dq in new_nodes:  # keep topological order: the DQ goes right before its Add
        idx = list(g.node).index(add)
        g.node.insert(idx, dq)
    if count:  # the float biases (and Identity nodes that fed them) are now unused
        from .simplify import remove_dead_nodes

        remove_dead_nodes(model)
    return count


def collect_int8_facts(model: onnx.ModelProto) -> dict:
    """Activation scales/zero points by tensor and weight quantization per node, read from the QDQ graph."""
    inits = {t.name: t for t in model.graph.initializer}
    prod = _producers(model)
    acts = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[1] in inits:
            s = numpy_helper.to_array(inits[node.input[1]]).reshape(-1)
            zp = (
                numpy_helper.to_array(inits[node.input[2]]).reshape(-1)
                if len(node.input) > 2
                else np.zeros(1)
            )
            acts[node.input[0]] = {"scale": float(s[0]), "zero_point": int(zp[0])}
    weights = {}
    for node in model.graph.node:
        idx = _WEIGHT_INPUT.get(node.op_type)
        if idx is None or len(node.input) <= idx:
            continue
        dq = prod.get(node.input[idx])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        src = prod.get(node.input[0])
        scale = inits.get(dq.input[1])
        per_tensor = scale is None or int(np.prod(scale.dims)) == 1
        entry = {
            "weight": dq.input[0],
            "scale": dq.input[1],
            "granularity": "per_tensor" if per_tensor else "per_channel",
            "axis": None if per_tensor else int(axis),
            "symmetric": True,
            "input": src.input[0] if src is not None and src.op_type == "DequantizeLinear" else node.input[0],
        }
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2:
            bdq = prod.get(node.input[2])
            if bdq is not None and bdq.op_type == "DequantizeLinear":
                entry["bias"] = bdq.input[0]
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


def convert_fp16(model: onnx.ModelProto, plan) -> tuple[onnx.ModelProto, dict]:
    """FP16 conversion with onnxruntime's float16 tool; keep_fp32 ops/nodes stay float32.

    ``model`` is left as it is when no node would be converted; otherwise the result replaces it.
    """
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    names = node_names(model)
    kept = [name for node, name in zip(model.graph.node, names) if plan.keep_fp32.matches(node, name)]
    op_block = list(DEFAULT_OP_BLOCK_LIST) + [
        t for t in plan.keep_fp32.op_types if t not in DEFAULT_OP_BLOCK_LIST
    ]
    facts = {"mode": "fp16", "keep_io_fp32": plan.keep_io_fp32, "nodes_kept_fp32": kept}
    blocked = set(kept)
    if all(name in blocked or node.op_type in op_block for node, name in zip(model.graph.node, names)):
        return model, {**facts, "nodes_converted": 0}
    if model.ByteSize() > 1_800_000_000:
        # Too large to serialize for shape inference: the converter works in place. Something is
        # converted, so the package replaces this graph anyway, and a copy would double the memory.
        work = model
    else:
        # The copy the converter's own shape inference would make, made here so the names go on it.
        work = onnx.shape_inference.infer_shapes(model)
    _apply_names(work, names)
    out = convert_float_to_float16(
        work,
        keep_io_types=plan.keep_io_fp32,
        op_block_list=op_block,
        node_block_list=kept,
        disable_shape_infer=True,
    )
    toposort(out)
    return out, {**facts, "nodes_converted": len(names) - len(kept)}


def toposort(model: onnx.ModelProto) -> None:
    """Order nodes topologically in place, keeping the existing order wherever it is already valid.

    convert_float_to_float16 appends the Casts it inserts for graph inputs (keep_io_types) after
    nodes that read them, which onnx.checker rejects.
    """
    g = model.graph
    ready = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    pending = list(g.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for n in pending:
            needs = set(n.input) | _outer_inputs(n)
            if needs <= ready:
                ordered.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):  # a cycle or a dangling input: leave the rest as they were
            ordered.extend(rest)
            break
        pending = rest
    del g.node[:]
    g.node.extend(ordered)


def _outer_inputs(node: onnx.NodeProto) -> set[str]:
    # Subgraphs (If/Loop) may read outer-scope names; only names produced in the main graph matter.
    names: set[str] = set()
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            inner = (
                {o for sn in sub.node for o in sn.output}
                | {i.name for i in sub.input}
                | {t.name for t in sub.initializer}
            )
            names |= {i for sn in sub.node for i in sn.input if i and i not in inner}
    return names
