"""The ONNX op types ATC's parser registers, per opset (data/onnx_ops.tsv), and lookups against them."""

from __future__ import annotations

import functools
import logging
from importlib import resources

logger = logging.getLogger(__name__)

# ATC parses ai.onnx opsets 8..18 for ordinary ops; at 19 and above every ordinary op fails.
MIN_OPSET = 8
MAX_OPSET = 18
RECOMMENDED_OPSET = 17

# The parser converts Constant nodes and initializers itself (Const / FileConstant) at any opset.
ALWAYS_PARSED = frozenset({"Constant"})

# The custom domain ATC also reads, keyed as ``npu::<opset_import version>::<op>``.
NPU_DOMAIN = "npu"
NPU_DOMAIN_VERSION = 1
# Every op type the ONNX parser plugins register under ``npu::1::`` (32), read from the
# REGISTER_CUSTOM_OP(...).OriginOpType lists of the *_onnx_plugin.cpp files in hicann/ops-nn
# (snapshot e5c3fa93, Aug 2026; e.g. matmul/weight_quant_batch_matmul_v2/framework/
# npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp, norm/rms_norm/framework/npu_rms_norm_onnx_plugin.cpp)
# and hicann/ops-math (c4193324; e.g. common/src/framework/npu_rotary_mul_onnx_plugin.cpp,
# conversion/slice/framework/npu_slice_onnx_plugin.cpp). hicann/ops-transformer registers none.
# Note the npu-domain name of the weight-only matmul has no "NPU" prefix, unlike its ai.onnx name.
NPU_DOMAIN_OPS = frozenset(
    {
        "NPUAddRmsNorm",
        "NPUAntiQuant",
        "NPUAscendQuantV2",
        "NPUBoundingBoxDecode",
        "NPUBoundingBoxEncode",
        "NPUDeformableConv2d",
        "NPUDropoutWithAddSoftmax",
        "NPUDtypeCast",
        "NPUDynamicQuant",
        "NPUDynamicQuantV2",
        "NPUFastGelu",
        "NPUFormatCast",
        "NPUFusedAddRmsNorm",
        "NPUGeglu",
        "NPUGeluV2",
        "NPUGroupNormSilu",
        "NPUGroupQuant",
        "NPUGru",
        "NPUIndexing",
        "NPULstm",
        "NPULstmCell",
        "NPUMish",
        "NPUOneHot",
        "NPUQuantize",
        "NPURmsNorm",
        "NPURotaryMul",
        "NPUScatter",
        "NPUSignBitsPack",
        "NPUSignBitsUnpack",
        "NPUSlice",
        "NPUSoftmaxCrossEntropyWithLogits",
        "WeightQuantBatchMatmulV2",
    }
)

# Ops that QDQ quantization or ORT-specific export introduces, with what the user should do instead.
_SUGGESTIONS = {
    "QuantizeLinear": "run the quantize lowering (vlmc compile lowers QDQ around MatMul/Gemm/Conv to AscendQuant/AscendDequant)",
    "DequantizeLinear": "run the quantize lowering (vlmc compile lowers QDQ around MatMul/Gemm/Conv to AscendQuant/AscendDequant)",
    "DynamicQuantizeLinear": "dynamic quantization has no ATC form; quantize with static int8 or weight-only",
    "MatMulInteger": "dynamic quantization has no ATC form; quantize with static int8 or weight-only",
    "ConvInteger": "dynamic quantization has no ATC form; quantize with static int8 or weight-only",
    "QLinearMatMul": "keep the quantize pass in QDQ format (QuantFormat.QDQ), not QOperator",
    "QLinearConv": "keep the quantize pass in QDQ format (QuantFormat.QDQ), not QOperator",
    "Attention": "export attention as plain MatMul/Softmax ops at opset 17",
    "RotaryEmbedding": "export rotary embedding as plain Mul/Slice/Concat ops at opset 17",
    "LayerNormalization": "export at opset 17 (ATC registers LayerNormalization only for opsets 17-18)",
    "Gelu": "export at opset 17, where Gelu is decomposed into Erf/Mul/Add",
}

_ORT_ONLY_SUGGESTIONS = {
    "MatMulNBits": "use the quantize pass's weight-only mode, which emits DequantizeLinear + MatMul",
    "GroupQueryAttention": "do not run onnxruntime's transformer optimizer on graphs meant for ATC",
    "MultiHeadAttention": "do not run onnxruntime's transformer optimizer on graphs meant for ATC",
}


@functools.lru_cache(maxsize=1)
def table() -> dict[str, frozenset[int]]:
    """op_type -> the ai.onnx opsets ATC registers a parser for (from data/onnx_ops.tsv)."""
    text = resources.files("vlmc.backends.ascend").joinpath("data/onnx_ops.tsv").read_text()
    out: dict[str, frozenset[int]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line.startswith("op_type\t"):
            continue
        op, opsets = line.split("\t")
        out[op.strip()] = frozenset(int(v) for v in opsets.split(","))
    return out


def opsets(op_type: str) -> frozenset[int]:
    """The opsets an op is registered for (empty if ATC has no parser for it)."""
    return table().get(op_type, frozenset())


def supported(op_type: str, domain: str, opset_versions: dict[str, int]) -> bool:
    """Whether ATC parses ``op_type`` of ``domain`` in a model with these opset_import versions.

    Args:
        op_type: the node's op type.
        domain: the node's domain ('' and 'ai.onnx' are the default domain).
        opset_versions: the model's opset_import, domain -> version ('' for ai.onnx).
    """
    if domain in ("", "ai.onnx"):
        if op_type in ALWAYS_PARSED:
            return True
        version = opset_versions.get("", opset_versions.get("ai.onnx"))
        return version is not None and version in opsets(op_type)
    if domain == NPU_DOMAIN:
        return op_type in NPU_DOMAIN_OPS and opset_versions.get(NPU_DOMAIN) == NPU_DOMAIN_VERSION
    return False


def suggestion(op_type: str, domain: str, opset: int | None) -> str:
    """A one-phrase fix for an op ATC rejects."""
    if domain not in ("", "ai.onnx", NPU_DOMAIN):
        specific = _ORT_ONLY_SUGGESTIONS.get(op_type)
        base = f"{domain} ops exist only in onnxruntime"
        return f"{base}; {specific}" if specific else f"{base}; export without onnxruntime-specific fusions"
    if domain == NPU_DOMAIN:
        return (
            f"the npu domain needs opset_import npu={NPU_DOMAIN_VERSION} and holds only the "
            f"{len(NPU_DOMAIN_OPS)} ops the parser plugins register (e.g. NPURmsNorm, WeightQuantBatchMatmulV2)"
        )
    if op_type in _SUGGESTIONS:
        return _SUGGESTIONS[op_type]
    registered = opsets(op_type)
    if registered and opset is not None and opset not in registered:
        good = sorted(v for v in registered if v <= MAX_OPSET) or sorted(registered)
        target = RECOMMENDED_OPSET if RECOMMENDED_OPSET in registered else good[-1]
        return f"export at opset {target} (ATC registers {op_type} for opsets {_ranges(sorted(registered))})"
    return "ATC has no ONNX parser for this op; rewrite it with supported ops or remove it before compiling"


def _ranges(values: list[int]) -> str:
    """Compact '8-18' style text for a sorted list of ints."""
    parts: list[str] = []
    start = prev = values[0]
    for v in values[1:] + [None]:  # type: ignore[list-item]
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)
