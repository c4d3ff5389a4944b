"""Fuse RMSNorm, rotary and attention into onnxruntime's contrib kernels, on the IR.

The exporters write HF's eager modules as opset-17 ops (``Pow -> ReduceMean -> Add -> Sqrt ->
Reciprocal -> Mul -> Mul(weight)`` per RMSNorm, ``x*cos + rotate_half(x)*sin`` per rotary,
``MatMul -> Mul -> Add(mask) -> Softmax -> MatMul`` per attention). onnxruntime has one kernel for
each (microsoft/onnxruntime docs/ContribOperators.md):

* ``SimplifiedLayerNormalization`` (registered in the ONNX domain) and
  ``com.microsoft.SkipSimplifiedLayerNormalization`` (the residual Add folded in; its fourth output
  is the sum, which the next residual reads);
* ``com.microsoft.RotaryEmbedding`` (half rotation, ``interleaved = 0``) with ``cos_cache`` /
  ``sin_cache`` ``(max_positions, head_dim / 2)`` gathered by ``position_ids``;
* ``com.microsoft.MultiHeadAttention`` with ``past_key`` / ``past_value`` (BNSH, the package's KV
  layout) and the graph's own additive mask as ``attention_bias``; ``present_key`` /
  ``present_value`` become the graph's ``present.{i}.*`` outputs.

Hand-written on onnx-ir rather than onnxscript's ``ort_fusions``: onnxscript is not a dependency,
its rules match the dynamo exporter's opset-18 forms (``ReduceMean`` with axes as an input, SDPA),
and its pre-pass runs ONNX shape inference and constant folding over the whole graph, which would
read every weight of a 512 M decoder into memory. Each rule below checks the structure it replaces
and leaves anything else as it is; the caller checks every fused graph numerically against the one
before it.

The rotary caches are not re-derived from a formula: the graph's own cos/sin subgraph (a function of
``position_ids`` alone) is cut out with ``onnx_ir.convenience.extract`` and run on onnxruntime for
positions ``0 .. max_positions - 1``, so any 1-D rope scaling the exporter traced is kept exactly.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from vlmc import ortsession

logger = logging.getLogger(__name__)

DOMAIN = "com.microsoft"
SOURCE = "microsoft/onnxruntime docs/ContribOperators.md"
KINDS = ("rms_norm", "rotary", "attention")
# Why grouped-query attention (fewer KV heads than query heads) keeps the graph's own attention.
GROUPED = (
    "fewer KV heads than query heads (repeat_kv): GroupQueryAttention's contract refuses a multi-token "
    "step of batch > 1 over a past, which the decoder's interface takes; MultiHeadAttention over the "
    "repeated KV ran slower than the graph's own attention (docs/ort.md)"
)


def _const(v: ir.Value | None) -> np.ndarray | None:
    """The value of a constant (initializer or Constant node output), else None."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    p = v.producer()
    if p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx") and "value" in p.attributes:
        return p.attributes["value"].value.numpy()
    return None


def _scalar(v: ir.Value | None) -> float | None:
    c = _const(v)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def _op(v: ir.Value | None, *ops: str) -> ir.Node | None:
    """The node producing ``v`` if it is one of ``ops`` in the ONNX domain, else None."""
    p = v.producer() if v is not None else None
    if p is None or p.op_type not in ops or p.domain not in ("", "ai.onnx"):
        return None
    return p


def _only_user(v: ir.Value, *ops: str) -> ir.Node | None:
    """The single node reading ``v`` (and nothing else: not a graph output) if it is one of ``ops``."""
    uses = list(v.uses())
    if len(uses) != 1 or v.is_graph_output():
        return None
    node = uses[0].node
    return node if node.op_type in ops and node.domain in ("", "ai.onnx") else None


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _rank(v: ir.Value) -> int | None:
    return len(v.shape) if v.shape is not None else None


def _replace(old: ir.Value, new: ir.Value) -> None:
    """Every use of ``old`` reads ``new``; a graph output keeps its name (the interface stays)."""
    name = old.name
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if new.is_graph_output():
        old.name = f"{name}_unfused"
        new.name = name


def _cleanup(model: ir.Model) -> None:
    common_passes.RemoveUnusedNodesPass()(model)


# ---------------------------------------------------------------------------------------------- RMSNorm


