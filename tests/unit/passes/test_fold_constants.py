"""fold_constants on a small hand-built package: constant subgraphs become weights, numerics and `modified` exact."""

from __future__ import annotations

import numpy as np

from vlmc import manager
from vlmc.recipe import Step

from .._compose_builders import run
from ._folding_builders import folding_package, op_types, pixels, with_constant_scale


def _fold(pkg, **options):
    return manager.run(pkg, [Step(name="fold_constants", options=options, index=1)])


def test_constant_subgraph_becomes_one_weight_with_the_same_outputs(tmp_path):
    pkg = folding_package(tmp_path, with_constant_scale)
    before = pkg.model("vision_encoder")
    assert op_types(before).count("Mul") == 1 and "Add" in op_types(before)
    want = run(before, pixels())
    out = _fold(pkg)
    entry = out.manifest["history"][-1]
    assert entry["pass"] == "fold_constants" and entry["modified"] is True
    after = out.model("vision_encoder")
    assert "Add" not in op_types(after) and "Mul" not in op_types(after)
    assert entry["report"]["vision_encoder"] == {
        "nodes_before": len(before.graph),
        "nodes_after": len(after.graph),
    }
    assert len(after.graph) == len(before.graph) - 2
    # the folded weight is the old one times (0.5 + 0.5)
    weight = after.graph.node(op_types(after).index("MatMul")).inputs[1]
    np.testing.assert_array_equal(
        weight.const_value.numpy(), before.graph.initializers["vision.proj"].const_value.numpy()
    )
    got = run(after, pixels())
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_nothing_to_fold_is_modified_false_and_leaves_every_graph(tmp_path):
    pkg = folding_package(tmp_path, lambda model: model)
    state = pkg.state()
    out = _fold(pkg)
    assert out.manifest["history"][-1]["modified"] is False
    assert out.state() == state


def test_weights_over_the_limit_are_not_read_so_only_the_scalar_part_folds(tmp_path):
    pkg = folding_package(tmp_path, with_constant_scale)
    # 0.001 MiB: the 24x16 float weight (1.5 KiB) is opaque to graphsurgeon, the scalars are not
    out = _fold(pkg, weight_limit_mb=0.001)
    assert out.manifest["history"][-1]["modified"] is True
    kinds = op_types(out.model("vision_encoder"))
    assert "Add" not in kinds and kinds.count("Mul") == 1


def test_quantized_graph_is_skipped_with_the_reason(tmp_path):
    pkg = folding_package(tmp_path, with_constant_scale)
    pkg.manifest["graphs"]["vision_encoder"]["precision"] = "int8"
    state = pkg.state()
    out = _fold(pkg, graphs=["vision_encoder"])
    entry = out.manifest["history"][-1]
    assert entry["modified"] is False and out.state() == state
    assert "folding would undo the quantization" in entry["report"]["vision_encoder"]["skipped"]
