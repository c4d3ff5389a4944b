"""Weight-only INT8 / INT4 quantization of MatMul/Gemm weights in a portable opset-17 form.

Hand-written because onnxruntime's tools do not produce a form ATC or opset 17 can take:
quantize_dynamic emits DynamicQuantizeLinear/MatMulInteger (not ATC-parseable, and it quantizes
activations), MatMulNBits is a com.microsoft op, and block-quantized DequantizeLinear needs opset 21.

* INT8: symmetric per output channel, ``Cast(w_int8) -> Mul(scale[n]) -> MatMul`` (not
  DequantizeLinear: onnxruntime would fuse that into an int8-compute MatMulNBits, see below).
* INT4: symmetric per group of ``group_size`` input rows, round-to-nearest, values in [-8, 7].
  Scales (:func:`int4_scales`) use the full signed range by default: the group's largest-magnitude
  value maps to -8 exactly (openvinotoolkit/nncf weight_lowering.py ``calculate_signed_scale``), so
  the scale is negative when that value is positive; ``int4_scale: absmax`` keeps max|w|/7 (values
  in [-7, 7]). Either is the same deploy form for every target: onnxruntime's MatMulNBits and CANN's
  NPUWeightQuantBatchMatmulV2 compute ``(q [+ offset]) * scale`` with no sign rule on the scale. The
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

import concurrent.futures
import functools
import logging
import os

import numpy as np
import onnx_ir as ir

from . import segments

logger = logging.getLogger(__name__)

AWQ_GRID = tuple(i / 10 for i in range(11))
AWQ_ROWS = 512  # calibration rows kept per MatMul for the alpha search


def _gemm_flag(node: ir.Node, name: str) -> bool:
    attr = node.attributes.get(name)
    return bool(attr is not None and attr.value)


def candidates(model: ir.Model, keep, group_size: int | None) -> tuple[list, list[str], dict[str, str]]:
    """(node, weight initializer value, transposed) to quantize; nodes kept fp32; skipped nodes with reasons."""
    take, kept, skipped = [], [], {}
    for node in model.graph:
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        w = node.inputs[1]
        if (
            w is None
            or not w.is_initializer()
            or w.const_value is None
            or w.const_value.dtype != ir.DataType.FLOAT
            or len(w.const_value.shape) != 2
        ):
            continue
        if keep.matches(node):
            kept.append(node.name)
            continue
        trans = node.op_type == "Gemm" and _gemm_flag(node, "transB")
        if node.op_type == "Gemm" and _gemm_flag(node, "transA"):
            skipped[node.name] = "Gemm with transA"
            continue
        if len(w.uses()) + int(w.is_graph_output()) != 1:
            skipped[node.name] = "weight shared with other nodes"
            continue
        dims = w.const_value.shape.numpy()
        k = dims[1] if trans else dims[0]
        if group_size is not None and k % group_size:
            skipped[node.name] = f"input size {k} is not a multiple of group_size {group_size}"
            continue
        take.append((node, w, trans))
    return take, kept, skipped


def gather_candidates(model: ir.Model, keep) -> tuple[list, dict[str, str]]:
    """(Gather node, table value) of embedding lookups to quantize (a 2-D float32 table gathered on axis 0
    that nothing else reads), and skipped Gathers with reasons."""
    take, skipped = [], {}
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or keep.matches(node):
            continue
        w = node.inputs[0]
        if w is None or not w.is_initializer() or w.const_value is None:
            continue
        if w.const_value.dtype != ir.DataType.FLOAT or len(w.const_value.shape) != 2:
            continue
        axis = node.attributes.get("axis")
        if axis is not None and axis.value != 0:
            skipped[node.name] = f"Gather on axis {axis.value} (an embedding lookup gathers rows)"
            continue
        if len(w.uses()) + int(w.is_graph_output()) != 1:
            skipped[node.name] = "table shared with other nodes (a tied LM head)"
            continue
        take.append((node, w))
    return take, skipped


def quant_int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row of a [v, d] table: (q int8 [v, d], scale float32 [v, 1])."""
    q, scale = quant_int8_channel(np.ascontiguousarray(w.T))
    return np.ascontiguousarray(q.T), scale.reshape(-1, 1)