def _rms_norm_at(reduce: ir.Node) -> dict | None:
    """Match one RMSNorm around its ``ReduceMean``: its input, gamma, epsilon and output, or None."""
    rank = _rank(reduce.inputs[0])
    axes = _attr(reduce, "axes")
    if axes is None and len(reduce.inputs) > 1:
        c = _const(reduce.inputs[1])
        axes = None if c is None else [int(a) for a in c.reshape(-1)]
    if axes is None or len(axes) != 1 or _attr(reduce, "keepdims", 1) != 1:
        return None
    if axes[0] != -1 and (rank is None or axes[0] != rank - 1):
        return None
    pow_ = _op(reduce.inputs[0], "Pow")
    if pow_ is None or _scalar(pow_.inputs[1]) != 2.0:
        return None
    x = pow_.inputs[0]
    add = _only_user(reduce.outputs[0], "Add")
    if add is None:
        return None
    eps = _scalar(add.inputs[1] if add.inputs[0] is reduce.outputs[0] else add.inputs[0])
    sqrt = _only_user(add.outputs[0], "Sqrt")
    if eps is None or sqrt is None:
        return None
    nxt = _only_user(sqrt.outputs[0], "Reciprocal", "Div")
    if nxt is None:
        return None
    if nxt.op_type == "Reciprocal":
        mul = _only_user(nxt.outputs[0], "Mul")
        if mul is None or x not in mul.inputs:
            return None
        normed = mul.outputs[0]
    elif nxt.inputs[0] is x and nxt.inputs[1] is sqrt.outputs[0]:  # x / sqrt(...)
        normed = nxt.outputs[0]
    elif _scalar(nxt.inputs[0]) == 1.0:  # 1 / sqrt(...) * x
        mul = _only_user(nxt.outputs[0], "Mul")
        if mul is None or x not in mul.inputs:
            return None
        normed = mul.outputs[0]
    else:
        return None
    source = x
    cast_in = _op(x, "Cast")
    if cast_in is not None and _attr(cast_in, "to") == ir.DataType.FLOAT:
        source = cast_in.inputs[0]  # float16 input normalized in float32
    cast_out = _only_user(normed, "Cast")
    if cast_out is not None:
        normed = cast_out.outputs[0]
    gmul = _only_user(normed, "Mul")
    if gmul is None:
        return None
    gamma = gmul.inputs[1] if gmul.inputs[0] is normed else gmul.inputs[0]
    g = _const(gamma)
    if g is None or g.ndim != 1:
        return None
    if gamma.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or source.dtype not in (None, gamma.dtype):
        return None
    return {"input": source, "gamma": gamma, "epsilon": eps, "output": gmul.outputs[0], "at": gmul}


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """False only when both shapes are known and differ (a broadcasting Add is no residual)."""
    if a.shape is None or b.shape is None:
        return True
    return len(a.shape) == len(b.shape) and all(
        x == y or not (isinstance(x, int) and isinstance(y, int)) for x, y in zip(a.shape, b.shape)
    )


def fuse_rms_norms(model: ir.Model) -> dict:
    """RMSNorm -> SimplifiedLayerNormalization, with the residual Add before it -> SkipSimplifiedLayerNormalization."""
    graph = model.graph
    plain = skip = 0
    for reduce in [n for n in graph if n.op_type == "ReduceMean" and n.domain in ("", "ai.onnx")]:
        if reduce.graph is not graph:
            continue
        m = _rms_norm_at(reduce)
        if m is None:
            continue
        src, out = m["input"], m["output"]
        residual = _op(src, "Add")
        if (
            residual is not None
            and all(_const(i) is None for i in residual.inputs)
            and all(_same_shape(i, src) for i in residual.inputs)
        ):
            a, b = residual.inputs
            node = ir.node(
                "SkipSimplifiedLayerNormalization",
                [a, b, m["gamma"]],
                {"epsilon": m["epsilon"]},
                domain=DOMAIN,
                name=f"{m['at'].name}_SkipSimplifiedLayerNorm",
                num_outputs=4,
            )
            y, _mean, _inv, total = node.outputs
            y.name, total.name = f"{out.name}_fused", f"{src.name}_fused"
            y.shape, y.type = out.shape, out.type
            total.shape, total.type = src.shape, src.type
            graph.insert_after(residual, node)  # where its inputs are; the sum's readers all come later
            _replace(out, y)
            _replace(src, total)
            skip += 1
        else:
            node = ir.node(
                "SimplifiedLayerNormalization",
                [src, m["gamma"]],
                {"axis": -1, "epsilon": m["epsilon"], "stash_type": 1},
                name=f"{m['at'].name}_SimplifiedLayerNorm",
            )
            y = node.outputs[0]
            y.name, y.shape, y.type = f"{out.name}_fused", out.shape, out.type
            graph.insert_after(m["at"], node)
            _replace(out, y)
            plain += 1
    _cleanup(model)
    if skip:
        model.opset_imports.setdefault(DOMAIN, 1)
    return {
        "ops": ["SimplifiedLayerNormalization", f"{DOMAIN}.SkipSimplifiedLayerNormalization"],
        "source": SOURCE,
        "simplified": plain,
        "skip_simplified": skip,
        "fused": plain + skip,
    }


