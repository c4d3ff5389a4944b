"""fold_constants: evaluate subgraphs that depend only on constants, using onnx-graphsurgeon."""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs

from vlmc import interop
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes._folding import foldable, same_graph

logger = logging.getLogger(__name__)


@register
class FoldConstants(Pass):
    """Fold constant subgraphs (onnxruntime evaluates them) and drop what becomes unused."""

    name = "fold_constants"
    summary = "fold constant subexpressions with onnx-graphsurgeon + onnxruntime (numerics preserved)"
    preserves_numerics = True
    options = (
        Option("graphs", list, None, "graph names to fold (default: all)", items=str),
        Option(
            "size_threshold_mb",
            float,
            64.0,
            "do not materialize folded tensors larger than this",
            min=0,
            max=1 << 20,
        ),
        Option(
            "weight_limit_mb",
            float,
            1.0,
            "weights this large are never read: expressions over them alone are left unfolded "
            "(torch's exporter already folded those)",
            min=0,
            max=1 << 20,
        ),
    )

    def run(self, package, plan=None):
        names, skipped = foldable(package, self.opts["graphs"] or package.graph_names, self.name)
        report = {name: {"skipped": why} for name, why in skipped.items()}
        limit = int(self.opts["size_threshold_mb"] * 1024 * 1024)
        for name in names:
            model = package.model(name)
            with interop.as_proto(model, int(self.opts["weight_limit_mb"] * 1024 * 1024)) as seam:
                graph = gs.import_onnx(seam.proto)
                graph.fold_constants(size_threshold=limit, error_ok=True).cleanup().toposort()
                seam.give_back(gs.export_onnx(graph, do_type_check=False))
                del graph
            folded = seam.model
            folded.ir_version = model.ir_version
            folded.opset_imports.clear()
            folded.opset_imports.update(model.opset_imports)
            report[name] = {"nodes_before": len(model.graph), "nodes_after": len(folded.graph)}
            # graphsurgeon keeps tensors it cannot fold; keep the original unless something really changed
            if not same_graph(folded, model):
                package.set_graph(name, folded)
            else:
                report[name]["nodes_after"] = len(model.graph)
        return PassResult(package, report=report)
