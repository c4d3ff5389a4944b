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

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import NameFixPass, RemoveUnusedNodesPass

from vlmc import samples, tensor_names
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes import _graph_compose as compose

logger = logging.getLogger(__name__)

SHARED_WEIGHTS_FILE = "weights.onnx.data"
# The [images, 3] (t, h, w) grid input of dynamic-resolution vision graphs (docs/architecture.md).
_GRID_INPUT = "image_grid_thw"
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

    def check_package(self, package: Package) -> dict:
        """Refuse what cannot be merged; the plan is the stages and the merged graph's opsets."""
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
        image, embed, decoder = list(p["image"]), p["embed"], list(p["decoder"])
        offsets = _position_plan(package, image, decoder)
        _check_interfaces(package, image, embed, decoder)
        stages = [*image, embed, *decoder]
        opsets = compose.merged_opsets([package.model(s) for s in stages], "merge")
        return {"image": image, "embed": embed, "decoder": decoder, "opsets": opsets, "positions": offsets}

    def run(self, package: Package, plan: dict | None = None) -> PassResult:
        plan = self.check_package(package) if plan is None else plan
        m = package.manifest
        pipeline = dict(m["pipeline"])
        image, embed, decoder, opsets = plan["image"], plan["embed"], plan["decoder"], plan["opsets"]
        stages = [*image, embed, *decoder]
        models = {s: package.model(s) for s in stages}
        name = self.opts["graph"]
        positions = plan.get("positions")
        merged = _compose(package, models, image, embed, decoder, name, opsets, positions)
        NameFixPass()(merged)  # unique names, whatever the stages called their values
        RemoveUnusedNodesPass()(merged)  # e.g. image-chain outputs only the stage package returned
        dedupe = compose.dedupe_initializers(merged.graph)

        records = []
        for s in stages:
            entry = package.info(s)
            records.append(
                {
                    "name": s,
                    "role": entry["role"],
                    "precision": entry["precision"],
                    "file": entry["file"],
                    "inputs": entry["inputs"],
                    "outputs": entry["outputs"],
                    "tensors": {tensor_names.INPUTS_EMBEDS: _embed_out(embed)} if s == embed else {},
                    "extra": {k: v for k, v in entry.items() if k not in _OWN_KEYS},
                }
            )
        precisions = {package.info(s)["precision"] for s in stages}
        sample = _sample_inputs(package, image, decoder)
        # A pruned M-RoPE package: the graph adds the kept tokens' (t, h, w) offsets to the position_ids
        # it is given and returns the positions it used (the runtime continues decode from them).
        facts = {"positions_output": tensor_names.PREFILL_POSITIONS} if positions else {}
        package.set_graph(
            name,
            merged,
            role="vlm",
            precision=precisions.pop() if len(precisions) == 1 else "mixed",
            stages=records,
            pipeline=pipeline,
            weights_file=SHARED_WEIGHTS_FILE,
            **facts,
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
            package, True, {"graph": name, "stages": stages, "nodes": len(merged.graph), **dedupe}
        )


def _embed_out(embed: str) -> str:
    # The one stage interface that is renamed inside the merged graph: the scatter consumes it.
    return f"{embed}/{tensor_names.INPUTS_EMBEDS}"