# ----------------------------------------------------------------------------------------------- rotary


def _rotate_half(v: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """``Concat(Neg(x[..., h:]), x[..., :h], axis=-1)`` -> x (and the nodes), else None."""
    cat = _op(v, "Concat")
    if cat is None or len(cat.inputs) != 2:
        return None
    rank = _rank(v)
    axis = _attr(cat, "axis")
    if axis != -1 and (rank is None or axis != rank - 1):
        return None
    neg = _op(cat.inputs[0], "Neg")
    second = _op(neg.inputs[0], "Slice") if neg is not None else None
    first = _op(cat.inputs[1], "Slice")
    if second is None or first is None or second.inputs[0] is not first.inputs[0]:
        return None
    x = first.inputs[0]
    half = None if x.shape is None or not isinstance(x.shape[-1], int) else x.shape[-1] // 2
    # The halves, where the exporter left the bounds constant (else the numeric check decides).
    for node, start in ((first, 0), (second, half)):
        s = _const(node.inputs[1])
        if s is not None and half is not None and int(s.reshape(-1)[0]) != start:
            return None
    return x, [cat, neg, second, first]


def _rotary_at(add: ir.Node) -> dict | None:
    """``x*cos + rotate_half(x)*sin`` at an Add: x, cos, sin, or None."""
    muls = [_op(i, "Mul") for i in add.inputs]
    if None in muls:
        return None
    for m_cos, m_sin in (muls, muls[::-1]):
        for rot, sin in ((m_sin.inputs[0], m_sin.inputs[1]), (m_sin.inputs[1], m_sin.inputs[0])):
            found = _rotate_half(rot)
            if found is None:
                continue
            x = found[0]
            if x not in m_cos.inputs:
                continue
            cos = m_cos.inputs[1] if m_cos.inputs[0] is x else m_cos.inputs[0]
            if _rank(x) not in (None, 4):
                return None
            return {"x": x, "cos": cos, "sin": sin, "out": add.outputs[0]}
    return None


def rotary_caches(model: ir.Model, cos: ir.Value, sin: ir.Value, position_ids: ir.Value, positions: int):
    """cos/sin caches ``(positions, head_dim / 2)`` from the graph's own cos/sin subgraph, or a reason string."""
    try:
        sub = ir.convenience.extract(model.graph, [position_ids], [cos, sin])
    except Exception as exc:  # the subgraph reads more than position_ids
        return f"its cos/sin are not a function of {position_ids.name} alone ({type(exc).__name__})"
    # The cut has its own values (extract copies): the positions axis is made free, and the inferred
    # shapes of the graph's sample length are dropped so onnxruntime does not hold the cut to them.
    sub.inputs[0].shape = ir.Shape([1, "positions"])
    for node in sub:
        for v in node.outputs:
            v.shape = None
    sub_model = ir.Model(sub, ir_version=model.ir_version)
    feed = {sub.inputs[0].name: np.arange(positions, dtype=np.int64)[None, :]}
    try:
        c, s = ortsession.from_model(sub_model).run(None, feed)
    except Exception as exc:  # onnxruntime's own error types
        return f"its cos/sin subgraph does not run alone ({str(exc).splitlines()[0][:120]})"
    c, s = np.asarray(c), np.asarray(s)
    if c.ndim < 2 or c.shape[-2] != positions:
        return f"cos/sin of shape {list(c.shape)} is not one row per position"
    c = c.reshape(-1, positions, c.shape[-1])[0]
    s = s.reshape(-1, positions, s.shape[-1])[0]
    h = c.shape[-1] // 2
    if not (np.array_equal(c[:, :h], c[:, h:]) and np.array_equal(s[:, :h], s[:, h:])):
        return "cos/sin halves differ (not the half-rotation form)"
    return np.ascontiguousarray(c[:, :h]), np.ascontiguousarray(s[:, :h])


def fuse_rotary(model: ir.Model, positions: int, position_input: str = "position_ids") -> dict:
    """``x*cos + rotate_half(x)*sin`` on ``[batch, heads, seq, head_dim]`` -> com.microsoft.RotaryEmbedding."""
    graph = model.graph
    out = {"op": f"{DOMAIN}.RotaryEmbedding", "source": SOURCE, "fused": 0, "max_positions": positions}
    pos = next((v for v in graph.inputs if v.name == position_input), None)
    if pos is None or pos.dtype != ir.DataType.INT64 or _rank(pos) != 2:
        out["skipped"] = f"no int64 [batch, sequence] {position_input} input (a 1-D rope reads one)"
        return out
    caches: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}
    matches = [m for n in list(graph) if n.op_type == "Add" and (m := _rotary_at(n)) is not None]
    for m in matches:
        key = (id(m["cos"]), id(m["sin"]))
        if key not in caches:
            made = rotary_caches(model, m["cos"], m["sin"], pos, positions)
            if isinstance(made, str):
                out["skipped"] = made
                return out
            width = m["x"].shape[-1] if m["x"].shape is not None else None
            if isinstance(width, int) and made[0].shape[-1] * 2 != width:
                out["skipped"] = "partial rotary (the cache is narrower than the head)"
                return out
            vals = []
            for arr, kind in zip(made, ("cos", "sin")):
                arr = arr.astype(m["x"].dtype.numpy() if m["x"].dtype is not None else np.float32)
                name = f"rotary_{kind}_cache_{len(caches)}"
                v = ir.Value(name=name, const_value=ir.tensor(arr, name=name), shape=ir.Shape(arr.shape))
                v.type = ir.TensorType(ir.DataType.from_numpy(arr.dtype))
                graph.register_initializer(v)
                vals.append(v)
            caches[key] = (vals[0], vals[1])
    for m in matches:
        cos_cache, sin_cache = caches[(id(m["cos"]), id(m["sin"]))]
        node = ir.node(
            "RotaryEmbedding",
            [m["x"], pos, cos_cache, sin_cache],
            {"interleaved": 0},
            domain=DOMAIN,
            name=f"{m['out'].producer().name}_RotaryEmbedding",
        )
        y = node.outputs[0]
        y.name, y.shape, y.type = f"{m['out'].name}_fused", m["out"].shape, m["out"].type
        graph.insert_after(m["out"].producer(), node)
        _replace(m["out"], y)
        out["fused"] += 1
    _cleanup(model)
    if out["fused"]:
        model.opset_imports.setdefault(DOMAIN, 1)
    return out


