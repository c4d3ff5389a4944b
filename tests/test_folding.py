"""simplify and fold_constants leave quantized graphs alone (folding would undo the weight compression)."""

from __future__ import annotations

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
    inits = {t.data_type for t in pkg.graph("decoder").graph.initializer if len(t.dims) == 2}
    assert 3 in inits  # INT8 (TensorProto.INT8 == 3) weights survive the folding pass
