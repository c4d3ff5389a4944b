"""merge: compose the image chain, embedding and decoder into one prefill graph ``vlm``.

The merged graph takes ``input_ids``, the vision inputs (``pixel_values``, plus ``image_grid_thw`` where
the family has it), ``attention_mask``, ``position_ids`` and past KV, and returns ``logits`` and present
KV. Inside, the embedding lookup's rows at image placeholders are replaced by image features with
ATC-parseable ops (Equal, CumSum, Max, Gather, Where), so image features never leave the device.

Decode steps have no image, and the vision graphs cannot run on zero images (their patch Reshapes
fail on empty tensors in onnxruntime, and Ascend gears must be positive), so the text-only decode path
(``embed_tokens`` + ``decoder``) is kept beside ``vlm``. All three graphs store their weights in one
shared, content-deduplicated data file, so no weight byte is stored twice.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import onnx
from onnx import helper, numpy_helper

from vlmc import samples
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes import _graph_compose as C

logger = logging.getLogger(__name__)

SHARED_WEIGHTS_FILE = "weights.onnx.data"
# Manifest keys of a graph entry that describe the graph itself (recomputed or restored by split).
_OWN_KEYS = ("file", "role", "precision", "inputs", "outputs")


def is_merged(pkg: Package) -> str | None:
    """Name of the package's merged graph, if it has one."""
    name = pkg.manifest.get("pipeline", {}).get("vlm")
    return name if name else (pkg.graphs_with_role("vlm") or [None])[0]