# -------------------------------------------------------------------------------------------- attention


def _heads_of(x4: ir.Value | None) -> ir.Value | None:
    """``Transpose(Reshape(x3, [b, s, heads, head_dim]), [0, 2, 1, 3])`` -> x3, else None."""
    tr = _op(x4, "Transpose")
    if tr is None or list(_attr(tr, "perm", [])) != [0, 2, 1, 3]:
        return None
    rs = _op(tr.inputs[0], "Reshape")
    if rs is None or _rank(rs.inputs[0]) not in (None, 3):
        return None
    return rs.inputs[0]


def _width(x3: ir.Value) -> int | None:
    """The last axis of a projection's output: its weight's columns (MatMul) or ``N`` (MatMulNBits)."""
    if x3.shape is not None and isinstance(x3.shape[-1], int):
        return x3.shape[-1]
    p = x3.producer()
    if p is None:
        return None
    if p.op_type == "MatMulNBits" and p.domain == DOMAIN:
        return int(_attr(p, "N"))
    if p.op_type == "MatMul":
        w = p.inputs[1]
        if w.shape is not None and isinstance(w.shape[-1], int):
            return w.shape[-1]
    if p.op_type == "Add":  # a projection with a bias
        for i in p.inputs:
            if _op(i, "MatMul") is not None or (
                i.producer() is not None and i.producer().op_type == "MatMulNBits"
            ):
                return _width(i)
    return None


