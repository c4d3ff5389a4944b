"""split: undo merge (``vlm`` -> stage graphs) and/or cut the decoder into contiguous layer ranges.

Range k (``decoder.k``) takes ``hidden_states.<first layer>`` (range 0: ``inputs_embeds``),
``attention_mask``, ``position_ids`` and the past KV of its own layers, and returns the next range's
``hidden_states.<first layer>`` (the last range: ``logits``) and its presents. The cut points are found
structurally — the residual-stream tensor every data path crosses between two layers — so no node
naming convention is assumed. The mask and rotary subgraphs are duplicated into each range (exact).
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from vlmc import interop, limits, tensor_names
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes import _graph_compose as compose
from vlmc.passes.merge import is_merged

logger = logging.getLogger(__name__)


@register
class Split(Pass):
    """Split a merged package back into stages; optionally split the decoder into layer ranges."""

    name = "split"
    requires = ("unsharded",)
    summary = (
        "split a merged `vlm` graph back into vision/fusion/embed/decoder stages, and/or the decoder "
        "into N contiguous layer ranges decoder.0, decoder.1, ... (pipeline stages)"
    )
    options = (
        Option(
            "decoder_ranges",
            int,
            1,
            "number of contiguous layer ranges to cut the decoder into (1: keep it whole)",
            min=1,
            max=limits.MAX_LAYERS,
        ),
        Option(
            "boundaries",
            list,
            None,
            "first layer of every range after the first, e.g. [4, 8] for 3 ranges "
            "(default: ranges of near-equal size)",
            items=int,
            min=1,
            max=limits.MAX_LAYERS,
            max_items=limits.MAX_LAYERS,
        ),
    )

    @classmethod
    def check_options(cls, opts: dict, where: str) -> None:
        b = opts.get("boundaries")
        if b is None:
            return
        if not b or any(x < 1 for x in b) or sorted(set(b)) != list(b):
            raise VlmcError(f"{where}: boundaries must be increasing layer indices >= 1, got {b}")
        if opts["decoder_ranges"] not in (1, len(b) + 1):
            raise VlmcError(
                f"{where}: {len(b)} boundaries make {len(b) + 1} ranges but decoder_ranges is "
                f"{opts['decoder_ranges']}; give one of the two"
            )
        opts["decoder_ranges"] = len(b) + 1

    def _ranges(self, layers: int) -> list[int]:
        n = self.opts["decoder_ranges"]
        starts = self.opts["boundaries"] or [round(k * layers / n) for k in range(1, n)]
        return [0, *starts, layers]

    def check_package(self, package: Package) -> None:
        n = self.opts["decoder_ranges"]
        if n == 1:
            return
        merged = is_merged(package)
        pipeline = package.manifest["graphs"][merged]["pipeline"] if merged else package.manifest["pipeline"]
        chain = pipeline["decoder"]
        if len(chain) != 1:
            raise VlmcError(
                f"split: the decoder is already split into {len(chain)} ranges ({', '.join(chain)}); "
                "split the unsplit package instead"
            )
        layers = int(package.manifest["kv"]["layers"])
        bounds = self._ranges(layers)
        if n > layers or bounds[-2] >= layers:
            raise VlmcError(
                f"split: cannot cut a {layers}-layer decoder into ranges starting at {bounds[:-1]}; "
                f"use at most {layers} ranges and boundaries below {layers}"
            )

    def run(self, package: Package, plan: None = None) -> PassResult:
        report: dict = {}
        merged = is_merged(package)
        if merged:
            report["unmerged"] = _unmerge(package, merged)
        if self.opts["decoder_ranges"] > 1:
            report["decoder_ranges"] = _split_decoder(
                package, self._ranges(int(package.manifest["kv"]["layers"]))
            )
        if not report:
            logger.warning("split: the package is not merged and decoder_ranges is 1; nothing to split")
        return PassResult(package, bool(report), report)


def _unmerge(pkg: Package, name: str) -> list[str]:
    """Cut each stage recorded by merge out of the merged graph; stages still present are kept as they are."""
    info = pkg.info(name)
    merged = pkg.model(name)
    restored = []
    for rec in info["stages"]:
        if rec["name"] in pkg.manifest["graphs"]:
            continue  # the text-only decode path merge kept beside the merged graph
        tensors = rec["tensors"]
        where = f"split: stage {rec['name']!r} of {name}"
        ins = compose.lookup(merged.graph, [tensors.get(e["name"], e["name"]) for e in rec["inputs"]], where)
        outs = compose.lookup(
            merged.graph, [tensors.get(e["name"], e["name"]) for e in rec["outputs"]], where
        )
        graph = compose.extract(merged.graph, ins, outs, where, name=rec["name"])
        # The stage's own names and signature, not the merged graph's view of a shared tensor (a
        # producer and a consumer may name a dimension differently).
        for value, entry in zip([*graph.inputs, *graph.outputs], [*rec["inputs"], *rec["outputs"]]):
            value.name = entry["name"]
            compose.set_signature(value, entry)
        pkg.set_graph(
            rec["name"],
            compose.model_like(graph, merged),
            role=rec["role"],
            precision=rec["precision"],
            file=rec["file"],
            **rec["extra"],
        )
        restored.append(rec["name"])
    pipeline = info["pipeline"]
    pkg.remove_graph(name)
    pkg.files.pop(f"samples/{name}.npz", None)
    for entry in pkg.manifest["graphs"].values():
        # Saving writes such a graph with its own data file again (Package.save sees that its file
        # points into the shared one, which is no longer written).
        entry.pop("weights_file", None)
    pkg.manifest["pipeline"] = pipeline
    return restored


def _shape_facts(model: ir.Model, values: list[ir.Value]) -> dict[str, onnx.TypeProto]:
    """Inferred types of some internal values, without reading the weights.

    onnx shape inference runs on the proto of the graph the interop seam hands out, with every
    weight held back as a typed graph input (shapes need the weights' shapes, not their bytes).
    """
    names = {v.name for v in values}
    with interop.as_proto(model, weight_limit=0) as seam:
        inferred = onnx.shape_inference.infer_shapes(seam.proto, data_prop=True)
    return {v.name: v.type for v in inferred.graph.value_info if v.name in names}


def _set_type(value: ir.Value, proto_type: onnx.TypeProto) -> None:
    """Take what shape inference knows of a value: its dtype, and its shape where it has one."""
    tt = proto_type.tensor_type
    if tt.elem_type:
        value.dtype = ir.DataType(tt.elem_type)
    if tt.HasField("shape"):
        value.shape = ir.Shape(
            [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        )


def _split_decoder(pkg: Package, bounds: list[int]) -> dict:
    chain = pkg.manifest["pipeline"]["decoder"]
    dec = chain[0]
    info = pkg.info(dec)
    model = pkg.model(dec)
    g = model.graph
    by_name = ir.convenience.create_value_mapping(g, include_subgraphs=False)
    source, sink = by_name[tensor_names.INPUTS_EMBEDS], by_name[tensor_names.LOGITS]
    kv_in = {
        by_name[i["name"]]: layer
        for i in info["inputs"]
        if (layer := tensor_names.layer_of(i["name"])) is not None
    }
    kv_out = {
        by_name[o["name"]]: layer
        for o in info["outputs"]
        if (layer := tensor_names.layer_of(o["name"])) is not None
    }
    shared_in = [by_name[i["name"]] for i in info["inputs"] if by_name[i["name"]] not in kv_in]
    shared_in = [v for v in shared_in if v is not source]
    cuts = compose.residual_cuts(g, source, sink)

    boundary = {0: source, bounds[-1]: sink}
    for b in bounds[1:-1]:
        later = compose.depends_on(g, {v for v, layer in kv_in.items() if layer >= b})
        earlier = compose.depends_on(g, {v for v, layer in kv_in.items() if layer == b - 1})
        found = [c for c in cuts if c not in later and c in earlier]
        if not found:
            raise VlmcError(
                f"split: found no residual-stream tensor between layers {b - 1} and {b} of {dec}; "
                "the decoder does not have the standard layer structure"
            )
        boundary[b] = found[-1]
    facts = _shape_facts(model, [boundary[b] for b in bounds[1:-1]])
    source_entry = next(i for i in info["inputs"] if i["name"] == tensor_names.INPUTS_EMBEDS)

    def hidden(b: int) -> str:
        if b == 0:
            return tensor_names.INPUTS_EMBEDS
        return tensor_names.LOGITS if b == bounds[-1] else tensor_names.hidden_states(b)

    def typed(value: ir.Value, b: int) -> None:
        # A cut tensor's inferred type, else the decoder input's (the residual stream keeps its shape).
        value.name = hidden(b)
        if 0 < b < bounds[-1]:
            compose.set_signature(value, source_entry)
            fact = facts.get(boundary[b].name)
            if fact is not None:
                _set_type(value, fact)

    names = []
    graphs = []
    for k, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
        own_in = [v for v, layer in kv_in.items() if a <= layer < z]
        own_out = [v for v, layer in kv_out.items() if a <= layer < z]
        rest = [v for v in g.outputs if v not in kv_out and v is not sink] if z == bounds[-1] else []
        outs = [boundary[z], *own_out, *rest]
        allowed = {boundary[a], *own_in, *shared_in}
        reached = compose.backward_reach(outs, allowed)
        foreign = [v for v in g.inputs if v in reached - allowed]
        ins = [boundary[a]] + [v for v in shared_in + own_in if v in reached or v in own_in]
        where = f"split: {dec} layers {a}..{z - 1}"
        stage = compose.extract(g, ins + foreign, outs, where, name=f"{dec}.{k}")
        typed(stage.inputs[0], a)
        typed(stage.outputs[0], z)
        _substitute_shape_inputs(stage, len(ins), a, where)
        graphs.append(stage)
        names.append(f"{dec}.{k}")
    for stage, (a, z), name in zip(graphs, zip(bounds[:-1], bounds[1:]), names):
        pkg.set_graph(
            name,
            compose.model_like(stage, model),
            role="decoder",
            precision=info["precision"],
            kv_layers=[a, z],
        )
    pkg.remove_graph(dec)
    pkg.manifest["pipeline"]["decoder"] = names
    return {
        "graphs": names,
        "layers": [[a, z] for a, z in zip(bounds[:-1], bounds[1:])],
        "boundaries": {hidden(b): boundary[b].name for b in bounds[1:-1]},
    }


def _substitute_shape_inputs(stage: ir.Graph, owned: int, first_layer: int, where: str) -> None:
    """Rewire inputs a range reads only for their shape to same-shaped inputs the range owns.

    The traced causal mask takes the past length from layer 0's past key and the sequence length from
    ``inputs_embeds``; a later range owns neither, but its own first past key and its hidden-state
    input have exactly those shapes. The first ``owned`` inputs of ``stage`` are its own; the rest are
    the foreign ones.
    """
    by_name = {v.name: v for v in stage.inputs[:owned]}
    hidden = stage.inputs[0]
    for f in list(stage.inputs[owned:]):
        if tensor_names.layer_of(f.name) is not None:
            target = by_name.get(tensor_names.with_layer(f.name, first_layer))
        elif f.name == tensor_names.INPUTS_EMBEDS:
            target = hidden
        else:
            target = None
        if target is None or not compose.only_shape_used(f):
            raise VlmcError(
                f"{where}: the range needs the values of {f.name!r}, which belongs to another range"
            )
        f.replace_all_uses_with(target)
        stage.inputs.remove(f)