@register
class Merge(Pass):
    """Compose vision (+ fusion), embedding and decoder into one graph; keep the text-only decode path."""

    name = "merge"
    requires = ("unsharded",)
    summary = (
        "compose vision (+fusion), embed_tokens and decoder into one prefill graph `vlm` "
        "(image features written into placeholder rows inside; weights stored once)"
    )
    options = (Option("graph", str, "vlm", "name of the merged graph"),)

    def check_package(self, package: Package) -> None:
        merged = is_merged(package)
        if merged:
            raise VlmcError(
                f"merge: the package is already merged (graph {merged!r}); run split first to change "
                "the stages, then merge again"
            )
        p = package.manifest["pipeline"]
        if not p.get("image"):
            raise VlmcError(
                "merge: the package has no image chain (pipeline.image is empty); there is nothing to "
                "merge into the decoder"
            )
        if not p.get("embed") or not p.get("decoder"):
            raise VlmcError("merge: the package pipeline needs an embed graph and a decoder chain")
        if self.opts["graph"] in package.manifest["graphs"]:
            raise VlmcError(
                f"merge: the package already has a graph named {self.opts['graph']!r}; "
                "choose another name with the graph option"
            )
        pruned = package.manifest["vision"].get("pruning") or {}
        if pruned.get("positions") == "original":
            # The kept tokens' positions come from the vision graph's indices output, which is internal
            # to the merged graph, so every run of the merged package would fail.
            raise VlmcError(
                f"merge: this pruned package computes {package.manifest['text'].get('position')} "
                f"positions from the vision graph's {pruned.get('indices_output')!r} output, which "
                "a merged graph hides; deploy the pruned package unmerged, or merge it unpruned"
            )

    def run(self, package: Package) -> PassResult:
        m = package.manifest
        pipeline = dict(m["pipeline"])
        image, embed, decoder = list(pipeline["image"]), pipeline["embed"], list(pipeline["decoder"])
        stages = [*image, embed, *decoder]
        models = {s: package.graph(s) for s in stages}
        _check_interfaces(package, image, embed, decoder)

        # Stage internals get a "<stage>/" prefix so their generated names cannot collide; the stage
        # interfaces keep their names, except the embedding output, which the scatter consumes.
        embed_out = f"{embed}/inputs_embeds"
        parts = {s: C.prefixed(models[s], f"{s}/") for s in stages}
        C.rename(parts[embed].graph, {"inputs_embeds": embed_out})

        # The merged outputs are the decoder chain's (logits and every range's presents), minus the
        # hidden states one decoder range hands to the next.
        consumed = {i.name for s in decoder for i in parts[s].graph.input}
        outputs = [o for s in decoder for o in parts[s].graph.output if o.name not in consumed]
        final = {o.name for o in outputs}
        produced: set[str] = set()
        graph_inputs: list[onnx.ValueInfoProto] = []
        nodes: list[onnx.NodeProto] = []
        inits: list[onnx.TensorProto] = []
        vinfo: list[onnx.ValueInfoProto] = []
        records = []
        fed_inside, deepstack_nodes = _deepstack_nodes(package, decoder)
        for s in stages:
            g = parts[s].graph
            init_names = {t.name for t in g.initializer}
            for vi in g.input:
                if vi.name in init_names or vi.name in produced or vi.name in {x.name for x in graph_inputs}:
                    continue
                if s == decoder[0] and vi.name == "inputs_embeds":
                    continue  # produced by the scatter below
                if s in decoder and vi.name in fed_inside:
                    continue  # deepstack inputs: produced inside, below
                graph_inputs.append(vi)
            if s == decoder[0]:
                nodes.extend(_scatter_nodes(package, embed_out, vinfo))
                nodes.extend(deepstack_nodes)
            nodes.extend(g.node)
            inits.extend(g.initializer)
            vinfo.extend(g.value_info)
            vinfo.extend(o for o in g.output if o.name not in final)  # other stage outputs become internal
            produced.update(o.name for o in g.output)
            entry = package.info(s)
            tensors = {"inputs_embeds": embed_out} if s == embed else {}
            records.append(
                {
                    "name": s,
                    "role": entry["role"],
                    "precision": entry["precision"],
                    "file": entry["file"],
                    "inputs": entry["inputs"],
                    "outputs": entry["outputs"],
                    "tensors": tensors,
                    "extra": {k: v for k, v in entry.items() if k not in _OWN_KEYS},
                }
            )
        graph = helper.make_graph(
            nodes, self.opts["graph"], graph_inputs, outputs, initializer=inits, value_info=_unique(vinfo)
        )
        dedupe = C.dedupe_initializers(graph)
        merged = helper.make_model(
            graph, opset_imports=C.merged_opsets(models.values(), "merge"), producer_name="vlmc merge"
        )
        merged.ir_version = max(mm.ir_version for mm in models.values())

        precisions = {package.info(s)["precision"] for s in stages}
        name = self.opts["graph"]
        sample = _sample_inputs(package, image, decoder)
        package.set_graph(
            name,
            merged,
            role="vlm",
            precision=precisions.pop() if len(precisions) == 1 else "mixed",
            stages=records,
            pipeline=pipeline,
            weights_file=SHARED_WEIGHTS_FILE,
        )
        for s in image:
            package.remove_graph(s)
        # The text-only decode path shares every weight with `vlm`; the shared data file stores it once.
        for s in (embed, *decoder):
            m["graphs"][s]["weights_file"] = SHARED_WEIGHTS_FILE
        m["pipeline"] = {"vlm": name, "embed": embed, "decoder": decoder}
        _store_samples(package, name, sample)
        logger.info(
            "merge: %s <- %s (%d initializers deduplicated)",
            name,
            " + ".join(stages),
            dedupe["initializers_deduplicated"],
        )
        return PassResult(
            package, True, {"graph": name, "stages": stages, "nodes": len(merged.graph.node), **dedupe}
        )


def _unique(infos: list[onnx.ValueInfoProto]) -> list[onnx.ValueInfoProto]:
    seen: dict[str, onnx.ValueInfoProto] = {}
    for vi in infos:
        seen.setdefault(vi.name, vi)
    return list(seen.values())