def _through_identity(v: ir.Value) -> ir.Value:
    """``v`` before any one-input Concat / Identity."""
    while True:
        p = _op(v, "Concat", "Identity")
        if p is None or len(p.inputs) != 1:
            return v
        v = p.inputs[0]


def _unrepeat_kv(v: ir.Value) -> ir.Value | None:
    """The KV under HF's repeat_kv (``Reshape(Expand(Unsqueeze(kv, 2)))``, each KV head repeated for its
    group of query heads), else None."""
    rs = _op(v, "Reshape")
    ex = _op(rs.inputs[0], "Expand") if rs is not None else None
    un = _op(ex.inputs[0], "Unsqueeze") if ex is not None else None
    if un is None:
        return None
    axes = _attr(un, "axes")
    if axes is None and len(un.inputs) > 1:
        c = _const(un.inputs[1])
        axes = None if c is None else [int(a) for a in c.reshape(-1)]
    return un.inputs[0] if axes is not None and list(axes) == [2] else None


def _attention_at(softmax: ir.Node) -> dict | None:
    if _attr(softmax, "axis", -1) not in (-1, 3):
        return None
    scores = softmax.inputs[0]
    bias = None
    add = _op(scores, "Add")
    if add is not None:
        scores, bias = add.inputs
        if _op(scores, "Mul", "Div", "MatMul") is None:
            scores, bias = bias, scores
    scale_node = _op(scores, "Mul", "Div")
    scale = None
    if scale_node is not None:
        a, b = scale_node.inputs
        c = _scalar(b) if _scalar(b) is not None else (_scalar(a) if scale_node.op_type == "Mul" else None)
        if c is None or c == 0:
            return None
        scale = c if scale_node.op_type == "Mul" else 1.0 / c
        scores = a if _scalar(b) is not None else b
    qk = _op(scores, "MatMul")
    if qk is None:
        return None
    q4, kt = qk.inputs
    kt_node = _op(kt, "Transpose")
    if kt_node is None or list(_attr(kt_node, "perm", [])) != [0, 1, 3, 2]:
        return None
    k_all = kt_node.inputs[0]
    probs = softmax.outputs[0]
    while (cast := _only_user(probs, "Cast")) is not None and _attr(cast, "to") == ir.DataType.FLOAT:
        probs = cast.outputs[0]  # softmax(dtype=float32).to(query.dtype) on a float32 graph
    pv = _only_user(probs, "MatMul")
    if pv is None or pv.inputs[0] is not probs:
        return None
    v_all = pv.inputs[1]
    back = _only_user(pv.outputs[0], "Transpose")
    if back is None or list(_attr(back, "perm", [])) != [0, 2, 1, 3]:
        return None
    merge = _only_user(back.outputs[0], "Reshape")
    if merge is None or _rank(merge.outputs[0]) not in (None, 3):
        return None
    if _unrepeat_kv(k_all) is not None or _unrepeat_kv(v_all) is not None:
        return {"kept": GROUPED}
    cats = [_op(k_all, "Concat"), _op(v_all, "Concat")]
    if None in cats or any(_attr(c, "axis") not in (2, -2) or len(c.inputs) != 2 for c in cats):
        return None
    (past_k, k_new4), (past_v, v_new4) = cats[0].inputs, cats[1].inputs
    if not (k_all.is_graph_output() and v_all.is_graph_output()):
        return None
    # The cache the exporter traced may pass the past through a one-input Concat first.
    past_k, past_v = _through_identity(past_k), _through_identity(past_v)
    shape = past_k.shape
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
        return None
    return {
        "q4": q4, "k_new4": k_new4, "v_new4": v_new4, "past_k": past_k, "past_v": past_v,
        "bias": bias, "scale": scale, "present_k": k_all, "present_v": v_all,
        "out": merge.outputs[0], "at": merge, "kv_heads": shape[1], "head_dim": shape[3],
    }  # fmt: skip


