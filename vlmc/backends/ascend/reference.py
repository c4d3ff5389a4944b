"""numpy references of the Ascend ops vlmc emits, and an executor that runs a lowered graph with them.

The lowered graph is what ATC reads, so onnxruntime cannot load it (Ascend ops, int8 MatMul). The
executor is ``onnx.reference.ReferenceEvaluator`` with these ops added and MatMul/Conv taught to
accumulate int8 in int32, which is what the AMCT deploy form means by an int8 MatMul.

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
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_conv import Conv as _OnnxConv

from vlmc import ascend_limits, graphs, interop

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


def _ops(fp16: bool) -> list[type[OpRun]]:
    class AscendQuant(OpRun):
        op_domain = ""

        def _run(self, x, scale=None, offset=None, dst_type=None, round_mode=None, sqrt_mode=None):
            if dst_type not in (None, "INT8", b"INT8"):
                raise ValueError(f"AscendQuant dst_type {dst_type!r} is not emulated")
            return (ascend_quant(x, scale, offset or 0.0, fp16),)

    class AscendDequant(OpRun):
        op_domain = ""

        def _run(self, x, deq_scale, dtype=None, sqrt_mode=None, relu_flag=None):
            axis = 1 if x.ndim == 4 else None  # Conv outputs are NCHW; MatMul outputs have channels last
            return (ascend_dequant(x, deq_scale, fp16, axis),)

    class AscendAntiQuant(OpRun):
        op_domain = ""

        def _run(self, x, scale=None, offset=None, dtype=None, sqrt_mode=None):
            return (ascend_antiquant(x, scale, offset or 0.0, fp16),)

    class NPUWeightQuantBatchMatmulV2(OpRun):
        op_domain = ""

        def _run(
            self,
            x,
            weight,
            antiquant_scale,
            antiquant_offset=None,
            quant_scale=None,
            quant_offset=None,
            bias=None,
            antiquant_group_size=0,
            transpose_x=0,
            transpose_weight=0,
            inner_precise=None,
        ):
            if transpose_x or transpose_weight:
                raise ValueError("NPUWeightQuantBatchMatmulV2 transposes must be off")
            return (
                weight_quant_batch_matmul(
                    x, weight, antiquant_scale, antiquant_offset, antiquant_group_size or 0, bias, fp16
                ),
            )

    class MatMul(OpRun):
        op_domain = ""

        def _run(self, a, b):
            if a.dtype == np.int8 or b.dtype == np.int8:
                return (np.matmul(a.astype(np.int32), b.astype(np.int32)),)
            return (np.matmul(a, b),)

    class Conv(_OnnxConv):
        op_domain = ""

        def _run(self, x, w, b=None, **kwargs):
            if x.dtype != np.int8:
                return super()._run(x, w, b, **kwargs)
            (y,) = super()._run(
                x.astype(np.float64),
                w.astype(np.float64),
                None if b is None else b.astype(np.float64),
                **kwargs,
            )
            return (np.rint(y).astype(np.int32),)

    return [AscendQuant, AscendDequant, AscendAntiQuant, NPUWeightQuantBatchMatmulV2, MatMul, Conv]


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


class Session:
    """A lowered graph ready to run repeatedly as the NPU would (its weights read and corrected once).

    ``onnx.reference.ReferenceEvaluator`` takes a ModelProto with every value inside, so the graph
    crosses the interop seam with its weights read in: the executor is for CPU checks of graphs that
    fit in memory, like onnxruntime's.

    Args:
        model: a lowered graph (IR or ModelProto), or the path of one (its external data beside it).
        fp16: emulate the 910B's fp16 arithmetic in the Ascend ops.
    """

    def __init__(self, model: ir.Model | onnx.ModelProto | str | Path, fp16: bool = True) -> None:
        if isinstance(model, (str, Path)):
            model = graphs.load_ir(Path(model))
        model, self.offset_corrections = ge_offset_correction(model)
        self.outputs = [o.name for o in model.graph.outputs]
        with interop.as_proto(model, weight_limit=None) as seam:
            self._eval = ReferenceEvaluator(seam.proto, new_ops=_ops(fp16))

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every graph output by name."""
        return dict(zip(self.outputs, self._eval.run(None, feeds)))


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