def _check_interfaces(pkg: Package, image: list[str], embed: str, decoder: list[str]) -> None:
    """The standard stage interfaces merge relies on (docs/architecture.md)."""

    def names(graph: str, io: str) -> list[str]:
        return [e["name"] for e in pkg.info(graph)[io]]

    if "image_features" not in names(image[-1], "outputs"):
        raise VlmcError(f"merge: the last image graph {image[-1]!r} has no image_features output")
    if names(embed, "inputs") != ["input_ids"] or names(embed, "outputs") != ["inputs_embeds"]:
        raise VlmcError(f"merge: embed graph {embed!r} must map input_ids -> inputs_embeds")
    if "inputs_embeds" not in names(decoder[0], "inputs"):
        raise VlmcError(f"merge: decoder graph {decoder[0]!r} has no inputs_embeds input")
    if "logits" not in names(decoder[-1], "outputs"):
        raise VlmcError(f"merge: decoder graph {decoder[-1]!r} has no logits output")


def _scatter_nodes(pkg: Package, embeds: str, vinfo: list[onnx.ValueInfoProto]) -> list[onnx.NodeProto]:
    """inputs_embeds = embedding rows, with placeholder rows replaced by image features in order.

    Placeholders are counted over the flattened batch (row-major), the order the image chain emits
    features in: the k-th placeholder takes feature row k. CumSum(mask) - 1 is that k; it is clamped at
    0 so text positions before the first placeholder gather a valid row, which Where then discards.
    """
    emb_sig = pkg.info(pkg.manifest["pipeline"]["embed"])["outputs"][0]
    hidden = emb_sig["shape"][-1]
    if not isinstance(hidden, int):
        hidden = int(pkg.manifest["text"]["hidden_size"])
    feats_sig = next(
        o for o in pkg.info(pkg.manifest["pipeline"]["image"][-1])["outputs"] if o["name"] == "image_features"
    )
    p = "vlm_scatter/"
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    consts = {
        "image_token_id": np.array(image_id, np.int64),
        "flat": np.array([-1], np.int64),
        "rows": np.array([-1, hidden], np.int64),
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "last_axis": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Constant", [], [p + k], name=p + "Constant_" + k, value=numpy_helper.from_array(v))
        for k, v in consts.items()
    ]
    feats = "image_features"
    if feats_sig["dtype"] != emb_sig["dtype"]:
        nodes.append(
            helper.make_node(
                "Cast",
                [feats],
                [p + "features_cast"],
                name=p + "Cast_features",
                to=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(emb_sig["dtype"])),
            )
        )
        feats = p + "features_cast"
    nodes += [
        helper.make_node("Reshape", ["input_ids", p + "flat"], [p + "ids"], name=p + "Reshape_ids"),
        helper.make_node("Equal", [p + "ids", p + "image_token_id"], [p + "is_image"], name=p + "Equal"),
        helper.make_node(
            "Cast", [p + "is_image"], [p + "is_image_i64"], name=p + "Cast_mask", to=onnx.TensorProto.INT64
        ),
        helper.make_node("CumSum", [p + "is_image_i64", p + "zero"], [p + "count"], name=p + "CumSum"),
        helper.make_node("Sub", [p + "count", p + "one"], [p + "index_raw"], name=p + "Sub"),
        helper.make_node("Max", [p + "index_raw", p + "zero"], [p + "index"], name=p + "Max"),
        helper.make_node("Reshape", [feats, p + "rows"], [p + "features"], name=p + "Reshape_features"),
        helper.make_node("Gather", [p + "features", p + "index"], [p + "picked"], name=p + "Gather", axis=0),
        helper.make_node("Reshape", [embeds, p + "rows"], [p + "embeds"], name=p + "Reshape_embeds"),
        helper.make_node(
            "Unsqueeze", [p + "is_image", p + "last_axis"], [p + "is_image_col"], name=p + "Unsqueeze"
        ),
        helper.make_node(
            "Where", [p + "is_image_col", p + "picked", p + "embeds"], [p + "mixed"], name=p + "Where"
        ),
        helper.make_node("Shape", [embeds], [p + "embeds_shape"], name=p + "Shape"),
        helper.make_node(
            "Reshape", [p + "mixed", p + "embeds_shape"], ["inputs_embeds"], name=p + "Reshape_out"
        ),
    ]
    vinfo.append(C.value_info(emb_sig, "inputs_embeds"))
    vinfo.append(C.value_info(emb_sig, embeds))
    return nodes


