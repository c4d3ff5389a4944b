"""A package whose vision graph carries work the folding passes can remove (shared by their unit tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmc.package import Package

from .._compose_builders import PATCH_DIM, PATCHES, package, vision_graph

FLOAT = ir.DataType.FLOAT


def _scalar(name: str, value: float) -> ir.Value:
    t = ir.tensor(np.array(value, np.float32), name=name)
    return ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(FLOAT), const_value=t)


def with_constant_scale(model: ir.Model) -> ir.Model:
    """The first MatMul's weight becomes ``weight * (half + half)``: two nodes over constants only."""
    g = model.graph
    matmul = next(n for n in g if n.op_type == "MatMul")
    weight = matmul.inputs[1]
    half_a, half_b = _scalar("fold.half_a", 0.5), _scalar("fold.half_b", 0.5)
    g.initializers.add(half_a)
    g.initializers.add(half_b)
    add = ir.node("Add", [half_a, half_b], name="fold.one_node")
    add.outputs[0].name = "fold.one"
    mul = ir.node("Mul", [weight, add.outputs[0]], name="fold.weight_node")
    mul.outputs[0].name = "fold.weight"
    g.insert_before(matmul, [add, mul])
    matmul.replace_input_with(1, mul.outputs[0])
    return model


def with_dead_and_identity(model: ir.Model) -> ir.Model:
    """An Identity after the activation (onnxsim drops it) and a Sigmoid nothing reads (dead code)."""
    g = model.graph
    relu = next(n for n in g if n.op_type == "Relu")
    user = next(iter(relu.outputs[0].uses())).node
    ident = ir.node("Identity", [relu.outputs[0]], name="simplify.identity_node")
    ident.outputs[0].name = "simplify.identity"
    dead = ir.node("Sigmoid", [relu.outputs[0]], name="simplify.dead_node")
    dead.outputs[0].name = "simplify.dead"
    g.insert_after(relu, [ident, dead])
    user.replace_input_with(0, ident.outputs[0])
    return model


def folding_package(directory: Path, edit) -> Package:
    """The compose builders' package with its vision graph edited by ``edit``, saved and opened again."""
    pkg = package(directory / "src", layers=1)
    pkg.set_graph("vision_encoder", edit(vision_graph()), role="vision")
    return Package.load(pkg.save(directory / "pkg"))


def pixels(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pixel_values": rng.standard_normal((2, PATCHES, PATCH_DIM)).astype(np.float32)}


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]