def _compose(
    pkg: Package,
    models: dict[str, ir.Model],
    image: list[str],
    embed: str,
    decoder: list[str],
    name: str,
    opsets: dict[str, int],
    positions: dict | None = None,
) -> ir.Model:
    """One graph from copies of the stage graphs, joined by their interface names.

    Each stage is copied (new nodes and values, the same weight tensors: the stage graphs stay as
    they are, for the text-only decode path and for anything holding the package as it was), its
    internals get a ``<stage>/`` prefix, and each stage input is bound to the value of that name an
    earlier stage returns, or becomes an input of the merged graph. The decoder's ``inputs_embeds``
    is bound to the scatter's output, its deepstack inputs (Qwen3-VL) to the nodes computing them, and
    (``positions``, a pruned M-RoPE package) its ``position_ids`` to the given positions plus the kept
    image tokens' offsets, which the merged graph also returns.
    """
    parts = {s: compose.copy_model(models[s]).graph for s in models}
    for s, g in parts.items():
        compose.prefix_internal(g, f"{s}/")
        _own_unknown_dims(g, f"{s}/")
    embed_outputs = [o for o in parts[embed].outputs if o.name == tensor_names.INPUTS_EMBEDS]
    for o in embed_outputs:
        o.name = _embed_out(embed)

    # The merged outputs are the decoder chain's (logits and every range's presents), minus the
    # hidden states one decoder range hands to the next.
    consumed = {v.name for s in decoder for v in parts[s].inputs}
    outputs = [o for s in decoder for o in parts[s].outputs if o.name not in consumed]
    available: dict[str, ir.Value] = {}  # interface name -> the merged graph's value
    inputs: list[ir.Value] = []
    nodes: list[ir.Node] = []
    initializers: list[ir.Value] = []
    inside: dict[str, ir.Value] = {}  # decoder inputs the merged graph computes itself
    given: dict[str, ir.Value] = {}  # merged-graph inputs those computations read in their place
    for s in [*image, embed, *decoder]:
        g = parts[s]
        if s == decoder[0]:
            scatter, embeds, slots = _scatter_nodes(pkg, available, _embed_out(embed))
            deepstack, fed = _deepstack_nodes(pkg, decoder, available)
            nodes += scatter + deepstack
            inside = {tensor_names.INPUTS_EMBEDS: embeds, **fed}
            if positions:
                offset, raw, used = _position_nodes(pkg, decoder, available, slots, positions)
                nodes += offset
                inside[tensor_names.POSITION_IDS] = used
                given[tensor_names.POSITION_IDS] = raw
                outputs.append(used)
        for v in list(g.inputs):
            if v.is_initializer():
                continue  # an input with a default stays an initializer
            bound = inside.get(v.name) if s in decoder else None
            if v.name in given and given[v.name] not in inputs:
                inputs.append(given[v.name])
                available[v.name] = given[v.name]
            if bound is None:
                bound = available.get(v.name)
            if bound is None:
                inputs.append(v)
                available[v.name] = v
            else:
                v.replace_all_uses_with(bound, replace_graph_outputs=True)
        stage_outputs = list(g.outputs)
        g.inputs.clear()
        g.outputs.clear()
        stage_inits = list(g.initializers.values())
        g.initializers.clear()
        initializers += stage_inits
        nodes += compose.take_nodes(g)
        for o in stage_outputs:
            available.setdefault(o.name, o)
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=initializers, opset_imports=opsets, name=name)
    return compose.model_like(graph, *models.values(), producer="vlmc merge")


def _own_unknown_dims(graph: ir.Graph, prefix: str) -> None:
    """Give the placeholder dims shape inference made up (``unk__N``) in one stage a name of its own.

    Each stage's inference numbers them from 1 (e.g. float16 conversion), so two stages' ``unk__1`` may be
    different sizes; in one graph onnxruntime's memory planner would take them for the same size.
    """
    for node in graph:
        for value in node.outputs:
            if value.shape is None or not any(str(d).startswith("unk__") for d in value.shape):
                continue
            dims = [
                ir.SymbolicDim(prefix + str(d))
                if isinstance(d, ir.SymbolicDim) and str(d).startswith("unk__")
                else d
                for d in value.shape
            ]
            value.shape = ir.Shape(dims)