def _deepstack_nodes(pkg: Package, decoder: list[str]) -> tuple[set[str], list[onnx.NodeProto]]:
    """The decoder inputs a merged graph computes itself for ``text.deepstack`` (Qwen3-VL), and the nodes.

    ``mask_input`` marks the image placeholders of ``input_ids`` (int64, its shape) and ``embeds_input``
    is the image chain's ``vision_output``, cast to the decoder's input type; other packages: nothing.
    """
    ds = pkg.manifest["text"].get("deepstack")
    if not ds:
        return set(), []
    wanted = {i["name"]: i for s in decoder for i in pkg.info(s)["inputs"]}
    mask, embeds = ds["mask_input"], ds["embeds_input"]
    if embeds not in wanted:
        return set(), []
    p = "vlm_deepstack/"
    image_id = numpy_helper.from_array(np.array(int(pkg.manifest["vision"]["image_token_id"]), np.int64))
    to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(wanted[embeds]["dtype"]))
    nodes = [
        helper.make_node("Constant", [], [p + "image_token_id"], name=p + "Constant", value=image_id),
        helper.make_node("Equal", ["input_ids", p + "image_token_id"], [p + "is_image"], name=p + "Equal"),
        helper.make_node("Cast", [p + "is_image"], [mask], name=p + "Cast_mask", to=onnx.TensorProto.INT64),
        helper.make_node("Cast", [ds["vision_output"]], [embeds], name=p + "Cast_embeds", to=to),
    ]
    return {mask, embeds}, nodes


def _sample_inputs(pkg: Package, image: list[str], decoder: list[str]) -> dict[str, np.ndarray]:
    """Sample inputs for the merged graph: the vision samples, the decoder's, and ids with one placeholder."""
    feeds = dict(samples.inputs_for(pkg, image[0]))
    dec = samples.inputs_for(pkg, decoder[0])
    embeds = dec.get("inputs_embeds")
    batch, seq = embeds.shape[:2] if embeds is not None else (1, 5)
    rng = np.random.default_rng(0)
    vocab = int(pkg.manifest["text"]["vocab_size"])
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    ids = rng.integers(3, vocab, size=(batch, seq)).astype(np.int64)
    ids[ids == image_id] = 3
    ids[0, 0] = image_id  # one placeholder: valid for any image chain that yields at least one feature
    feeds["input_ids"] = ids
    feeds.update({k: v for k, v in dec.items() if k != "inputs_embeds"})
    return feeds


def _store_samples(pkg: Package, name: str, feeds: dict[str, np.ndarray]) -> None:
    wanted = {i["name"] for i in pkg.info(name)["inputs"]}
    feeds = {k: v for k, v in feeds.items() if k in wanted}  # e.g. decoder inputs computed inside
    # KV of later decoder ranges: the same shapes as the first range's (one past length for all layers)
    for w in sorted(wanted - set(feeds)):
        layer = C.layer_of(w)
        like = [
            k
            for k in sorted(feeds)
            if layer is not None
            and C.layer_of(k) is not None
            and re.sub(r"\.\d+(\.|$)", r".N\1", k, count=1) == re.sub(r"\.\d+(\.|$)", r".N\1", w, count=1)
        ]
        if like:
            feeds[w] = feeds[like[0]].copy()
    if set(feeds) == wanted:
        samples.store(pkg, name, feeds)
    else:
        logger.warning(
            "merge: no complete sample inputs for %s (missing %s); numerics checks will generate them",
            name,
            ", ".join(sorted(wanted - set(feeds))),
        )