def _const_node(graph: ir.Graph, at: ir.Node, arr: np.ndarray, name: str) -> ir.Value:
    node = ir.node("Constant", [], {"value": ir.tensor(arr, name=name)}, name=name)
    graph.insert_before(at, node)
    node.outputs[0].name = name
    return node.outputs[0]


def _unfused_rotary_input(x4: ir.Value) -> ir.Value | None:
    """The BNSH input of an unfused ``x*cos + rotate_half(x)*sin`` producing ``x4`` (M-RoPE: its cos/sin are
    gathered per section from ``[3, batch, seq]`` positions, which RotaryEmbedding does not take), else None."""
    add = _op(x4, "Add")
    m = _rotary_at(add) if add is not None else None
    return m["x"] if m is not None else None


def _projection(x4: ir.Value) -> ir.Value | None:
    """The 3-D projection under the BNSH ``x4``: through a rotary (fused or not, partial or whole), per-head
    norms (Qwen3's and Gemma3's q/k norms, fused or not, before or after the head Transpose), the head
    Transpose and the head Reshape; else None. It gives the width (the head count); the fused graph
    reads ``x4`` itself (:func:`_to_3d`), so whatever computed ``x4`` is kept as it is."""
    v, transposed = x4, False
    for _ in range(16):
        p = v.producer()
        if p is None:
            return None
        if p.domain == DOMAIN and p.op_type == "RotaryEmbedding":
            v = p.inputs[0]
        elif p.op_type == "SimplifiedLayerNormalization" and p.domain in ("", "ai.onnx"):
            v = p.inputs[0]
        elif (inner := _unfused_rotary_input(v)) is not None:
            v = inner
        elif (norm := _rms_norm_output_of(v)) is not None:
            v = norm
        elif (
            p.op_type == "Concat"
            and p.domain in ("", "ai.onnx")
            and len(p.inputs) == 2
            and _attr(p, "axis") in (-1, 3)
            and _op(p.inputs[1], "Slice") is not None
        ):  # partial rotary (GLM-4V): Concat(rotary(x[..., :r]), x[..., r:]); follow the pass-through x
            v = p.inputs[1].producer().inputs[0]
        elif p.op_type == "Transpose" and p.domain in ("", "ai.onnx") and not transposed:
            if list(_attr(p, "perm", [])) != [0, 2, 1, 3]:
                return None
            v, transposed = p.inputs[0], True
        elif p.op_type == "Reshape" and p.domain in ("", "ai.onnx") and transposed:
            return p.inputs[0] if _rank(p.inputs[0]) in (None, 3) else None
        else:
            return None
    return None


def _rms_norm_output_of(v: ir.Value) -> ir.Value | None:
    """The input of the unfused RMSNorm whose output is ``v`` (the norm fusion off), else None."""
    mul = _op(v, "Mul")
    if mul is None:
        return None
    for i in mul.inputs:
        for node in _producers(i, 6):
            if node.op_type == "ReduceMean" and node.domain in ("", "ai.onnx"):
                m = _rms_norm_at(node)
                if m is not None and m["output"] is v:
                    return m["input"]
    return None


def _producers(v: ir.Value, depth: int):
    """The nodes up to ``depth`` steps above ``v``."""
    seen, frontier = [], [v]
    for _ in range(depth):
        nxt = []
        for x in frontier:
            p = x.producer() if x is not None else None
            if p is not None and p not in seen:
                seen.append(p)
                nxt.extend(p.inputs)
        frontier = nxt
    return seen


