"""split: undo merge (``vlm`` -> stage graphs) and/or cut the decoder into contiguous layer ranges.

Range k (``decoder.k``) takes ``hidden_states.<first layer>`` (range 0: ``inputs_embeds``),
``attention_mask``, ``position_ids`` and the past KV of its own layers, and returns the next range's
``hidden_states.<first layer>`` (the last range: ``logits``) and its presents. The cut points are found
structurally — the residual-stream tensor every data path crosses between two layers — so no node
naming convention is assumed. The mask and rotary subgraphs are duplicated into each range (exact).
"""

from __future__ import annotations

import logging
import re

import onnx

from vlmc import graphs as G
from vlmc import limits as L
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes import _graph_compose as C
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
            max=L.MAX_LAYERS,
        ),
        Option(
            "boundaries",
            list,
            None,
            "first layer of every range after the first, e.g. [4, 8] for 3 ranges "
            "(default: ranges of near-equal size)",
            items=int,
            min=1,
            max=L.MAX_LAYERS,
            max_items=L.MAX_LAYERS,
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

    def run(self, package: Package) -> PassResult:
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
    model = pkg.graph(name)
    restored = []
    for rec in info["stages"]:
        if rec["name"] in pkg.manifest["graphs"]:
            continue  # the text-only decode path merge kept beside the merged graph
        tensors = rec["tensors"]
        ins, outs = [e["name"] for e in rec["inputs"]], [e["name"] for e in rec["outputs"]]
        sub = C.extract(
            model,
            [tensors.get(n, n) for n in ins],
            [tensors.get(n, n) for n in outs],
            f"split: stage {rec['name']!r} of {name}",
        )
        C.rename(sub.graph, {v: k for k, v in tensors.items()})
        # The stage's own signature, not the merged graph's view of a shared tensor (a producer and a
        # consumer may name a dimension differently).
        for coll, entries in ((sub.graph.input, rec["inputs"]), (sub.graph.output, rec["outputs"])):
            del coll[:]
            coll.extend(C.value_info(e) for e in entries)
        sub.graph.name = rec["name"]
        pkg.set_graph(
            rec["name"], sub, role=rec["role"], precision=rec["precision"], file=rec["file"], **rec["extra"]
        )
        restored.append(rec["name"])
    pipeline = info["pipeline"]
    pkg.remove_graph(name)
    pkg.files.pop(f"samples/{name}.npz", None)
    for n, entry in pkg.manifest["graphs"].items():
        if entry.pop("weights_file", None):
            # loaded now, so that saving writes the graph with its own data file again instead of
            # linking a protobuf that points into the shared file, which is no longer written
            pkg.graph(n)
    pkg.manifest["pipeline"] = pipeline
    return restored


def _shape_facts(model: onnx.ModelProto, names: set[str]) -> dict[str, onnx.ValueInfoProto]:
    """Inferred types of some internal tensors, without copying the weights.

    Shape inference needs the weights' shapes, not their bytes, and serializing the weights would
    break on models over 2 GB: it runs on a weightless copy.
    """
    skeleton, _ = G.weightless_copy(model)
    inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
    return {v.name: v for v in inferred.graph.value_info if v.name in names}


def _kv_renamed(name: str, layer: int) -> str:
    return re.sub(r"\.(\d+)(\.|$)", lambda m: f".{layer}{m.group(2)}", name, count=1)


def _split_decoder(pkg: Package, bounds: list[int]) -> dict:
    chain = pkg.manifest["pipeline"]["decoder"]
    dec = chain[0]
    info = pkg.info(dec)
    model = pkg.graph(dec)
    g = model.graph
    source, sink = "inputs_embeds", "logits"
    kv_in = {i["name"]: C.layer_of(i["name"]) for i in info["inputs"] if C.layer_of(i["name"]) is not None}
    kv_out = {o["name"]: C.layer_of(o["name"]) for o in info["outputs"] if C.layer_of(o["name"]) is not None}
    shared_in = [i["name"] for i in info["inputs"] if i["name"] not in kv_in and i["name"] != source]
    cuts = C.residual_cuts(g, source, sink)

    boundary = {0: source, bounds[-1]: sink}
    for b in bounds[1:-1]:
        later = C.depends_on(g, {n for n, layer in kv_in.items() if layer >= b})
        earlier = C.depends_on(g, {n for n, layer in kv_in.items() if layer == b - 1})
        found = [c for c in cuts if c not in later and c in earlier]
        if not found:
            raise VlmcError(
                f"split: found no residual-stream tensor between layers {b - 1} and {b} of {dec}; "
                "the decoder does not have the standard layer structure"
            )
        boundary[b] = found[-1]
    facts = _shape_facts(model, {boundary[b] for b in bounds[1:-1]})
    for b in bounds[1:-1]:
        vi = facts.get(boundary[b]) or C.value_info(
            next(i for i in info["inputs"] if i["name"] == source), boundary[b]
        )
        g.value_info.append(vi)

    def hidden(b: int) -> str:
        return source if b == 0 else (sink if b == bounds[-1] else f"hidden_states.{b}")

    names = []
    try:
        for k, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
            own_in = [n for n, layer in kv_in.items() if a <= layer < z]
            own_out = [n for n, layer in kv_out.items() if a <= layer < z]
            outs = [boundary[z], *own_out] + (
                [o["name"] for o in info["outputs"] if o["name"] not in kv_out and o["name"] != sink]
                if z == bounds[-1]
                else []
            )
            allowed = {boundary[a], *own_in, *shared_in}
            reached = C.backward_reach(g, outs, allowed)
            foreign = sorted(reached - allowed)
            ins = [boundary[a]] + [n for n in shared_in + own_in if n in reached or n in own_in]
            where = f"split: {dec} layers {a}..{z - 1}"
            sub = C.extract(model, ins + foreign, outs, where)
            C.rename(sub.graph, {boundary[a]: hidden(a), boundary[z]: hidden(z)})
            _substitute_shape_inputs(sub, foreign, hidden(a), a, kv_in, where)
            name = f"{dec}.{k}"
            sub.graph.name = name
            pkg.set_graph(name, sub, role="decoder", precision=info["precision"], kv_layers=[a, z])
            names.append(name)
    finally:
        for b in bounds[1:-1]:  # the value_info added above belongs to the cut, not to the decoder
            vis = [v for v in g.value_info if v.name == boundary[b]]
            if vis:
                g.value_info.remove(vis[-1])
    pkg.remove_graph(dec)
    pkg.manifest["pipeline"]["decoder"] = names
    return {
        "graphs": names,
        "layers": [[a, z] for a, z in zip(bounds[:-1], bounds[1:])],
        "boundaries": {hidden(b): boundary[b] for b in bounds[1:-1]},
    }


def _substitute_shape_inputs(
    sub: onnx.ModelProto, foreign: list[str], hidden: str, first_layer: int, kv_in: dict[str, int], where: str
) -> None:
    """Rewire inputs a range reads only for their shape to same-shaped inputs the range owns.

    The traced causal mask takes the past length from layer 0's past key and the sequence length from
    ``inputs_embeds``; a later range owns neither, but its own first past key and its hidden-state
    input have exactly those shapes.
    """
    for f in foreign:
        if f in kv_in:
            target = _kv_renamed(f, first_layer)
        elif f == "inputs_embeds":
            target = hidden
        else:
            target = None
        if target is None or not C.only_shape_used(sub.graph, f):
            raise VlmcError(f"{where}: the range needs the values of {f!r}, which belongs to another range")
        for coll in (sub.graph.input, sub.graph.value_info):
            for v in [v for v in coll if v.name == f]:
                coll.remove(v)
        C.rename(sub.graph, {f: target})
