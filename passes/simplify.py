"""simplify: onnxsim per graph, then removal of nodes whose outputs nothing uses."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from vlmc import interop
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes._folding import foldable, same_graph

logger = logging.getLogger(__name__)


def remove_dead_nodes(model: ir.Model) -> bool:
    """Drop nodes and initializers that do not contribute to a graph output (onnx-ir's pass), in place.

    Returns True if anything was removed.
    """
    return RemoveUnusedNodesPass()(model).modified


@register
class Simplify(Pass):
    """Constant-fold and simplify each graph with onnxsim, then drop dead nodes."""

    name = "simplify"
    summary = "onnxsim simplification plus dead-node cleanup on every graph (numerics preserved)"
    preserves_numerics = True
    options = (
        Option("graphs", list, None, "graph names to simplify (default: all)", items=str),
        Option("skip_fuse_bn", bool, True, "leave BatchNormalization unfused (ATC fuses it itself)"),
        Option(
            "weight_limit_mb",
            float,
            1.0,
            "weights this large are never read: onnxsim sees them as opaque inputs, so it works on "
            "graphs of any size and copies no weights",
            min=0,
            max=1 << 20,
        ),
    )

    def run(self, package, plan=None):
        names, skipped = foldable(package, self.opts["graphs"] or package.graph_names, self.name)
        report = {name: {"skipped": why} for name, why in skipped.items()}
        for name in names:
            model = package.model(name)
            with interop.as_proto(model, int(self.opts["weight_limit_mb"] * 1024 * 1024)) as seam:
                seam.give_back(_onnxsim(seam.proto, self.opts["skip_fuse_bn"], name))
            simplified = seam.model
            remove_dead_nodes(simplified)
            report[name] = {"nodes_before": len(model.graph), "nodes_after": len(simplified.graph)}
            if not same_graph(simplified, model):  # onnxsim may only have reordered nodes
                package.set_graph(name, simplified)
            else:
                report[name]["nodes_after"] = len(model.graph)
        return PassResult(package, report=report)


def _onnxsim(model: onnx.ModelProto, skip_fuse_bn: bool, name: str) -> onnx.ModelProto:
    import onnxsim

    import vlmc.ortsession  # noqa: F401  (quiets onnxruntime, which onnxsim runs)

    try:
        simplified, ok = onnxsim.simplify(model, skip_fuse_bn=skip_fuse_bn, check_n=0)
    except Exception as exc:  # onnxsim raises RuntimeError/ValidationError on graphs it cannot handle
        logger.warning(
            "simplify: onnxsim could not simplify %s (%s); keeping it", name, str(exc).splitlines()[0]
        )
        return model
    if not ok:
        logger.warning("simplify: onnxsim's own check failed on %s; keeping the original", name)
        return model
    return simplified
