"""Weight-only INT8 / INT4 quantization of MatMul/Gemm weights in a portable opset-17 form.

Hand-written because onnxruntime's tools do not produce a form ATC or opset 17 can take:
quantize_dynamic emits DynamicQuantizeLinear/MatMulInteger (not ATC-parseable, and it quantizes
activations), MatMulNBits is a com.microsoft op, and block-quantized DequantizeLinear needs opset 21.

* INT8: symmetric per output channel, ``Cast(w_int8) -> Mul(scale[n]) -> MatMul`` (not
  DequantizeLinear: onnxruntime would fuse that into an int8-compute MatMulNBits, see below).
* INT4: symmetric per group of ``group_size`` input rows, round-to-nearest, values in [-8, 7]. The
  dequant is plain arithmetic (Cast -> [Sub 8] -> Mul by the group scales -> Reshape) so that it
  runs at opset 17. ``packed`` storage keeps two values per uint8 (row 2i in the low nibble, row
  2i+1 in the high nibble, each stored as q+8); ``int8`` storage keeps one value per int8.
* AWQ (``method: awq``): per input channel scales s = mean|x|^alpha (alpha searched on a grid to
  minimise the MatMul output error on calibration activations), quantize diag(s)·W and put an
  explicit ``Mul(x, 1/s)`` before the MatMul. Folding 1/s into the preceding op is only exact for
  some producers (LayerNorm/RMSNorm weights, not residual adds); the explicit Mul is always exact
  and portable, and the Ascend lowering can fold it where it can prove it safe.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger(__name__)

AWQ_GRID = tuple(i / 10 for i in range(11))
AWQ_ROWS = 512  # calibration rows kept per MatMul for the alpha search


def _weight_users(model: onnx.ModelProto) -> dict[str, int]:
    count: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            count[i] = count.get(i, 0) + 1
    for o in model.graph.output:
        count[o.name] = count.get(o.name, 0) + 1
    return count


def candidates(
    model: onnx.ModelProto, keep, group_size: int | None
) -> tuple[list, list[str], dict[str, str]]:
    """(node, weight initializer, transposed) to quantize; nodes kept fp32; skipped nodes with reasons."""
    inits = {t.name: t for t in model.graph.initializer}
    users = _weight_users(model)
    take, kept, skipped = [], [], {}
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        w = inits.get(node.input[1])
        if w is None or w.data_type != onnx.TensorProto.FLOAT or len(w.dims) != 2:
            continue
        if keep.matches(node):
            kept.append(node.name)
            continue
        trans = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
            skipped[node.name] = "Gemm with transA"
            continue
        if users.get(w.name, 0) != 1:
            skipped[node.name] = "weight shared with other nodes"
            continue
        k = w.dims[1] if trans else w.dims[0]
        if group_size is not None and k % group_size:
            skipped[node.name] = f"input size {k} is not a multiple of group_size {group_size}"
            continue
        take.append((node, w, trans))
    return take, kept, skipped


def quant_int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel of a [k, n] weight: (q int8 [k, n], scale float32 [n])."""
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def quant_int4_group(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 RTN per group of g input rows of a [k, n] weight: (q int8 [k, n] in [-8, 7], scale [k/g, n])."""
    k, n = w.shape
    wg = w.reshape(k // g, g, n)
    amax = np.abs(wg).max(axis=1)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(wg / scale[:, None, :]), -8, 7).astype(np.int8).reshape(k, n)
    return q, scale


def dequant_int4(q: np.ndarray, scale: np.ndarray, g: int) -> np.ndarray:
    k, n = q.shape
    return (q.reshape(k // g, g, n).astype(np.float32) * scale[:, None, :]).reshape(k, n)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """[k, n] int4 values in int8 -> [k/2, n] uint8: row 2i in the low nibble, row 2i+1 in the high one."""
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8)


def unpack_int4(p: np.ndarray) -> np.ndarray:
    lo = (p & 0x0F).astype(np.int8) - 8
    hi = (p >> 4).astype(np.int8) - 8
    return np.stack([lo, hi], axis=1).reshape(p.shape[0] * 2, p.shape[1])


def awq_scales(
    x: np.ndarray, mean_abs: np.ndarray, w: np.ndarray, g: int, bits: int
) -> tuple[np.ndarray, float]:
    """Per-input-channel AWQ scales minimising |x W - (x/s) Q(diag(s) W)|² over the alpha grid."""
    ref = x @ w
    best, best_err, best_alpha = np.ones(w.shape[0], np.float32), None, 0.0
    base = np.maximum(mean_abs, 1e-8)
    for alpha in AWQ_GRID:
        s = base**alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        ws = w * s[:, None]
        if bits == 4:
            q, sc = quant_int4_group(ws, g)
            deq = dequant_int4(q, sc, g)
        else:
            q, sc = quant_int8_channel(ws)
            deq = q.astype(np.float32) * sc
        err = float(np.mean(((x / s) @ deq - ref) ** 2))
        if best_err is None or err < best_err:
            best, best_err, best_alpha = s, err, alpha
    return best, best_alpha


def collect_inputs(
    model: onnx.ModelProto, names: list[str], feeds: list[dict], rows: int = AWQ_ROWS, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each tensor name: (mean |x| per last-axis channel, up to ``rows`` sampled rows) over all feeds."""
    import vlmc.ortsession as S

    present = {o.name for o in model.graph.output}
    extra = [
        helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
        for n in dict.fromkeys(names)
        if n not in present
    ]
    sess = S.from_model(model, extra_outputs=extra)  # the package's graph itself is not touched
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    picked: dict[str, list[np.ndarray]] = {n: [] for n in names}
    wanted = list(dict.fromkeys(names))
    for feed in feeds:
        outs = sess.run(wanted, feed)
        for n, a in zip(wanted, outs):
            a = a.reshape(-1, a.shape[-1]).astype(np.float32)
            sums[n] = sums.get(n, 0) + np.abs(a).sum(axis=0)
            counts[n] = counts.get(n, 0) + a.shape[0]
            take = min(a.shape[0], max(1, rows // max(1, len(feeds))))
            picked[n].append(a[rng.choice(a.shape[0], take, replace=False)])
    del sess
    return {n: (sums[n] / counts[n], np.concatenate(picked[n])[:rows]) for n in wanted}


def quantize_weight_only(
    model: onnx.ModelProto, plan, feeds: list[dict] | None
) -> tuple[onnx.ModelProto, dict]:
    """INT8/INT4 weight-only quantization in place; returns the model and the manifest facts."""
    bits = 4 if plan.weights == "int4" else 8
    g = plan.group_size if bits == 4 else None
    take, kept, skipped = candidates(model, plan.keep_fp32, g)
    act = {}
    if plan.method == "awq" and take:
        act = collect_inputs(model, [n.input[0] for n, _, _ in take], feeds or [])
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes_facts: dict[str, dict] = {}
    before = after = 0
    for node, w_init, trans in take:
        w = numpy_helper.to_array(w_init).astype(np.float32)
        if trans:
            w = w.T
        before += w.nbytes
        prefix = node.name or w_init.name
        new_nodes: list[onnx.NodeProto] = []
        new_inits: list[onnx.TensorProto] = []
        fact: dict = {"input": node.input[0]}
        if plan.method == "awq":
            s, alpha = awq_scales(act[node.input[0]][1], act[node.input[0]][0], w, g or 0, bits)
            w = w * s[:, None]
            inv = numpy_helper.from_array((1.0 / s).astype(np.float32), f"{prefix}_awq_inv_scale")
            new_inits.append(inv)
            scaled = f"{prefix}_awq_scaled_input"
            new_nodes.append(
                helper.make_node("Mul", [node.input[0], inv.name], [scaled], name=f"{prefix}_awq_Mul")
            )
            node.input[0] = scaled
            fact.update({"awq_inv_scale": inv.name, "awq_alpha": alpha})
        deq = f"{prefix}_weight_dequant"
        if bits == 8:
            q, scale = quant_int8_channel(w)
            qi = numpy_helper.from_array(q, f"{w_init.name}_int8")
            si = numpy_helper.from_array(scale, f"{w_init.name}_scale")
            new_inits += [qi, si]
            # Cast -> Mul rather than DequantizeLinear(axis=1): onnxruntime's CPU optimizer fuses
            # DequantizeLinear -> MatMul into MatMulNBits with int8 compute, which quantizes the
            # activations too and breaks parity with the FP32 reference.
            new_nodes += [
                helper.make_node(
                    "Cast",
                    [qi.name],
                    [f"{prefix}_q_float"],
                    name=f"{prefix}_Cast_float",
                    to=onnx.TensorProto.FLOAT,
                ),
                helper.make_node(
                    "Mul",
                    [f"{prefix}_q_float", si.name],
                    [deq if not trans else deq + "_kn"],
                    name=f"{prefix}_Mul_scales",
                ),
            ]
            fact.update({"weight": qi.name, "scale": si.name, "axis": 1, "group_size": None})
            after += q.nbytes + scale.nbytes
        else:
            q, scale = quant_int4_group(w, g)
            k, n = q.shape
            sc = numpy_helper.from_array(scale.reshape(k // g, 1, n), f"{w_init.name}_scale")
            new_inits.append(sc)
            fact.update({"scale": sc.name, "axis": 1, "group_size": g, "storage": plan.int4_storage})
            grouped = f"{prefix}_q_grouped"
            shape_g = numpy_helper.from_array(np.array([k // g, g, n], np.int64), f"{prefix}_group_shape")
            shape_kn = numpy_helper.from_array(np.array([k, n], np.int64), f"{prefix}_weight_shape")
            new_inits += [shape_g, shape_kn]
            if plan.int4_storage == "packed":
                p = pack_int4(q)
                pi = numpy_helper.from_array(p, f"{w_init.name}_int4_packed")
                c16 = numpy_helper.from_array(np.array(16, np.int32), f"{prefix}_c16")
                c8 = numpy_helper.from_array(np.array(8, np.float32), f"{prefix}_c8")
                ax1 = numpy_helper.from_array(np.array([1], np.int64), f"{prefix}_axis1")
                new_inits += [pi, c16, c8, ax1]
                t = functools.partial("{}_{}".format, prefix)
                new_nodes += [
                    helper.make_node(
                        "Cast", [pi.name], [t("p32")], name=t("Cast_packed"), to=onnx.TensorProto.INT32
                    ),
                    helper.make_node("Div", [t("p32"), c16.name], [t("hi")], name=t("Div_hi")),
                    helper.make_node("Mul", [t("hi"), c16.name], [t("hi16")], name=t("Mul_hi")),
                    helper.make_node("Sub", [t("p32"), t("hi16")], [t("lo")], name=t("Sub_lo")),
                    helper.make_node("Unsqueeze", [t("lo"), ax1.name], [t("lo3")], name=t("Unsqueeze_lo")),
                    helper.make_node("Unsqueeze", [t("hi"), ax1.name], [t("hi3")], name=t("Unsqueeze_hi")),
                    helper.make_node(
                        "Concat", [t("lo3"), t("hi3")], [t("pairs")], name=t("Concat_nibbles"), axis=1
                    ),
                    helper.make_node(
                        "Reshape", [t("pairs"), shape_g.name], [t("u_grouped")], name=t("Reshape_groups")
                    ),
                    helper.make_node(
                        "Cast", [t("u_grouped")], [t("uf")], name=t("Cast_float"), to=onnx.TensorProto.FLOAT
                    ),
                    helper.make_node("Sub", [t("uf"), c8.name], [grouped], name=t("Sub_offset")),
                ]
                fact.update(
                    {
                        "weight": pi.name,
                        "packing": "uint8 [k/2, n]: low nibble row 2i, high nibble row 2i+1, stored q+8",
                    }
                )
                after += p.nbytes + scale.nbytes
            else:
                qi = numpy_helper.from_array(q, f"{w_init.name}_int4")
                new_inits.append(qi)
                new_nodes += [
                    helper.make_node(
                        "Reshape",
                        [qi.name, shape_g.name],
                        [f"{prefix}_q_i8g"],
                        name=f"{prefix}_Reshape_groups",
                    ),
                    helper.make_node(
                        "Cast",
                        [f"{prefix}_q_i8g"],
                        [grouped],
                        name=f"{prefix}_Cast_float",
                        to=onnx.TensorProto.FLOAT,
                    ),
                ]
                fact.update({"weight": qi.name})
                after += q.nbytes + scale.nbytes
            new_nodes += [
                helper.make_node(
                    "Mul", [grouped, sc.name], [f"{prefix}_w_grouped"], name=f"{prefix}_Mul_scales"
                ),
                helper.make_node(
                    "Reshape",
                    [f"{prefix}_w_grouped", shape_kn.name],
                    [deq if not trans else deq + "_kn"],
                    name=f"{prefix}_Reshape_weight",
                ),
            ]
        if trans:  # Gemm with transB: dequantize in [k, n] and transpose back to its [n, k]
            new_nodes.append(
                helper.make_node("Transpose", [deq + "_kn"], [deq], name=f"{prefix}_Transpose", perm=[1, 0])
            )
        node.input[1] = deq
        graph.initializer.extend(new_inits)
        graph.initializer.remove(inits[w_init.name])
        idx = list(graph.node).index(node)
        for j, nn in enumerate(new_nodes):
            graph.node.insert(idx + j, nn)
        nodes_facts[node.name] = fact
    mode = "int4_weight_only" if bits == 4 else "int8_weight_only"
    facts = {
        "mode": mode,
        "target": plan.target,
        "method": plan.method,
        "nodes_quantized": list(nodes_facts),
        "nodes_kept_fp32": kept,
        "nodes_skipped": skipped,
        "weights": {
            "dtype": f"int{bits}",
            "symmetric": True,
            "per_channel_axis": {"MatMul": 1},
            "group_size": g,
            "nodes": nodes_facts,
        },
    }
    return model, {**facts, "_weight_bytes": (before, after)}
