"""The reference device: numpy references of the Ascend ops vlmc emits, and lowered graphs run with them.

The lowered graph is what ATC reads, so onnxruntime cannot load it whole (Ascend ops, int8 MatMul).
The executor partitions it: every standard ONNX op runs on onnxruntime, in as few segments as the
graph's dependencies allow, and only the Ascend ops (AscendQuant, AscendDequant, AscendAntiQuant,
NPUWeightQuantBatchMatmulV2) run in the numpy kernels here, between the segments. An int8 MatMul/Conv
(the AMCT deploy form: int8 operands, int32 accumulator) runs as onnxruntime's MatMulInteger/ConvInteger,
which accumulate exactly in int32.

Numerics follow docs/atc-facts.md ("Quantized models"): AscendQuant computes in fp16 on 910B and rounds ties to even;
AscendDequant and the antiquant ops produce fp16 on 910B. With ``fp16=True`` (the default) these
roundings are emulated; results are returned as float32 so downstream fp32 ops keep their dtypes.

The executor models what the NPU computes, not what vlmc meant: an AscendQuant offset is not
corrected by the lowered graph (AMCT's deploy form leaves the bias as round(b/(s_w*s_x))); GE's quant
fusion corrects it when it fuses AscendQuant into the int8 op (hicann/ge graph_metadef/register/
graph_optimizer/graph_fusion/fusion_quant_util_impl.cc, SetQuantScaleAndOffset ->
QuantBiasOptimization). :func:`run` applies that correction, ``-offset * sum(w)`` per output channel,
the way GE does, so a graph that also folded it into its bias shows the double correction.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from vlmc import ascend_limits, graphs, interop, ortsession, paths
from vlmc.errors import VlmcError
from vlmc.runtime.paged import write_rows

logger = logging.getLogger(__name__)

# NPUWeightQuantBatchMatmulV2 dequantizes as (weight + antiquant_offset) * antiquant_scale
# (hicann/ops-nn matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md), so a zero
# point z is passed as offset -z. The lowering rules and this module both read this constant.
ANTIQUANT_OFFSET_SIGN = 1.0

INT8_MIN, INT8_MAX = -128, 127


def _f16(a: np.ndarray | float) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16)


def pack_deq_scale(values: np.ndarray) -> np.ndarray:
    """fp32 values -> the UINT64 AscendDequant deq_scale (value bits in 31..0, shift/offset bits 0)."""
    return np.asarray(values, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)


def unpack_deq_scale(deq: np.ndarray) -> np.ndarray:
    """The fp32 scales packed in a UINT64 deq_scale."""
    return (np.asarray(deq, dtype=np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)


def ascend_quant(x: np.ndarray, scale: float, offset: float, fp16: bool = True) -> np.ndarray:
    """AscendQuant: ``clip(rint(x*scale + offset), -128, 127)`` as int8 (scale is 1/s)."""
    if fp16:
        with np.errstate(over="ignore"):
            y = _f16(x) * _f16(scale) + _f16(offset)
    else:
        y = np.asarray(x, dtype=np.float32) * np.float32(scale) + np.float32(offset)
    return np.clip(np.rint(y.astype(np.float32)), INT8_MIN, INT8_MAX).astype(np.int8)


def ascend_dequant(
    acc: np.ndarray, deq_scale: np.ndarray, fp16: bool = True, channel_axis: int | None = None
) -> np.ndarray:
    """AscendDequant: int32 accumulator times the unpacked scale (per tensor or per channel)."""
    s = unpack_deq_scale(deq_scale)
    acc = np.asarray(acc)
    if s.size > 1:
        axis = channel_axis if channel_axis is not None else acc.ndim - 1
        shape = [1] * acc.ndim
        shape[axis] = s.size
        s = s.reshape(shape)
    y = acc.astype(np.float32) * s
    return y.astype(np.float16).astype(np.float32) if fp16 else y


def ascend_antiquant(x: np.ndarray, scale: float, offset: float, fp16: bool = True) -> np.ndarray:
    """AscendAntiQuant: ``(x - offset) * scale``."""
    y = (np.asarray(x, dtype=np.float32) - np.float32(offset)) * np.float32(scale)
    return y.astype(np.float16).astype(np.float32) if fp16 else y


def dequant_weight(
    weight: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, group_size: int
) -> np.ndarray:
    """The float (k, n) weight NPUWeightQuantBatchMatmulV2 computes with.

    Raises:
        ValueError: a group size or parameter the op proto refuses (hicann/ops-nn
            weight_quant_batch_matmul_v2_proto.h): the NPU would not run it, so neither does this.
    """
    w = weight.astype(np.float32)
    k = w.shape[0]
    if group_size and not ascend_limits.group_size_ok(group_size, k):
        raise ValueError(
            f"antiquant_group_size {group_size} is not 0 or a multiple of 32 at most k-1={k - 1}"
        )
    if np.asarray(scale).dtype not in (np.float16,):
        raise ValueError(
            f"antiquant_scale is {np.asarray(scale).dtype}; the op takes the type of x (float16)"
        )
    scale = np.asarray(scale, dtype=np.float32)
    off = np.zeros_like(scale) if offset is None else np.asarray(offset, dtype=np.float32)
    if group_size:
        if scale.ndim != 2 or scale.shape[0] != -(-k // group_size):
            raise ValueError(f"antiquant_scale {scale.shape} is not (ceil(k/{group_size}), n) for k={k}")
        scale = np.repeat(scale, group_size, axis=0)[:k]
        off = np.repeat(off, group_size, axis=0)[:k]
    return (w + ANTIQUANT_OFFSET_SIGN * off) * scale


def weight_quant_batch_matmul(
    x: np.ndarray,
    weight: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray | None,
    group_size: int = 0,
    bias: np.ndarray | None = None,
    fp16: bool = True,
) -> np.ndarray:
    """NPUWeightQuantBatchMatmulV2: ``x @ antiquant(weight)`` (+ bias), weight laid out (k, n)."""
    w = dequant_weight(weight, scale, offset, group_size)
    if fp16:
        y = np.matmul(_f16(x).astype(np.float32), w.astype(np.float16).astype(np.float32))
    else:
        y = np.matmul(np.asarray(x, dtype=np.float32), w)
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(np.float16).astype(np.float32) if fp16 else y.astype(np.float32)


def _attr(attrs: dict, name: str, default=None):
    value = attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


def _quant(fp16: bool, x, scale=None, offset=None, **attrs):
    scale = attrs.get("scale", scale)
    offset = attrs.get("offset", offset)
    dst_type = _attr(attrs, "dst_type")
    if dst_type not in (None, "INT8"):
        raise VlmcError(f"AscendQuant dst_type {dst_type!r} is not emulated")
    return ascend_quant(x, scale, offset or 0.0, fp16)


def _dequant(fp16: bool, x, deq_scale, **attrs):
    axis = 1 if x.ndim == 4 else None  # Conv outputs are NCHW; MatMul outputs have channels last
    return ascend_dequant(x, deq_scale, fp16, axis)


def _antiquant(fp16: bool, x, scale=None, offset=None, **attrs):
    return ascend_antiquant(x, attrs.get("scale", scale), attrs.get("offset", offset) or 0.0, fp16)


def _weight_quant_matmul(
    fp16: bool,
    x,
    weight,
    antiquant_scale,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    **attrs,
):
    if attrs.get("transpose_x") or attrs.get("transpose_weight"):
        raise VlmcError("NPUWeightQuantBatchMatmulV2 transposes must be off")
    group = attrs.get("antiquant_group_size") or 0
    try:
        return weight_quant_batch_matmul(x, weight, antiquant_scale, antiquant_offset, group, bias, fp16)
    except ValueError as exc:  # a parameter the op proto refuses: the NPU would not run it either
        raise VlmcError(f"NPUWeightQuantBatchMatmulV2: {exc}") from None


# The Ascend ops of a lowered graph (default domain, no ONNX schema): kernel(fp16, *inputs, **attributes).
KERNELS = {
    "AscendQuant": _quant,
    "AscendDequant": _dequant,
    "AscendAntiQuant": _antiquant,
    "NPUWeightQuantBatchMatmulV2": _weight_quant_matmul,
}


def ge_offset_correction(model: ir.Model | onnx.ModelProto) -> tuple[ir.Model, int]:
    """A copy of ``model`` with GE's AscendQuant offset correction made explicit; and how many ops it touched.

    For every int8 MatMul/Conv fed by an AscendQuant with a non-zero offset, GE's quant fusion adds
    ``-offset * sum(w)`` (over k, per output channel) to the int32 accumulator. Here that is an Add
    of the int32 correction right after the op. The copy shares the model's weights (nothing is read
    but the int8 weights corrected).
    """
    out = _as_ir(model).clone()
    g = out.graph
    touched = 0
    for node in list(g):
        if node.op_type not in ("MatMul", "Conv") or len(node.inputs) < 2:
            continue
        weight = node.inputs[1]
        if weight is None or not weight.is_initializer() or weight.const_value is None:
            continue
        q = node.inputs[0].producer()
        if q is None or q.op_type != "AscendQuant":
            continue
        offset = q.attributes["offset"].value if "offset" in q.attributes else 0.0
        if not offset or weight.const_value.dtype != ir.DataType.INT8:
            continue
        w = weight.const_value.numpy()
        if node.op_type == "MatMul":
            corr = (-round(offset) * w.astype(np.int64).sum(axis=0)).astype(np.int32)  # (n,)
        else:
            cout = w.shape[0]
            corr = (-round(offset) * w.astype(np.int64).reshape(cout, -1).sum(axis=1)).astype(np.int32)
            corr = corr.reshape(1, cout, *([1] * (w.ndim - 2)))
        acc = node.outputs[0]
        cname = f"{acc.name}__ge_offset"
        correction = ir.Value(name=cname, const_value=ir.tensor(corr, name=cname))
        g.register_initializer(correction)
        corrected = ir.Value(name=acc.name, type=acc.type, shape=acc.shape)
        acc.replace_all_uses_with(corrected, replace_graph_outputs=True)
        acc.name = f"{corrected.name}__before_ge_offset"
        g.insert_after(
            node, ir.node("Add", [acc, correction], outputs=[corrected], name=f"{node.name}__ge_offset")
        )
        touched += 1
    return out, touched


def _as_ir(model: ir.Model | onnx.ModelProto) -> ir.Model:
    # Tests and tools may hand in a ModelProto they built; the executor itself works on the IR.
    return interop.from_proto(model) if isinstance(model, onnx.ModelProto) else model


def _is_standard(node: ir.Node) -> bool:
    return node.op_type not in KERNELS and onnx.defs.has(node.op_type, node.domain)


def _is_int8_op(node: ir.Node) -> bool:
    """An int8 MatMul/Conv of the deploy form: an int8 weight, or an operand from AscendQuant."""
    if node.op_type not in ("MatMul", "Conv") or len(node.inputs) < 2:
        return False
    first = node.inputs[0].producer() if node.inputs[0] is not None else None
    weight = node.inputs[1]
    return (first is not None and first.op_type == "AscendQuant") or (
        weight is not None and weight.dtype == ir.DataType.INT8
    )


def _uses(node: ir.Node, graph: ir.Graph) -> list[ir.Value]:
    """The node's inputs, and the values of ``graph`` its subgraphs (If/Loop/Scan bodies) read."""
    used = [i for i in node.inputs if i is not None]
    for attr in node.attributes.values():
        bodies = (
            [attr.value]
            if attr.type == ir.AttributeType.GRAPH
            else attr.value
            if attr.type == ir.AttributeType.GRAPHS
            else []
        )
        for body in bodies:
            for inner in ir.traversal.RecursiveGraphIterator(body):
                used += [i for i in inner.inputs if i is not None and i.graph is graph]
    return used


