"""Ascend NPU limits that quantization passes and the Ascend backend both hold graphs to, stated once.

Passes must not import backends, so these facts live here and both sides import them. Each cites
where CANN states it.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

# AscendQuant multiplies by 1/scale in fp16 (hicann/ops-nn quant/ascend_quant), so 1/scale must not
# exceed the largest finite fp16.
FP16_MAX = 65504.0


def _min_act_scale() -> float:
    # The smallest float32 activation scale whose reciprocal is representable in fp16.
    s = np.float32(1.0 / FP16_MAX)
    while 1.0 / s > FP16_MAX:
        s = np.nextafter(s, np.float32(1))
    return float(s)


MIN_ACT_SCALE = _min_act_scale()

# NPUWeightQuantBatchMatmulV2's antiquant_group_size is 0 or a multiple of 32 that is at most k-1
# (hicann/ops-nn matmul/weight_quant_batch_matmul_v2/op_graph/weight_quant_batch_matmul_v2_proto.h).
GROUP_MULTIPLE = 32

# Manifest precisions whose graphs hold quantized weights (vlmc/manifest.py PRECISIONS): folding
# would undo them, and the backend lowers them to the NPU's quant ops.
QUANTIZED_PRECISIONS = ("int8", "int8_weight_only", "int4_weight_only")


def group_size_ok(group_size: int, k: int) -> bool:
    """True if NPUWeightQuantBatchMatmulV2 accepts ``group_size`` for a weight of ``k`` input rows."""
    return group_size % GROUP_MULTIPLE == 0 and group_size <= k - 1