def _to_3d(
    graph: ir.Graph, x4: ir.Value, at: ir.Node, heads: int, head_dim: int, name: str
) -> ir.Value | None:
    """A [batch, seq, heads*head_dim] form of the BNSH ``x4``: the projection before it where the path is
    Reshape+Transpose, the rotary applied to that projection where a RotaryEmbedding sits between, and
    else ``Reshape(Transpose(x4))`` (a copy, numerically exact: after a rotary left unfused or a per-head
    norm)."""
    direct = _heads_of(x4)
    if direct is not None:
        return direct
    rot = x4.producer()
    if rot is not None and rot.op_type == "RotaryEmbedding" and rot.domain == DOMAIN:
        x3 = _heads_of(rot.inputs[0])
        if x3 is not None:
            node = ir.node(
                "RotaryEmbedding",
                [x3, *rot.inputs[1:]],
                {"interleaved": 0, "num_heads": heads, "rotary_embedding_dim": head_dim},
                domain=DOMAIN,
                name=f"{rot.name}_bsd",
            )
            y = node.outputs[0]
            y.name, y.type = f"{name}_rotary_bsd", x4.type
            graph.insert_before(at, node)
            return y
    if _projection(x4) is None:
        return None
    tr = ir.node("Transpose", [x4], {"perm": [0, 2, 1, 3]}, name=f"{name}_bsnh")
    graph.insert_before(at, tr)
    shape = _const_node(graph, at, np.array([0, 0, heads * head_dim], np.int64), f"{name}_bsd_shape")
    rs = ir.node("Reshape", [tr.outputs[0], shape], name=f"{name}_bsd")
    graph.insert_before(at, rs)
    y = rs.outputs[0]
    y.name, y.type = f"{name}_bsd", x4.type
    return y


def fuse_attention(model: ir.Model) -> dict:
    """Eager attention over the contiguous KV (Concat(past, new) on axis 2) -> com.microsoft.MultiHeadAttention.

    MultiHeadAttention takes the new key/value and the past, and its present_key/present_value become
    the graph's ``present.{i}.*``. Grouped-query attention (fewer KV heads, HF's repeat_kv after the
    cache Concat) is kept, for the reasons in :data:`GROUPED`.
    """
    graph = model.graph
    out: dict = {
        "op": f"{DOMAIN}.MultiHeadAttention",
        "source": SOURCE,
        "fused": 0,
        "kept": {},
    }
    for softmax in [n for n in graph if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]:
        m = _attention_at(softmax)
        if m is None:
            continue
        if "kept" in m:
            out["kept"][softmax.name] = m["kept"]
            continue
        q, k, v = (_projection(m[key]) for key in ("q4", "k_new4", "v_new4"))
        if q is None or k is None or v is None:
            out["kept"][softmax.name] = "its query/key/value are not Reshape+Transpose of a projection"
            continue
        head_dim, kv_heads = m["head_dim"], m["kv_heads"]
        widths = [_width(t) for t in (q, k, v)]
        heads = kv_heads
        if widths != [kv_heads * head_dim] * 3:
            out["kept"][softmax.name] = (
                f"projection widths {widths} are not {kv_heads} heads x {head_dim} each (MultiHeadAttention "
                "needs as many query heads as KV heads)"
            )
            continue
        at = m["at"]
        q3 = _to_3d(graph, m["q4"], at, heads, head_dim, f"{softmax.name}_q")
        k3 = _to_3d(graph, m["k_new4"], at, kv_heads, head_dim, f"{softmax.name}_k")
        v3 = _to_3d(graph, m["v_new4"], at, kv_heads, head_dim, f"{softmax.name}_v")
        if q3 is None or k3 is None or v3 is None:
            out["kept"][softmax.name] = (
                "its query/key/value are not projections (with rotary) of the hidden state"
            )
            continue
        # no scale in the graph: scores are used as they are
        scale = float(m["scale"]) if m["scale"] is not None else 1.0
        inputs = [q3, k3, v3, None, None, m["bias"], m["past_k"], m["past_v"]]
        node = ir.node(
            "MultiHeadAttention",
            inputs,
            {"num_heads": heads, "scale": scale},
            domain=DOMAIN,
            name=f"{softmax.name}_MultiHeadAttention",
            num_outputs=3,
        )
        o, pk, pv = node.outputs
        o.name, o.shape, o.type = f"{m['out'].name}_fused", m["out"].shape, m["out"].type
        pk.name, pk.shape, pk.type = f"{m['present_k'].name}_fused", m["present_k"].shape, m["present_k"].type
        pv.name, pv.shape, pv.type = f"{m['present_v'].name}_fused", m["present_v"].shape, m["present_v"].type
        graph.insert_before(at, node)
        _replace(m["out"], o)
        _replace(m["present_k"], pk)
        _replace(m["present_v"], pv)
        out["fused"] += 1
    _cleanup(model)
    if out["fused"]:
        model.opset_imports.setdefault(DOMAIN, 1)
    return out