class _Segment:
    """Consecutive standard ops of one stage, run as one onnxruntime session (built at the first run,
    when the dtypes of the values the Ascend kernels produced are known)."""

    def __init__(
        self,
        graph: ir.Graph,
        nodes: list[ir.Node],
        inputs: list[ir.Value],
        outputs: list[ir.Value],
        ir_version: int,
    ) -> None:
        self.graph, self.nodes = graph, nodes
        self.ir_version = ir_version
        self.inputs = [v.name for v in inputs]
        self.outputs = [v.name for v in outputs]
        self._in_values, self._out_values = inputs, outputs
        self._session = None

    def run(self, env: dict[str, np.ndarray]) -> None:
        feeds = {n: env[n] for n in self.inputs}
        if self._session is None:
            self._session = ortsession.from_model(self._model(feeds))
        env.update(zip(self.outputs, self._session.run(self.outputs, feeds)))

    def _model(self, feeds: dict[str, np.ndarray]) -> ir.Model:
        sub = ir.convenience.extract(self.graph, inputs=self._in_values, outputs=self._out_values)
        original = {v.name for v in self.graph.inputs}
        for v in sub.inputs:
            v.dtype = ir.DataType.from_numpy(feeds[v.name].dtype)
            if v.name not in original:
                v.shape = None  # an Ascend kernel's output: its recorded shape (if any) is not needed
        for node in list(sub):
            for o in node.outputs:
                o.type, o.shape = None, None  # onnxruntime infers them (the int32 accumulators too)
            if _is_int8_op(node):
                _to_integer_op(sub, node)
        return ir.Model(sub, ir_version=self.ir_version)


