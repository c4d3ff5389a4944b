"""simplify and fold_constants leave quantized graphs alone (folding would undo the weight compression)."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from vlmc import manager, recipe
from vlmc.package import Package


@pytest.mark.parametrize("fold", ["simplify", "fold_constants"])
def test_folding_after_quantize_keeps_compressed_weights(tiny_llava, fold):
    steps = recipe.parse(f"passes:\n  - quantize: {{decoder: {{weights: int8}}}}\n  - {fold}\n").steps
    pkg = manager.run(Package.load(tiny_llava), steps)
    assert pkg.info("decoder")["precision"] == "int8_weight_only"
    rep = pkg.manifest["history"][-1]["report"]
    assert "run " + fold + " before quantize" in rep["decoder"]["skipped"]
    dtypes = {v.dtype for v in pkg.model("decoder").graph.initializers.values() if len(v.shape) == 2}
    assert ir.DataType.INT8 in dtypes  # INT8 weights survive the folding pass