def _check_interfaces(pkg: Package, image: list[str], embed: str, decoder: list[str]) -> None:
    """The standard stage interfaces merge relies on (docs/architecture.md)."""

    def names(graph: str, io: str) -> list[str]:
        return [e["name"] for e in pkg.info(graph)[io]]

    if tensor_names.IMAGE_FEATURES not in names(image[-1], "outputs"):
        raise VlmcError(f"merge: the last image graph {image[-1]!r} has no image_features output")
    if names(embed, "inputs") != [tensor_names.INPUT_IDS] or names(embed, "outputs") != [
        tensor_names.INPUTS_EMBEDS
    ]:
        raise VlmcError(f"merge: embed graph {embed!r} must map input_ids -> inputs_embeds")
    if tensor_names.INPUTS_EMBEDS not in names(decoder[0], "inputs"):
        raise VlmcError(f"merge: decoder graph {decoder[0]!r} has no inputs_embeds input")
    if tensor_names.LOGITS not in names(decoder[-1], "outputs"):
        raise VlmcError(f"merge: decoder graph {decoder[-1]!r} has no logits output")


class _Nodes:
    """Nodes built in order, each output named (``<prefix><name>``), for a block of the merged graph."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs: list[ir.Value], out: str, node: str, **attributes) -> ir.Value:
        n = ir.node(op_type, inputs, attributes=attributes or None, name=self.prefix + node)
        n.outputs[0].name = self.prefix + out
        self.nodes.append(n)
        return n.outputs[0]

    def const(self, key: str, value: np.ndarray) -> ir.Value:
        return self.op("Constant", [], key, "Constant_" + key, value=ir.tensor(value, name=self.prefix + key))


def _scatter_nodes(
    pkg: Package, available: dict[str, ir.Value], embeds_name: str
) -> tuple[list[ir.Node], ir.Value, dict[str, ir.Value]]:
    """inputs_embeds = embedding rows, with placeholder rows replaced by image features in order.

    Also returns the flattened placeholder mask and feature-row index (``is_image``, ``index``: [batch*seq]),
    which the position block reuses.

    Placeholders are counted over the flattened batch (row-major), the order the image chain emits
    features in: the k-th placeholder takes feature row k. CumSum(mask) - 1 is that k; it is clamped at
    0 so text positions before the first placeholder gather a valid row, which Where then discards.
    """
    emb_sig = pkg.info(pkg.manifest["pipeline"]["embed"])["outputs"][0]
    hidden = emb_sig["shape"][-1]
    if not isinstance(hidden, int):
        hidden = int(pkg.manifest["text"]["hidden_size"])
    feats_sig = next(
        o
        for o in pkg.info(pkg.manifest["pipeline"]["image"][-1])["outputs"]
        if o["name"] == tensor_names.IMAGE_FEATURES
    )
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    b = _Nodes("vlm_scatter/")
    c = {
        k: b.const(k, v)
        for k, v in {
            "image_token_id": np.array(image_id, np.int64),
            "flat": np.array([-1], np.int64),
            "rows": np.array([-1, hidden], np.int64),
            "zero": np.array(0, np.int64),
            "one": np.array(1, np.int64),
            "last_axis": np.array([-1], np.int64),
        }.items()
    }
    feats = available[tensor_names.IMAGE_FEATURES]
    if feats_sig["dtype"] != emb_sig["dtype"]:
        to = ir.DataType.from_numpy(np.dtype(emb_sig["dtype"]))
        feats = b.op("Cast", [feats], "features_cast", "Cast_features", to=int(to))
    embeds = available[embeds_name]
    compose.set_signature(embeds, emb_sig)
    ids = b.op("Reshape", [available[tensor_names.INPUT_IDS], c["flat"]], "ids", "Reshape_ids")
    is_image = b.op("Equal", [ids, c["image_token_id"]], "is_image", "Equal")
    mask = b.op("Cast", [is_image], "is_image_i64", "Cast_mask", to=int(ir.DataType.INT64))
    count = b.op("CumSum", [mask, c["zero"]], "count", "CumSum")
    index_raw = b.op("Sub", [count, c["one"]], "index_raw", "Sub")
    index = b.op("Max", [index_raw, c["zero"]], "index", "Max")
    rows = b.op("Reshape", [feats, c["rows"]], "features", "Reshape_features")
    picked = b.op("Gather", [rows, index], "picked", "Gather", axis=0)
    flat = b.op("Reshape", [embeds, c["rows"]], "embeds", "Reshape_embeds")
    column = b.op("Unsqueeze", [is_image, c["last_axis"]], "is_image_col", "Unsqueeze")
    mixed = b.op("Where", [column, picked, flat], "mixed", "Where")
    shape = b.op("Shape", [embeds], "embeds_shape", "Shape")
    out = b.op("Reshape", [mixed, shape], tensor_names.INPUTS_EMBEDS, "Reshape_out")
    out.name = tensor_names.INPUTS_EMBEDS  # the decoder's input, computed here
    compose.set_signature(out, emb_sig)
    return b.nodes, out, {"is_image": is_image, "index": index}


def _position_plan(pkg: Package, image: list[str], decoder: list[str]) -> dict | None:
    """What the merged graph needs to place a pruned package's kept tokens at their original positions.

    A pruned M-RoPE package (``vision.pruning.positions`` "original") gives each kept token the (t, h, w)
    position it had before pruning, picked by the vision graph's kept indices. Those indices exist only
    inside a merged graph, so the graph adds them to the positions itself; None for other packages.
    """
    pruned = pkg.manifest["vision"].get("pruning") or {}
    if pruned.get("positions") != "original":
        return None
    where = "merge: a pruned package with original positions"
    indices = pruned.get("indices_output")
    if indices not in [o["name"] for o in pkg.info(image[-1])["outputs"]]:
        raise VlmcError(f"{where} needs the last image graph {image[-1]!r} to output {indices!r}")
    grid = next((i for s in image for i in pkg.info(s)["inputs"] if i["name"] == _GRID_INPUT), None)
    if grid is None:
        raise VlmcError(f"{where} needs the image grid input {_GRID_INPUT!r} to place the kept tokens")
    pos = next((i for i in pkg.info(decoder[0])["inputs"] if i["name"] == tensor_names.POSITION_IDS), None)
    if pos is None or len(pos["shape"]) != 3:
        raise VlmcError(f"{where} needs the decoder's [axes, batch, seq] {tensor_names.POSITION_IDS!r} input")
    return {
        "indices": indices,
        "grid": _GRID_INPUT,
        "keep": int(pruned["keep"]),
        "merge": int(pkg.manifest["vision"].get("spatial_merge_size", 1) or 1),
        "signature": pos,
    }


def _position_nodes(
    pkg: Package, decoder: list[str], available: dict[str, ir.Value], slots: dict, plan: dict
) -> tuple[list[ir.Node], ir.Value, ir.Value]:
    """position_ids (the runtime's, each kept token at its image's start) + the kept tokens' offsets.

    Feature row r of the scatter is kept token r % k of image r // k, whose index into its image's merged
    (t, h/merge, w/merge) grid is ``local``; its offset is (local // hw, local % hw // w, local % w) with
    hw = h·w of the merged grid, on the placeholder rows only. Integer Div/Mul/Sub only (ATC parses them).
    Returns the nodes, the new ``position_ids`` input and the positions the decoder gets (an output too).
    """
    b = _Nodes("vlm_positions/")
    c = {
        k: b.const(k, v)
        for k, v in {
            "flat": np.array([-1], np.int64),
            "keep": np.array(plan["keep"], np.int64),
            "merge": np.array(plan["merge"], np.int64),
            "t": np.array(0, np.int64),
            "h": np.array(1, np.int64),
            "w": np.array(2, np.int64),
            "axis0": np.array([0], np.int64),
            "zero": np.array(0, np.int64),
        }.items()
    }
    raw = ir.Value(name=tensor_names.POSITION_IDS)
    compose.set_signature(raw, plan["signature"])
    grid = available[plan["grid"]]
    if grid.dtype != ir.DataType.INT64:
        grid = b.op("Cast", [grid], "grid_i64", "Cast_grid", to=int(ir.DataType.INT64))
    kept = b.op("Reshape", [available[plan["indices"]], c["flat"]], "kept", "Reshape_kept")
    local = b.op("Gather", [kept, slots["index"]], "local", "Gather_local", axis=0)
    which = b.op("Div", [slots["index"], c["keep"]], "image", "Div_image")
    rows = b.op("Gather", [grid, which], "grid_rows", "Gather_grid", axis=0)  # [batch*seq, 3]

    def side(axis: str) -> ir.Value:
        full = b.op("Gather", [rows, c[axis]], f"{axis}_full", f"Gather_{axis}", axis=1)
        return full if axis == "t" else b.op("Div", [full, c["merge"]], f"{axis}_merged", f"Div_{axis}")

    h, w = side("h"), side("w")
    hw = b.op("Mul", [h, w], "hw", "Mul_hw")
    tt = b.op("Div", [local, hw], "tt", "Div_tt")
    rest = b.op("Sub", [local, b.op("Mul", [tt, hw], "tt_hw", "Mul_tt")], "rest", "Sub_rest")
    hh = b.op("Div", [rest, w], "hh", "Div_hh")
    ww = b.op("Sub", [rest, b.op("Mul", [hh, w], "hh_w", "Mul_hh")], "ww", "Sub_ww")
    axes = [
        b.op("Unsqueeze", [x, c["axis0"]], f"{n}_row", f"Unsqueeze_{n}")
        for n, x in (("t", tt), ("h", hh), ("w", ww))
    ]
    offset = b.op("Concat", axes, "offset", "Concat_offset", axis=0)  # [3, batch*seq]
    mask = b.op("Unsqueeze", [slots["is_image"], c["axis0"]], "is_image_row", "Unsqueeze_mask")
    offset = b.op("Where", [mask, offset, c["zero"]], "offset_images", "Where_offset")
    offset = b.op(
        "Reshape", [offset, b.op("Shape", [raw], "shape", "Shape")], "offset_shaped", "Reshape_offset"
    )
    used = b.op("Add", [raw, offset], tensor_names.PREFILL_POSITIONS, "Add")
    used.name = tensor_names.PREFILL_POSITIONS
    compose.set_signature(used, plan["signature"])
    return b.nodes, raw, used


def _deepstack_nodes(
    pkg: Package, decoder: list[str], available: dict[str, ir.Value]
) -> tuple[list[ir.Node], dict[str, ir.Value]]:
    """The decoder inputs a merged graph computes itself for ``text.deepstack`` (Qwen3-VL), and the nodes.

    ``mask_input`` marks the image placeholders of ``input_ids`` (int64, its shape) and ``embeds_input``
    is the image chain's ``vision_output``, cast to the decoder's input type; other packages: nothing.
    """
    ds = pkg.manifest["text"].get("deepstack")
    if not ds:
        return [], {}
    wanted = {i["name"]: i for s in decoder for i in pkg.info(s)["inputs"]}
    mask, embeds = ds["mask_input"], ds["embeds_input"]
    if embeds not in wanted:
        return [], {}
    b = _Nodes("vlm_deepstack/")
    image_id = b.op(
        "Constant",
        [],
        "image_token_id",
        "Constant",
        value=ir.tensor(
            np.array(int(pkg.manifest["vision"]["image_token_id"]), np.int64),
            name="vlm_deepstack/image_token_id",
        ),
    )
    is_image = b.op("Equal", [available[tensor_names.INPUT_IDS], image_id], "is_image", "Equal")
    mask_value = b.op("Cast", [is_image], mask, "Cast_mask", to=int(ir.DataType.INT64))
    to = ir.DataType.from_numpy(np.dtype(wanted[embeds]["dtype"]))
    embeds_value = b.op("Cast", [available[ds["vision_output"]]], embeds, "Cast_embeds", to=int(to))
    for value, entry in ((mask_value, wanted[mask]), (embeds_value, wanted[embeds])):
        value.name = entry["name"]
        compose.set_signature(value, entry)
    return b.nodes, {mask: mask_value, embeds: embeds_value}


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
        if tensor_names.layer_of(w) is None:
            continue
        like = [
            k
            for k in sorted(feeds)
            if tensor_names.layer_of(k) is not None
            and tensor_names.with_layer(k, 0) == tensor_names.with_layer(w, 0)
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