def _to_integer_op(graph: ir.Graph, node: ir.Node) -> None:
    """int8 MatMul -> MatMulInteger, int8 Conv -> ConvInteger (+ its int32 bias): exact int32 sums."""
    if node.op_type == "MatMul":
        nodes = [ir.node("MatMulInteger", node.inputs[:2], name=node.name)]
    else:
        attrs = {k: a.value for k, a in node.attributes.items()}
        nodes = [ir.node("ConvInteger", node.inputs[:2], attributes=attrs, name=node.name)]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            rank = len(node.inputs[1].shape)
            shape = ir.Value(
                name=f"{node.name}/bias_shape",
                const_value=ir.tensor(np.array([1, -1] + [1] * (rank - 2), dtype=np.int64)),
            )
            graph.register_initializer(shape)
            reshape = ir.node("Reshape", [node.inputs[2], shape], name=f"{node.name}/bias")
            nodes += [
                reshape,
                ir.node("Add", [nodes[0].outputs[0], reshape.outputs[0]], name=f"{node.name}/add"),
            ]
    ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, node.outputs, nodes[-1].outputs)


def _stages(graph: ir.Graph, ir_version: int) -> list[tuple[str, object]]:
    """The graph as alternating stages: ("ort", _Segment) and ("ascend", [nodes]).

    A standard op's stage is the latest of its producers' (one later after an Ascend op); an Ascend op
    runs in the stage of its latest producer, after that stage's segment. So each segment is as large
    as the dependencies allow and the graph crosses between onnxruntime and numpy fewest times.
    """
    level: dict[ir.Node, int] = {}
    for node in graph:
        lv = 0
        for v in _uses(node, graph):
            p = v.producer()
            if p is None or p not in level:
                continue
            lv = max(lv, level[p] + (1 if _is_standard(node) and not _is_standard(p) else 0))
        level[node] = lv
    unknown = sorted({n.op_type for n in graph if not _is_standard(n) and n.op_type not in KERNELS})
    if unknown:
        raise VlmcError(
            f"the reference executor has no kernel for {', '.join(unknown)} (it runs the standard ONNX ops "
            f"and {', '.join(KERNELS)})"
        )
    consumers: dict[ir.Value, list[ir.Node]] = {}
    for node in graph:
        for v in _uses(node, graph):
            consumers.setdefault(v, []).append(node)
    graph_outputs = set(graph.outputs)
    stages: list[tuple[str, object]] = []
    for k in range(max(level.values(), default=-1) + 1):
        seg = [n for n in graph if level[n] == k and _is_standard(n)]
        if seg:
            inside = set(seg)
            ins: dict[ir.Value, None] = {}
            outs: dict[ir.Value, None] = {}
            for n in seg:
                for v in _uses(n, graph):
                    if (p := v.producer()) is not None and p in inside:
                        continue
                    if v.is_initializer() and not v.is_graph_input():
                        continue  # extract carries the weights into the segment
                    ins[v] = None
                for o in n.outputs:
                    if o in graph_outputs or any(c not in inside for c in consumers.get(o, [])):
                        outs[o] = None
            if outs:
                stages.append(("ort", _Segment(graph, seg, list(ins), list(outs), ir_version)))
        ascend = [n for n in graph if level[n] == k and not _is_standard(n)]
        if ascend:
            stages.append(("ascend", ascend))
    return stages