def quant_int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel of a [k, n] weight: (q int8 [k, n], scale float32 [n])."""
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def int4_scales(wmax: np.ndarray, wmin: np.ndarray, rule: str = "signed") -> np.ndarray:
    """Per-group int4 scales from each group's largest and smallest value (float32; 1 for an all-zero group).

    ``signed``: the largest-magnitude value maps to -8 (NNCF's ``calculate_signed_scale``: scale =
    |min|/8 when |min| >= max, else -max/8), using all 16 levels; ``absmax``: max|w|/7.
    """
    amax = np.maximum(wmax, -wmin)
    if rule == "absmax":
        scale = amax / 7.0
    else:
        scale = np.where(-wmin >= wmax, -wmin, -wmax) / 8.0
    return np.where(amax > 0, scale, 1.0).astype(np.float32)


def quant_int4_group(w: np.ndarray, g: int, rule: str = "signed") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 RTN per group of g input rows of a [k, n] weight: (q int8 [k, n] in [-8, 7], scale [k/g, n])."""
    k, n = w.shape
    wg = w.reshape(k // g, g, n)
    scale = int4_scales(wg.max(axis=1), wg.min(axis=1), rule)
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
    x: np.ndarray, mean_abs: np.ndarray, w: np.ndarray, g: int, bits: int, rule: str = "signed"
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
            q, sc = quant_int4_group(ws, g, rule)
            deq = dequant_int4(q, sc, g)
        else:
            q, sc = quant_int8_channel(ws)
            deq = q.astype(np.float32) * sc
        err = float(np.mean(((x / s) @ deq - ref) ** 2))
        if best_err is None or err < best_err:
            best, best_err, best_alpha = s, err, alpha
    return best, best_alpha


def _sampler(seed: int, index: int) -> np.random.Generator:
    # One generator per tensor (by its position among the wanted names), so the rows a tensor keeps do
    # not depend on the order tensors are computed in: whole-graph and layer-wise capture agree.
    return np.random.default_rng([seed, index])


class _Stats:
    """Running mean |x| per last-axis channel and sampled rows of one tensor, one sample at a time."""

    def __init__(self, rng: np.random.Generator, per_feed: int) -> None:
        self.rng, self.per_feed = rng, per_feed
        self.sum: np.ndarray | float = 0
        self.count = 0
        self.rows: list[np.ndarray] = []

    def add(self, a: np.ndarray) -> None:
        a = a.reshape(-1, a.shape[-1]).astype(np.float32)
        self.sum = self.sum + np.abs(a).sum(axis=0)
        self.count += a.shape[0]
        take = min(a.shape[0], self.per_feed)
        self.rows.append(a[self.rng.choice(a.shape[0], take, replace=False)])

    def result(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sum / self.count, np.concatenate(self.rows)[:rows]


def collect_inputs(
    model: ir.Model, names: list[str], feeds: list[dict], rows: int = AWQ_ROWS, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each tensor name: (mean |x| per last-axis channel, up to ``rows`` sampled rows) over all feeds.

    One session on the whole graph returns every tensor at once: it holds every tensor's statistics
    until the end. :func:`layerwise_inputs` computes the same, one segment of the graph at a time.
    """
    from vlmc import ortsession

    present = {o.name for o in model.graph.outputs}
    wanted = list(dict.fromkeys(names))
    extra = [n for n in wanted if n not in present]
    sess = ortsession.from_model(model, extra_outputs=extra)  # the package's graph itself is not touched
    per_feed = max(1, rows // max(1, len(feeds)))
    stats = {n: _Stats(_sampler(seed, i), per_feed) for i, n in enumerate(wanted)}
    for feed in feeds:
        for n, a in zip(wanted, sess.run(wanted, feed)):
            stats[n].add(a)
    del sess
    return {n: stats[n].result(rows) for n in wanted}


def layerwise_inputs(
    model: ir.Model, names: list[str], feeds: list[dict], rows: int = AWQ_ROWS, seed: int = 0
):
    """:func:`collect_inputs`, one segment of the graph at a time; yields ``(name, (mean|x|, rows))``.

    The graph is cut before the first use of each wanted tensor (in topological order). Segment j runs
    on every calibration sample from the values that cross cut j-1 and returns those that cross cut j;
    the wanted tensor is among them. Only the crossing values of one cut (a decoder layer's residual
    stream, masks, rotary tables: one layer's activations) are held per sample, and values no later
    node reads are dropped; nodes after the last cut never run. Each name is yielded as soon as its
    statistics exist, so the caller can quantize its weights and let them go before the next segment.

    Graphs with control flow (subgraph attributes) fall back to one whole-graph session.
    """
    wanted = list(dict.fromkeys(names))
    graph = model.graph
    order = list(graph)
    if not wanted or any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for n in order
        for a in n.attributes.values()
    ):
        yield from collect_inputs(model, names, feeds, rows, seed).items()
        return
    first_use, last_use = segments.uses(order)
    graph_inputs = {v.name for v in graph.inputs}
    # Cuts in topological order; a graph input is known from the start (cut 0).
    cuts = sorted({0 if n in graph_inputs else first_use[n] for n in wanted})
    per_feed = max(1, rows // max(1, len(feeds)))
    index = {n: i for i, n in enumerate(wanted)}
    due: dict[int, list[str]] = {}
    for n in wanted:
        due.setdefault(0 if n in graph_inputs else first_use[n], []).append(n)
    held: dict[str, list[np.ndarray]] = {}  # crossing values per sample (graph inputs stay in feeds)

    def value_of(name: str) -> list[np.ndarray]:
        return held[name] if name in held else [f[name] for f in feeds]

    # Every segment is cloned before anything is yielded: the caller edits the graph between yields.
    pieces = segments.split(model, order, cuts, last_use)
    last_by_name = {v.name: i for v, i in last_use.items()}
    for cut, seg, out_names in pieces:
        if seg is not None:
            samples = [{v.name: value_of(v.name)[s] for v in seg.inputs} for s in range(len(feeds))]
            results = seg.run(samples)
            del samples
            for k, name in enumerate(out_names):
                held[name] = [r[k] for r in results]
            del results
            # Values no node at or after this cut reads are not needed again.
            for name in [n for n in held if last_by_name.get(n, -1) < cut]:
                del held[name]
        for name in due[cut]:
            st = _Stats(_sampler(seed, index[name]), per_feed)
            for a in value_of(name):
                st.add(a)
            yield name, st.result(rows)


# Rows of a weight read and quantized at a time: bounds the working set to a few of these blocks
# whatever the weight's size (a 32064 x 4096 lm_head is 525 MB in float32). Small enough that a
# block and its temporaries stay in the CPU cache: at LLaVA-1.5-7B widths (4096 x 11008) 4 MiB
# blocks quantize ~2x faster per core than 32 MiB ones (same numbers, block by block).
_BLOCK_BYTES = 4 << 20
# Blocks quantized at once, one per thread: numpy releases the GIL in its loops and in file reads,
# so one thread reads while another computes (results are written to disjoint rows: exact).
_THREADS = max(
    1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
)


def _row_steps(t: ir.TensorProtocol, multiple: int) -> tuple[int, int, int]:
    """(k, n, rows per block) of a [k, n] weight; the block is a multiple of ``multiple`` rows."""
    k, n = (int(d) for d in t.shape.numpy())
    return k, n, max(multiple, (_BLOCK_BYTES // max(1, 4 * n)) // multiple * multiple)


def _row_reader(t: ir.TensorProtocol):
    """A function (first row, rows) -> float32 block of a [k, n] weight, and a close function.

    A weight stored in a file as float32 is read with positioned reads (no memory map, whose pages
    would count as resident until it is closed; safe from several threads); another is sliced.
    """
    n = int(t.shape.numpy()[1])
    if isinstance(t, ir.ExternalTensor) and t.dtype == ir.DataType.FLOAT:
        fd = os.open(t.path, os.O_RDONLY)

        def read(r0: int, rows: int) -> np.ndarray:
            out = np.empty((rows, n), "<f4")
            view, pos, done = memoryview(out).cast("B"), t.offset + 4 * r0 * n, 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], pos + done)
                if got <= 0:
                    raise OSError(f"{t.path}: weight {t.name} ends early")
                done += got
            return out

        return read, functools.partial(os.close, fd)
    arr = t.numpy()  # a copy of each block: the block is quantized in place
    return (lambda r0, rows: np.array(arr[r0 : r0 + rows], dtype=np.float32)), (lambda: None)


def _each_block(t: ir.TensorProtocol, multiple: int, work) -> None:
    """``work(first row, float32 block)`` over the row blocks of ``t``, :data:`_THREADS` at a time."""
    k, _, step = _row_steps(t, multiple)
    read, close = _row_reader(t)

    def one(r0: int) -> None:
        work(r0, read(r0, min(step, k - r0)))

    try:
        starts = range(0, k, step)
        if _THREADS == 1 or len(starts) == 1:
            for r0 in starts:
                one(r0)
        else:
            with concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="vlmc-rtn") as pool:
                for f in [pool.submit(one, r0) for r0 in starts]:
                    f.result()
    finally:
        close()


def _weight_kn(t: ir.TensorProtocol, trans: bool) -> np.ndarray:
    w = np.asarray(t.numpy(), dtype=np.float32)
    return np.ascontiguousarray(w.T) if trans else w


def _int8_streamed(t: ir.TensorProtocol) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quant_int8_channel` of a [k, n] weight read in row blocks (two passes: scales, values)."""
    k, n = (int(d) for d in t.shape.numpy())
    maxima: list[np.ndarray] = []

    def amax_of(_r0: int, blk: np.ndarray) -> None:
        maxima.append(np.maximum(blk.max(axis=0), -blk.min(axis=0)))  # == |blk|.max(axis=0), exactly

    _each_block(t, 1, amax_of)
    amax = np.maximum.reduce(maxima) if len(maxima) > 1 else maxima[0]
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.empty((k, n), np.int8)

    def quantize(r0: int, blk: np.ndarray) -> None:
        np.divide(blk, scale, out=blk)
        np.rint(blk, out=blk)
        np.clip(blk, -127, 127, out=blk)
        np.copyto(q[r0 : r0 + len(blk)], blk, casting="unsafe")  # astype(int8)

    _each_block(t, 1, quantize)
    return q, scale


def _int4_rows(
    blk: np.ndarray, g: int, packed: bool, out: np.ndarray, scale_out: np.ndarray, rule: str = "signed"
) -> None:
    """:func:`quant_int4_group` (then :func:`pack_int4` if ``packed``) of a block of whole groups, into ``out``.

    The same numbers with fewer passes over memory: the scales from each group's max and min, the
    rounding and clamping happen in place, and q + 8 in int8 wraps to the bits int16 + 8 -> uint8 gives.
    """
    k, n = blk.shape
    wg = blk.reshape(k // g, g, n)
    scale = int4_scales(wg.max(axis=1), wg.min(axis=1), rule)
    np.divide(wg, scale[:, None, :], out=wg)
    np.rint(wg, out=wg)
    np.clip(wg, -8, 7, out=wg)
    scale_out[...] = scale
    if not packed:
        np.copyto(out, blk, casting="unsafe")  # astype(int8)
        return
    q = blk.astype(np.int8)
    q += 8
    u = q.view(np.uint8)
    np.left_shift(u[1::2], 4, out=out)
    out |= u[0::2]


def _int4_streamed(
    t: ir.TensorProtocol, g: int, packed: bool, rule: str = "signed"
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quant_int4_group` (and :func:`pack_int4`) of a [k, n] weight read in row blocks of whole groups."""
    k, n = (int(d) for d in t.shape.numpy())
    scale = np.empty((k // g, n), np.float32)
    out = np.empty((k // 2, n) if packed else (k, n), np.uint8 if packed else np.int8)

    def quantize(r0: int, blk: np.ndarray) -> None:
        rows = len(blk)
        dst = out[r0 // 2 : (r0 + rows) // 2] if packed else out[r0 : r0 + rows]
        _int4_rows(blk, g, packed, dst, scale[r0 // g : (r0 + rows) // g], rule)

    _each_block(t, 2 * g if packed and g % 2 else g, quantize)
    return out, scale


# Drop a weight's cached bytes or memory map once its quantized form exists; it is re-read if asked.
_release = segments.release


def quantize_weight_only(
    model: ir.Model, scheme, feeds: list[dict] | None, store=None
) -> tuple[ir.Model, dict]:
    """INT8/INT4 weight-only quantization of the IR model in place; returns it and the manifest facts.

    One weight at a time: it is read (in row blocks for RTN), quantized, and its quantized tensors
    are handed to ``store`` (a :class:`vlmc.interop.TensorStore` writes them to a scratch file at
    once, so they are not held in memory); without it they stay in memory.
    """
    bits = 4 if scheme.weights == "int4" else 8
    g = scheme.group_size if bits == 4 else None
    rule = getattr(scheme, "int4_scale", "signed")
    take, kept, skipped = candidates(model, scheme.keep_fp32, g)
    if scheme.method == "awq" and take:
        # Layer-wise: each weight is quantized as soon as its input's statistics exist, which are then
        # dropped; calibration holds one segment's activations at a time (see layerwise_inputs).
        by_input: dict[str, list] = {}
        for t in take:
            by_input.setdefault(t[0].inputs[0].name, []).append(t)
        stream = layerwise_inputs(model, list(by_input), feeds or [])
        work = ((t, stats) for name, stats in stream for t in by_input[name])
    else:
        work = ((t, None) for t in take)
    graph = model.graph
    keep_tensor = store.put if store is not None else _in_memory
    nodes_facts: dict[str, dict] = {}
    before = after = 0

    def const(arr: np.ndarray, name: str) -> ir.Value:
        v = ir.Value(name=name, const_value=keep_tensor(np.ascontiguousarray(arr), name))
        v.shape, v.dtype = v.const_value.shape, v.const_value.dtype
        graph.register_initializer(v)
        return v

    for (node, w_val, trans), stats in work:
        src = w_val.const_value
        x = node.inputs[0]
        w_name = w_val.name
        before += src.nbytes
        prefix = node.name or w_name
        new_nodes: list[ir.Node] = []
        fact: dict = {"input": x.name}

        add = functools.partial(_add, new_nodes)

        if scheme.method == "awq":
            w = _weight_kn(src, trans)
            s, alpha = awq_scales(stats[1], stats[0], w, g or 0, bits, rule)
            w = w * s[:, None]
            inv = const((1.0 / s).astype(np.float32), f"{prefix}_awq_inv_scale")
            scaled = add("Mul", [x, inv], f"{prefix}_awq_scaled_input", f"{prefix}_awq_Mul")
            node.replace_input_with(0, scaled)
            fact.update({"awq_inv_scale": inv.name, "awq_alpha": alpha})
            src_for_q = ir.tensor(w, name=w_name)
            trans_q = False
        else:
            src_for_q, trans_q = src, trans
        deq = f"{prefix}_weight_dequant"
        out_name = deq if not trans else deq + "_kn"
        if bits == 8:
            if trans_q:
                q, scale = quant_int8_channel(_weight_kn(src_for_q, True))
            else:
                q, scale = _int8_streamed(src_for_q)
            qi = const(q, f"{w_name}_int8")
            si = const(scale, f"{w_name}_scale")
            # Cast -> Mul rather than DequantizeLinear(axis=1): onnxruntime's CPU optimizer fuses
            # DequantizeLinear -> MatMul into MatMulNBits with int8 compute, which quantizes the
            # activations too and breaks parity with the FP32 reference.
            qf = add("Cast", [qi], f"{prefix}_q_float", f"{prefix}_Cast_float", to=ir.DataType.FLOAT)
            wout = add("Mul", [qf, si], out_name, f"{prefix}_Mul_scales")
            fact.update({"weight": qi.name, "scale": si.name, "axis": 1, "group_size": None})
            after += q.nbytes + scale.nbytes
        else:
            packed = scheme.int4_storage == "packed"
            if trans_q:
                qk, scale = quant_int4_group(_weight_kn(src_for_q, True), g, rule)
                q = pack_int4(qk) if packed else qk
                del qk
            else:
                q, scale = _int4_streamed(src_for_q, g, packed, rule)
            k, n = scale.shape[0] * g, scale.shape[1]
            sc = const(scale.reshape(k // g, 1, n), f"{w_name}_scale")
            fact.update({"scale": sc.name, "axis": 1, "group_size": g, "storage": scheme.int4_storage})
            grouped = f"{prefix}_q_grouped"
            shape_g = const(np.array([k // g, g, n], np.int64), f"{prefix}_group_shape")
            shape_kn = const(np.array([k, n], np.int64), f"{prefix}_weight_shape")
            if packed:
                pi = const(q, f"{w_name}_int4_packed")
                c16 = const(np.array(16, np.int32), f"{prefix}_c16")
                c8 = const(np.array(8, np.float32), f"{prefix}_c8")
                ax1 = const(np.array([1], np.int64), f"{prefix}_axis1")
                t = functools.partial("{}_{}".format, prefix)
                p32 = add("Cast", [pi], t("p32"), t("Cast_packed"), to=ir.DataType.INT32)
                hi = add("Div", [p32, c16], t("hi"), t("Div_hi"))
                hi16 = add("Mul", [hi, c16], t("hi16"), t("Mul_hi"))
                lo = add("Sub", [p32, hi16], t("lo"), t("Sub_lo"))
                lo3 = add("Unsqueeze", [lo, ax1], t("lo3"), t("Unsqueeze_lo"))
                hi3 = add("Unsqueeze", [hi, ax1], t("hi3"), t("Unsqueeze_hi"))
                pairs = add("Concat", [lo3, hi3], t("pairs"), t("Concat_nibbles"), axis=1)
                ug = add("Reshape", [pairs, shape_g], t("u_grouped"), t("Reshape_groups"))
                uf = add("Cast", [ug], t("uf"), t("Cast_float"), to=ir.DataType.FLOAT)
                gq = add("Sub", [uf, c8], grouped, t("Sub_offset"))
                fact.update(
                    {
                        "weight": pi.name,
                        "packing": "uint8 [k/2, n]: low nibble row 2i, high nibble row 2i+1, stored q+8",
                    }
                )
            else:
                qi = const(q, f"{w_name}_int4")
                q8g = add("Reshape", [qi, shape_g], f"{prefix}_q_i8g", f"{prefix}_Reshape_groups")
                gq = add("Cast", [q8g], grouped, f"{prefix}_Cast_float", to=ir.DataType.FLOAT)
                fact.update({"weight": qi.name})
            after += q.nbytes + scale.nbytes
            wg = add("Mul", [gq, sc], f"{prefix}_w_grouped", f"{prefix}_Mul_scales")
            wout = add("Reshape", [wg, shape_kn], out_name, f"{prefix}_Reshape_weight")
        if trans:  # Gemm with transB: dequantize in [k, n] and transpose back to its [n, k]
            wout = add("Transpose", [wout], deq, f"{prefix}_Transpose", perm=[1, 0])
        del q, scale
        node.replace_input_with(1, wout)
        graph.insert_before(node, new_nodes)
        graph.initializers.pop(w_name)
        _release(src)
        nodes_facts[node.name] = fact
        del stats
    gathers, gather_skipped = gather_candidates(model, scheme.keep_fp32) if scheme.embeddings else ([], {})
    skipped.update(gather_skipped)
    gather_facts: dict[str, dict] = {}
    for node, w_val in gathers:
        b, a, gather_facts[node.name] = _quantize_gather(graph, node, w_val, bits, g, rule, const)
        before, after = before + b, after + a
    rank = {t[0].name: i for i, t in enumerate(take)}  # facts in graph order, as they are quantized in RTN
    nodes_facts = dict(sorted(nodes_facts.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    mode = "int4_weight_only" if bits == 4 else "int8_weight_only"
    facts = {
        "mode": mode,
        "target": scheme.target,
        "method": scheme.method,
        "nodes_quantized": list(nodes_facts) + list(gather_facts),
        "nodes_kept_fp32": kept,
        "nodes_skipped": skipped,
        "weights": {
            "dtype": f"int{bits}",
            "symmetric": True,
            "per_channel_axis": {"MatMul": 1},
            "group_size": g,
            **({"scale_rule": rule} if bits == 4 else {}),
            "nodes": nodes_facts,
            **({"gathers": gather_facts} if gather_facts else {}),
        },
    }
    return model, {**facts, "_weight_bytes": (before, after)}


def _quantize_gather(graph, node, w_val, bits: int, g: int | None, rule: str, const) -> tuple[int, int, dict]:
    """One embedding table to INT8 (per row) or INT4 (groups of ``g`` along each row, packed in pairs).

    The lookup gathers the integer rows and their scales and dequantizes only those rows:
    ``Gather(q, ids) -> Cast -> Mul(Gather(scale, ids))`` (INT4: the packed pairs split with integer
    Div/Sub first), so no float table exists at run time. Returns (bytes before, after, facts).
    """
    w = w_val.const_value.numpy()
    ids = node.inputs[1]
    prefix = node.name or w_val.name
    new_nodes: list[ir.Node] = []
    add = functools.partial(_add, new_nodes)
    t = functools.partial("{}_{}".format, prefix)
    v, d = w.shape
    before = w.nbytes
    if bits == 8 or d % (g or 1):
        if bits == 4:  # a row that does not split into whole groups stays INT8
            bits = 8
        q, scale = quant_int8_rows(w)
        qi, si = const(q, f"{w_val.name}_int8"), const(scale, f"{w_val.name}_scale")
        rows = add("Gather", [qi, ids], t("q_rows"), t("Gather_q"), axis=0)
        srows = add("Gather", [si, ids], t("scale_rows"), t("Gather_scale"), axis=0)
        qf = add("Cast", [rows], t("q_float"), t("Cast_float"), to=ir.DataType.FLOAT)
        out = add("Mul", [qf, srows], t("rows_dequant"), t("Mul_scales"))
        fact = {"weight": qi.name, "scale": si.name, "bits": 8, "axis": 0, "scale_per": "row"}
        after = q.nbytes + scale.nbytes
    else:
        # The [k, n] group quantizer on the transposed table: groups of g along each row.
        qk, scale_kn = quant_int4_group(np.ascontiguousarray(w.T), g, rule)
        q = np.ascontiguousarray(qk.T)  # [v, d] in [-8, 7]
        scale = np.ascontiguousarray(scale_kn.T)  # [v, d/g]
        del qk, scale_kn
        u = (q.astype(np.int16) + 8).astype(np.uint8)
        packed = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)  # [v, d/2]: column 2j low, 2j+1 high
        pi, si = const(packed, f"{w_val.name}_int4_packed"), const(scale, f"{w_val.name}_scale")
        c16 = const(np.array(16, np.int32), t("c16"))
        c8 = const(np.array(8, np.float32), t("c8"))
        axis_last = const(np.array([-1], np.int64), t("axis_last"))
        zero2 = const(np.array([0, 0, d // g, g], np.int64), t("group_shape"))
        zero1 = const(np.array([0, 0, d], np.int64), t("row_shape"))
        scale_axis = const(np.array([-1], np.int64), t("scale_axis"))
        rows = add("Gather", [pi, ids], t("packed_rows"), t("Gather_packed"), axis=0)
        p32 = add("Cast", [rows], t("p32"), t("Cast_packed"), to=ir.DataType.INT32)
        hi = add("Div", [p32, c16], t("hi"), t("Div_hi"))
        lo = add("Sub", [p32, add("Mul", [hi, c16], t("hi16"), t("Mul_hi"))], t("lo"), t("Sub_lo"))
        pairs = add(
            "Concat",
            [add("Unsqueeze", [lo, axis_last], t("lo3"), t("Unsqueeze_lo")),
             add("Unsqueeze", [hi, axis_last], t("hi3"), t("Unsqueeze_hi"))],
            t("pairs"), t("Concat_nibbles"), axis=-1,
        )  # fmt: skip
        uf = add("Cast", [pairs], t("uf"), t("Cast_float"), to=ir.DataType.FLOAT)
        centered = add("Sub", [uf, c8], t("q_float"), t("Sub_offset"))
        grouped = add("Reshape", [centered, zero2], t("q_grouped"), t("Reshape_groups"))
        srows = add("Gather", [si, ids], t("scale_rows"), t("Gather_scale"), axis=0)
        s4 = add("Unsqueeze", [srows, scale_axis], t("scale_rows4"), t("Unsqueeze_scale"))
        deq = add("Mul", [grouped, s4], t("rows_grouped"), t("Mul_scales"))
        out = add("Reshape", [deq, zero1], t("rows_dequant"), t("Reshape_rows"))
        fact = {
            "weight": pi.name, "scale": si.name, "bits": 4, "axis": 0, "group_size": g,
            "packing": "uint8 [v, d/2]: low nibble column 2j, high nibble column 2j+1, stored q+8",
            "scale_rule": rule,
        }  # fmt: skip
        after = packed.nbytes + scale.nbytes
    # The lookup's output keeps its name (the graph output inputs_embeds).
    old_out = node.outputs[0]
    name = old_out.name
    graph.insert_before(node, new_nodes)
    ir.convenience.replace_all_uses_with(old_out, out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = name
    out.shape, out.type = old_out.shape, old_out.type
    graph.initializers.pop(w_val.name)
    del w  # the table's mapped bytes: released only once nothing views them
    _release(w_val.const_value)
    return before, after, fact


def _add(nodes: list[ir.Node], op: str, inputs: list[ir.Value], out: str, name: str, **attrs) -> ir.Value:
    """Append node ``name`` (``op`` on ``inputs``, one output named ``out``) to ``nodes``; its output."""
    n = ir.node(op, inputs, attrs or None, name=name, outputs=[ir.Value(name=out)])
    nodes.append(n)
    return n.outputs[0]


def _in_memory(arr: np.ndarray, name: str) -> ir.Tensor:
    return ir.tensor(arr, name=name)