class Session:
    """A lowered graph ready to run repeatedly as the NPU would (its weights read and corrected once).

    Args:
        model: a lowered graph (IR or ModelProto), or the path of one (its external data beside it).
        fp16: emulate the 910B's fp16 arithmetic in the Ascend ops.
    """

    def __init__(self, model: ir.Model | onnx.ModelProto | str | Path, fp16: bool = True) -> None:
        if isinstance(model, (str, Path)):
            model = graphs.load_ir(Path(model))
        model, self.offset_corrections = ge_offset_correction(model)
        self.fp16 = fp16
        self._model = model
        self.outputs = [o.name for o in model.graph.outputs]
        self._stages = _stages(model.graph, model.ir_version)
        self._consts = {
            v.name: v.const_value.numpy()
            for node in (n for kind, ns in self._stages if kind == "ascend" for n in ns)
            for v in node.inputs
            if v is not None and v.const_value is not None
        }
        # Graph outputs that are initializers or graph inputs themselves (no node produces them).
        self._passthrough = {
            v.name: v.const_value.numpy() for v in model.graph.outputs if v.const_value is not None
        }

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every graph output by name."""
        env: dict[str, np.ndarray] = {**self._passthrough, **self._consts, **feeds}
        for kind, stage in self._stages:
            if kind == "ort":
                stage.run(env)
                continue
            for node in stage:
                args = [None if v is None else env[v.name] for v in node.inputs]
                attrs = {k: a.value for k, a in node.attributes.items()}
                (out,) = node.outputs
                env[out.name] = KERNELS[node.op_type](self.fp16, *args, **attrs)
        return {o: env[o] for o in self.outputs}


def run(
    model: ir.Model | onnx.ModelProto, feeds: dict[str, np.ndarray], fp16: bool = True
) -> dict[str, np.ndarray]:
    """Execute a lowered graph as the NPU would; returns every graph output by name.

    Args:
        model: a lowered graph (may contain Ascend ops and int8 MatMul/Conv).
        feeds: input arrays.
        fp16: emulate the 910B's fp16 arithmetic in the Ascend ops.
    """
    return Session(model, fp16).run(feeds)


class HostPool:
    """A paged pool held by the device rather than by the loop: on CPU, a numpy array behind the
    same ``shape`` / ``dtype`` / ``write(rows, slot_mapping)`` surface the NPU's pools have."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype) -> None:
        self.name = name
        self.array = np.zeros(shape, np.dtype(dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        write_rows(self.array, rows, slot_mapping)

    def write_layer(self, layer: int, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Write into layer ``layer`` of a stacked pool [layers, num_blocks, block_size, kv_heads, head_dim]."""
        write_rows(self.array[layer], rows, slot_mapping)  # a contiguous view: written in place


class ReferenceDevice:
    """The lowered graphs on CPU (:class:`Session`), as strict as the .om is.

    A feed whose full shape is not exactly one declared gear, or whose dtype is not the build's declared
    dtype, is an error, as is an output whose dtype differs from the declared one: this is the stand-in
    that checks the host logic where there is no NPU.
    """

    def __init__(self, fp16: bool = True, device_pools: bool = False) -> None:
        """
        Args:
            fp16: emulate the 910B's fp16 arithmetic in the Ascend ops.
            device_pools: hold the paged pools here (:class:`HostPool`) the way the NPU device holds
                them, so the loop's device-pool path (``new_pool``, ``pool.write``) runs on CPU too.
        """
        self.fp16 = fp16
        self._sessions: dict[str, object] = {}  # graph file -> reference session (builds may share a file)
        if device_pools:
            self.new_pool = HostPool

    def load(self, build, root: Path) -> None:
        if build.file not in self._sessions:
            where = f"{root}/compile.json"  # compile.json may come from elsewhere (vlmc/paths.py)
            self._sessions[build.file] = Session(
                paths.inside(root, build.file, "a build file", where=where), fp16=self.fp16
            )

    def execute(self, build, feeds: dict[str, object], dims: list[int] | None) -> dict[str, np.ndarray]:
        names = [i["name"] for i in build.inputs]
        if list(feeds) != names:
            raise VlmcError(f"{build.name}: feeds {list(feeds)} are not the build's inputs in order {names}")
        feeds = {n: v.array if isinstance(v, HostPool) else v for n, v in feeds.items()}
        for spec in build.inputs:
            got = np.asarray(feeds[spec["name"]]).dtype
            if got != np.dtype(spec["dtype"]):
                raise VlmcError(
                    f"{build.name}: input {spec['name']} is {got}, the build declares {spec['dtype']}"
                )
        actual = [int(d) for n in names for d in np.shape(feeds[n])]
        if actual not in build.allowed_dims():
            shapes = ", ".join(f"{n}{list(np.shape(v))}" for n, v in feeds.items())
            raise VlmcError(f"{build.name}: input shapes {shapes} are not one of the build's gears")
        if dims is not None and dims != actual:
            raise VlmcError(f"{build.name}: the dims vector {dims} does not describe the feeds {actual}")
        outs = self._sessions[build.file].run(feeds)
        for spec in build.outputs:
            if outs[spec["name"]].dtype != np.dtype(spec["dtype"]):
                raise VlmcError(
                    f"{build.name}: output {spec['name']} is {outs[spec['name']].dtype}, declared {spec['dtype']}"
                )
        return {o["name"]: outs[o["name"]] for o in build.outputs}

    def close(self) -> None:
        self._sessions.clear()
