"""prune_visual_tokens: keep the k most useful visual tokens per image, as a static graph rewrite.

The vision graph gains ``scores -> TopK(k) -> indices sorted ascending -> GatherElements`` on
``image_features`` (after the projector) and a second output ``image_token_indices`` [images, k].
k is fixed, so every shape stays static and only ops ATC parses are used. The manifest's
``vision.tokens_per_image`` becomes k, so the runtime emits k placeholders per image and the LLM
never computes the dropped tokens.

Scores (``method``):
- ``cls_attention``: the CLS token's attention to each patch at the feature layer, mean over heads
  (FasterVLM); needs a CLS query (``vision.attention.query_index``).
- ``attention_received``: the mean attention each patch receives at the recorded layer, averaged
  over heads and queries and grouped by the spatial merge (encoders without CLS, e.g. Qwen2-VL).
A token that pools patches (``vision.attention.groups``: InternVL's pixel shuffle, Gemma3's pool) scores
the mean of its group's patches.
- ``uniform`` (bin centres, a fixed stride) and ``random`` (seeded): baselines with constant indices.

Attention comes from the tensors the exporter recorded in ``vision.attention``: the Softmax output
when the graph exposes it, else (or with ``recompute_attention``) a side branch recomputing that
attention from the layer's Q and Kᵀ.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from vlmc import limits
from vlmc.errors import VlmcError
from vlmc.pass_api import Option, Pass, PassResult, register

from . import measure

logger = logging.getLogger(__name__)

METHODS = ("cls_attention", "attention_received", "uniform", "random")
BASELINES = ("uniform", "random")
FEATURES = "image_features"
# The [images, 3] grid input that says how packed image tokens split into images (architecture interface).
GRID_INPUT = "image_grid_thw"
# Bound on tokens per image for the packed random baseline's score table (256 KiB of float32).
MAX_PACKED_TOKENS = 1 << 16
PREFIX = "prune_visual_tokens"


def uniform_indices(tokens: int, keep: int) -> np.ndarray:
    """Bin centres: token floor((i + 0.5) · tokens / keep) for i < keep, in integer arithmetic."""
    return ((2 * np.arange(keep, dtype=np.int64) + 1) * tokens) // (2 * keep)


def random_indices(tokens: int, keep: int, seed: int) -> np.ndarray:
    """The k tokens with the highest seeded random score, in ascending order.

    The score of token j is ``random_table(seed)[j]``, so an image of any size gets a seeded subset
    (what the packed layout computes in the graph) and batched images get the same one.
    """
    table = random_table(seed, tokens)
    return np.sort(np.argsort(-table[:tokens], kind="stable")[:keep]).astype(np.int64)


def keep_count(opts: dict, tokens: int) -> int:
    """k from ``keep`` or ``ratio`` (rounded, at least 1)."""
    if opts.get("keep") is not None:
        return int(opts["keep"])
    return max(1, int(round(float(opts["ratio"]) * tokens)))


def random_table(seed: int, size: int) -> np.ndarray:
    """Seeded per-position random scores in [0, 1)."""
    return np.random.default_rng(seed).random(size).astype(np.float32)


class _Builder:
    """Appends nodes and constants to an onnx-ir graph (through a tape), in the graph's opset.

    Every node goes at the end of the graph, after the producers of the tensors it reads, so the
    graph stays in topological order. The nodes made are remembered for the report's ``ops_added``.
    """

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.tape = ir.tape.Tape(graph)
        self.prefix = prefix
        self.opset = int(graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1)))
        self._count = 0

    def _name(self, what: str) -> str:
        self._count += 1
        return f"{self.prefix}/{what}_{self._count}"

    def added_ops(self) -> list[str]:
        """Op types of the nodes this builder made that are still in the graph."""
        made = set(self.tape.nodes)
        return sorted({node.op_type for node in self.graph if node in made})

    def const(self, value, dtype=np.int64) -> ir.Value:
        name = self._name("const")
        return self.tape.initializer(ir.tensor(np.asarray(value, dtype=dtype), name=name), name=name)

    def op(self, op: str, inputs: list, attrs: dict | None = None, outputs: int = 1) -> list[ir.Value]:
        name = self._name(op)
        values = self.tape.op_multi_out(op, inputs, attrs or None, num_outputs=outputs, name=name)
        for i, value in enumerate(values):
            value.name = f"{name}_out{i}"
        return list(values)

    def one(self, op: str, inputs: list, attrs: dict | None = None) -> ir.Value:
        return self.op(op, inputs, attrs)[0]

    def reduce(self, op: str, x: ir.Value, axes: list[int], keepdims: int = 0) -> ir.Value:
        # Reduce* ops take axes as an attribute up to opset 17 and as an input from opset 18.
        if self.opset >= 18:
            return self.one(op, [x, self.const(axes)], {"keepdims": keepdims})
        return self.one(op, [x], {"axes": axes, "keepdims": keepdims})

    def reduce_mean(self, x: ir.Value, axes: list[int], keepdims: int = 0) -> ir.Value:
        return self.reduce("ReduceMean", x, axes, keepdims)

    def unsqueeze(self, x: ir.Value, axes: list[int]) -> ir.Value:
        return self.one("Unsqueeze", [x, self.const(axes)])

    def slice(self, x: ir.Value, start: int, end: int, axis: int) -> ir.Value:
        return self.one("Slice", [x, self.const([start]), self.const([end]), self.const([axis])])


def _attention(b: _Builder, tensors: dict, att: dict, method: str, recompute: bool) -> tuple[ir.Value, str]:
    """[batch, heads, keys] attention for scoring, and where it came from ('graph' or 'recomputed')."""
    probs = tensors.get(att.get("probs") or "")
    if probs is not None and not recompute:
        if method == "cls_attention":
            return b.one("Gather", [probs, b.const(int(att["query_index"]))], {"axis": -2}), "graph"
        return b.reduce_mean(probs, [-2]), "graph"  # mean over queries
    q, kt = tensors.get(att.get("query") or ""), tensors.get(att.get("key_t") or "")
    if q is None or kt is None:
        raise VlmcError(
            "the vision graph exposes neither the attention probabilities nor the layer's Q and K named in "
            "vision.attention; re-export the package or use method uniform/random"
        )
    if method == "cls_attention":
        qi = int(att["query_index"])
        q = b.slice(q, qi, qi + 1, axis=-2)
    elif att.get("masked"):
        raise VlmcError(
            "the scoring attention is masked, so it cannot be recomputed from Q and K alone; "
            "keep the exported attention (recompute_attention: false)"
        )
    s = b.one("MatMul", [q, kt])
    s = b.one("Mul", [s, b.const(np.float32(att.get("scale", 1.0)), np.float32)])
    p = b.one("Softmax", [s], {"axis": -1})
    if method == "cls_attention":
        return b.one("Gather", [p, b.const(0)], {"axis": -2}), "recomputed"
    return b.reduce_mean(p, [-2]), "recomputed"


def _head_mean(b: _Builder, a: ir.Value) -> ir.Value:
    # [.., heads, keys] -> [.., keys]: heads are axis -2 once the query axis is gone.
    return b.reduce_mean(a, [-2])


def _scores(
    b: _Builder, tensors: dict, att: dict, method: str, tokens: int, recompute: bool
) -> tuple[ir.Value, str]:
    """Batched layout: [images, tokens] scores (per-image key columns of the feature tokens, merge-group mean)."""
    a, source = _attention(b, tensors, att, method, recompute)
    a = _head_mean(b, a)
    keys = int(att["keys_per_image"])
    group = int(att.get("merge_group", 1) or 1)
    offset = int(att.get("token_offset", 0))
    a = b.one("Reshape", [a, b.const([-1, keys])])
    if att.get("groups"):
        # each token pools a group of patches that need not be consecutive (InternVL's pixel shuffle,
        # Gemma3's average pool): its score is the mean over the group's key columns
        columns = np.asarray(att["groups"], np.int64).reshape(-1, int(att["group_size"])) + offset
        return b.reduce_mean(b.one("Gather", [a, b.const(columns)], {"axis": 1}), [2]), source
    a = b.slice(a, offset, offset + tokens * group, axis=1)
    if group > 1:
        a = b.one("Reshape", [a, b.const([-1, tokens, group])])
        a = b.reduce_mean(a, [2])
    return a, source


def _packed_scores(
    b: _Builder, tensors: dict, att: dict, method: str, recompute: bool
) -> tuple[ir.Value, str]:
    """Packed layout: [all image tokens] scores (all images' patches on one axis, merge-group mean)."""
    a, source = _attention(b, tensors, att, method, recompute)
    a = b.one("Reshape", [_head_mean(b, a), b.const([-1])])
    group = int(att.get("merge_group", 1) or 1)
    if group > 1:
        a = b.reduce_mean(b.one("Reshape", [a, b.const([-1, group])]), [1])
    return a, source


def _sorted_topk(b: _Builder, scores: ir.Value, keep: int) -> ir.Value:
    """Indices of the k best scores per row, in ascending order (int64 [rows, k])."""
    _, top = b.op("TopK", [scores, b.const([keep])], {"axis": 1, "largest": 1, "sorted": 1}, outputs=2)
    # Sorting the k indices restores the original token order (what the LLM was trained on);
    # int32 because TopK kernels on Ascend take int32, not int64.
    top32 = b.one("Cast", [top], {"to": int(ir.DataType.INT32)})
    ordered, _ = b.op("TopK", [top32, b.const([keep])], {"axis": 1, "largest": 0, "sorted": 1}, outputs=2)
    return b.one("Cast", [ordered], {"to": int(ir.DataType.INT64)})


def _batched(b: _Builder, x, method, keep, tokens, attention, seed, recompute, tensors) -> tuple:
    """x [images, tokens, hidden] -> (kept [images, k, hidden], indices [images, k], score source)."""
    if method in BASELINES:
        idx = uniform_indices(tokens, keep) if method == "uniform" else random_indices(tokens, keep, seed)
        kept = b.one("Gather", [x, b.const(idx)], {"axis": 1})
        n_img = b.one("Shape", [x], {"start": 0, "end": 1})
        shape = b.one("Concat", [n_img, b.const([keep])], {"axis": 0})
        return kept, b.one("Expand", [b.const(idx[None, :]), shape]), "constant"
    scores, source = _scores(b, tensors, attention, method, tokens, recompute)
    indices = _sorted_topk(b, scores, keep)
    gidx = b.unsqueeze(indices, [2])
    hid = b.one("Shape", [x], {"start": 2, "end": 3})
    shape = b.one("Concat", [b.one("Shape", [indices]), hid], {"axis": 0})
    gidx = b.one("Expand", [gidx, shape])
    return b.one("GatherElements", [x, gidx], {"axis": 1}), indices, source


def _packed(b: _Builder, x, method, keep, packed, attention, seed, recompute, tensors) -> tuple:
    """x [all image tokens, hidden], images told apart by the grid input -> ([images*k, hidden], [images, k], source).

    Each image's tokens are a contiguous run whose length is prod(grid)/group. Per image, scores
    outside its run are masked to -1 (every score is >= 0), so one TopK over [images, all tokens]
    keeps shapes static for any resolution and image count.
    """
    grid = tensors.get(packed["grid_input"])
    if grid is None:
        raise VlmcError(
            f"the vision graph has no {packed['grid_input']!r} input to split packed image tokens"
        )
    n = b.one("Div", [b.reduce("ReduceProd", grid, [1]), b.const(int(packed["group"]))])  # tokens per image
    ends = b.one("CumSum", [n, b.const(0)])
    starts = b.unsqueeze(b.one("Sub", [ends, n]), [1])  # [images, 1]
    if method == "uniform":
        # floor((2i + 1) * n / 2k), exact in integers
        centres = b.one("Mul", [b.unsqueeze(n, [1]), b.const((2 * np.arange(keep) + 1)[None, :])])
        local = b.one("Div", [centres, b.const(2 * keep)])
        flat = b.one("Reshape", [b.one("Add", [local, starts]), b.const([-1])])
        return b.one("Gather", [x, flat], {"axis": 0}), local, "constant"
    total = b.one("Shape", [x], {"start": 0, "end": 1})
    pos = b.one("Range", [b.const(0), b.one("Squeeze", [total, b.const([0])]), b.const(1)])
    loc = b.one("Sub", [b.unsqueeze(pos, [0]), starts])  # [images, all tokens]
    inside = b.one(
        "And",
        [b.one("GreaterOrEqual", [loc, b.const(0)]), b.one("Less", [loc, b.unsqueeze(n, [1])])],
    )
    if method == "random":
        size = int(packed["max_tokens"])
        table = b.const(random_table(seed, size), np.float32)
        clipped = b.one("Clip", [loc, b.const(0), b.const(size - 1)])
        scores, source = b.one("Gather", [table, clipped], {"axis": 0}), "constant"
    else:
        flat, source = _packed_scores(b, tensors, attention, method, recompute)
        scores = b.unsqueeze(flat, [0])
    scores = b.one("Where", [inside, scores, b.const(np.float32(-1.0), np.float32)])
    indices = _sorted_topk(b, scores, keep)  # positions on the packed axis
    kept = b.one("Gather", [x, b.one("Reshape", [indices, b.const([-1])])], {"axis": 0})
    return kept, b.one("Sub", [indices, starts]), source


def _token_table(b: _Builder, x, method, keep, packed, attention, seed, recompute, tensors) -> tuple:
    """Tokens gathered from a per-tile feature table (``packed["table"]``: LLaVA-NeXT / OneVision's anyres,
    Phi-3-vision's HD crops).

    x is [all image tokens, hidden], image after image. Output token t reads table rows ``index[t]`` (mixed
    with ``weight[t]`` when the table names a weight input, anyres' bilinear downscale); image i's tiles
    start at table row i·tiles·tile_tokens, its first output token is the only one at row
    i·tiles·tile_tokens + ``first_row`` (anyres: the base tile's first token; HD crops: the first crop's,
    after the global image's tile), and the table ends in ``separator_rows`` learned rows (anyres:
    image_newline; HD crops: sub_GN, glb_GN). Per image, every separator token is kept (the rows stay rows)
    and the k − separators best content tokens, all in their original order: k tokens per image.
    """
    t = packed["table"]
    index, pixels = tensors.get(t["index_input"]), tensors.get(t["pixels_input"])
    weight = tensors.get(t["weight_input"]) if t.get("weight_input") else None
    if index is None or pixels is None or (t.get("weight_input") and weight is None):
        raise VlmcError("the vision graph lacks the token-table inputs named in vision.token_table")
    per_tile = int(t["tile_tokens"])
    n_img = b.one("Shape", [pixels], {"start": 0, "end": 1})
    stride = b.one("Mul", [b.one("Shape", [pixels], {"start": 1, "end": 2}), b.const([per_tile])])
    separator_row = b.one("Mul", [n_img, stride])  # the first of the table's separator rows
    # [tokens]: each token's (first) table row
    first = b.one("Squeeze", [b.slice(index, 0, 1, axis=1), b.const([1])]) if weight is not None else index
    is_nl = b.one("GreaterOrEqual", [first, separator_row])
    rem = b.one("Sub", [first, b.one("Mul", [b.one("Div", [first, stride]), stride])])
    start_row = b.const(int(t.get("first_row", 0)))
    is_start = b.one("And", [b.one("Equal", [rem, start_row]), b.one("Not", [is_nl])])
    which = b.one(
        "Sub",
        [
            b.one("CumSum", [b.one("Cast", [is_start], {"to": int(ir.DataType.INT64)}), b.const(0)]),
            b.const(1),
        ],
    )
    images = b.one("Range", [b.const(0), b.one("Squeeze", [n_img, b.const([0])]), b.const(1)])
    member = b.one("Equal", [b.unsqueeze(images, [1]), b.unsqueeze(which, [0])])  # [images, tokens]
    line = b.one("And", [member, b.unsqueeze(is_nl, [0])])
    content = b.one("And", [member, b.one("Not", [line])])

    def count(mask: ir.Value) -> ir.Value:  # per image, [images, 1]
        ones = b.one("Cast", [mask], {"to": int(ir.DataType.INT64)})
        if b.opset >= 13:  # ReduceSum takes its axes as an input from opset 13 (the others from 18)
            return b.one("ReduceSum", [ones, b.const([1])], {"keepdims": 1})
        return b.one("ReduceSum", [ones], {"axes": [1], "keepdims": 1})

    def running(mask: ir.Value) -> ir.Value:  # the index of each masked token among its image's masked ones
        return b.one(
            "Sub",
            [
                b.one("CumSum", [b.one("Cast", [mask], {"to": int(ir.DataType.INT64)}), b.const(1)]),
                b.const(1),
            ],
        )

    local = running(member)
    cloc = running(content)
    slots = b.one("Max", [b.one("Sub", [b.const(keep), count(line)]), b.const(1)])  # k - rows content tokens
    m = b.one("Max", [count(content), b.const(1)])
    if method == "uniform":
        # content token c is a bin centre floor((2j+1)·m / 2k') for j = (2k'c + m - 1) div 2m, if j < k'
        two_k = b.one("Mul", [slots, b.const(2)])
        j = b.one(
            "Div",
            [
                b.one(
                    "Add",
                    [b.one("Mul", [two_k, b.one("Max", [cloc, b.const(0)])]), b.one("Sub", [m, b.const(1)])],
                ),
                b.one("Mul", [m, b.const(2)]),
            ],
        )
        centre = b.one(
            "Div", [b.one("Mul", [b.one("Add", [b.one("Mul", [j, b.const(2)]), b.const(1)]), m]), two_k]
        )
        hit = b.one("And", [b.one("Equal", [centre, cloc]), b.one("Less", [j, slots])])
        scores, source = b.one("Cast", [hit], {"to": int(ir.DataType.FLOAT)}), "constant"
    elif method == "random":
        size = int(packed["max_tokens"])
        table = b.const(random_table(seed, size), np.float32)
        scores = b.one("Gather", [table, b.one("Clip", [cloc, b.const(0), b.const(size - 1)])], {"axis": 0})
        source = "constant"
    else:
        a, source = _attention(b, tensors, attention, method, recompute)
        a = b.one("Reshape", [_head_mean(b, a), b.const([-1, int(attention["keys_per_image"])])])
        offset = int(attention.get("token_offset", 0))
        if attention.get("groups"):
            # a table row pools a group of patches (HD crops' 2 x 2 merge): the mean of their key columns
            columns = np.asarray(attention["groups"], np.int64).reshape(-1, int(attention["group_size"]))
            a = b.reduce_mean(b.one("Gather", [a, b.const(columns + offset)], {"axis": 1}), [2])
        else:
            a = b.slice(a, offset, offset + per_tile, axis=1)
        a = b.one("Reshape", [a, b.const([-1])])
        separators = int(t.get("separator_rows", 1))
        a = b.one("Concat", [a, b.const([0.0] * separators, np.float32)], {"axis": 0})  # the separator rows
        g = b.one("Gather", [a, index], {"axis": 0})
        if weight is None:
            scores = b.unsqueeze(g, [0])
        else:
            # each token's score mixes its table rows' scores as the token mixes their features
            g = b.one("Mul", [g, weight])
            w = [b.one("Squeeze", [b.slice(g, i, i + 1, axis=1), b.const([1])]) for i in range(4)]
            scores = b.unsqueeze(b.one("Add", [b.one("Add", [w[0], w[1]]), b.one("Add", [w[2], w[3]])]), [0])
    # every score is in [0, 1]: separators (2) always win, tokens of other images (-1) never do
    scores = b.one("Where", [content, scores, b.const(np.float32(-1.0), np.float32)])
    scores = b.one("Where", [line, b.const(np.float32(2.0), np.float32), scores])
    indices = _sorted_topk(b, scores, keep)  # positions on the packed axis [images, k]
    kept = b.one("Gather", [x, b.one("Reshape", [indices, b.const([-1])])], {"axis": 0})
    return kept, b.one("GatherElements", [local, indices], {"axis": 1}), source


def _output(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((o for o in graph.outputs if o.name == name), None)


def _replace_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    for i, value in enumerate(graph.outputs):
        if value is old:
            graph.outputs[i] = new


def rewrite(
    model: ir.Model,
    method: str,
    keep: int,
    tokens: int | None,
    attention: dict | None = None,
    seed: int = 0,
    recompute: bool = False,
    packed: dict | None = None,
    aligned: dict[str, int] | None = None,
) -> tuple[ir.Model, dict]:
    """Return a new vision graph that outputs only ``keep`` feature tokens per image.

    ``model`` is not changed: the rewrite edits a clone, which shares the weight tensors with it
    (``ir.Model.clone`` copies nodes and values, never tensor bytes, so memory-mapped weights are
    not read). A package snapshot that still holds ``model`` keeps seeing the unpruned graph.

    Args:
        model: graph with an ``image_features`` output: [images, tokens, hidden] (batched), or
            [all image tokens, hidden] with ``packed``.
        method: one of METHODS.
        keep: tokens kept per image (k).
        tokens: feature tokens per image before pruning (batched layout).
        attention: the manifest's ``vision.attention`` facts (attention methods only).
        seed: seed for ``random``.
        recompute: score from a side branch recomputing the attention from Q and Kᵀ.
        packed: for packed features: ``grid_input`` (the [images, 3] grid input), ``group`` (patches
            per token) and ``max_tokens`` (bound on tokens per image, for the random table).
        aligned: other outputs laid out along the packed token axis (name -> that axis; the manifest's
            ``vision.token_aligned_outputs``, e.g. Qwen3-VL's deepstack features): they keep the same tokens.

    Returns:
        The new model and facts about the rewrite (score source, op types added).
    """
    if _output(model.graph, FEATURES) is None:
        raise VlmcError(f"the vision graph has no {FEATURES!r} output")
    if method not in BASELINES and not attention:
        raise VlmcError(f"method {method} needs vision.attention facts in the manifest")
    new = model.clone()
    graph = new.graph
    tensors = ir.convenience.create_value_mapping(graph, include_subgraphs=False)
    feats = _output(graph, FEATURES)
    shape = list(feats.shape) if feats.shape is not None else [None] * (2 if packed else 3)
    feats.name = f"{FEATURES}_unpruned"
    b = _Builder(graph, PREFIX)
    if packed and packed.get("table"):
        kept, indices, source = _token_table(
            b, feats, method, keep, packed, attention, seed, recompute, tensors
        )
        kept_shape, idx_shape = ["image_tokens", shape[-1]], ["images", keep]
    elif packed:
        kept, indices, source = _packed(b, feats, method, keep, packed, attention, seed, recompute, tensors)
        kept_shape, idx_shape = ["image_tokens", shape[-1]], ["images", keep]
    else:
        kept, indices, source = _batched(b, feats, method, keep, tokens, attention, seed, recompute, tensors)
        kept_shape, idx_shape = [shape[0], keep, shape[-1]], [shape[0], keep]
    kept.name, indices.name = FEATURES, measure.INDICES_OUTPUT
    kept.dtype, indices.dtype = feats.dtype or ir.DataType.FLOAT, ir.DataType.INT64
    kept.shape, indices.shape = ir.Shape(kept_shape), ir.Shape(idx_shape)
    _replace_output(graph, feats, kept)
    graph.outputs.append(indices)
    if aligned:
        _keep_aligned(b, graph, kept, aligned, packed)
    RemoveUnusedNodesPass()(new)
    TopologicalSortPass()(new)
    return new, {"method": method, "score_source": source, "ops_added": b.added_ops()}


def _keep_aligned(b: _Builder, graph: ir.Graph, kept: ir.Value, aligned: dict[str, int], packed) -> None:
    """Gather each token-aligned output with the index that selected the kept image_features rows."""
    if not packed:
        raise VlmcError(
            "outputs aligned with image_features (vision.token_aligned_outputs) are only supported for "
            "packed features"
        )
    # The packed paths end in Gather(features, flat packed index, axis=0): reuse that index.
    index = kept.producer().inputs[1]
    for name, axis in aligned.items():
        old = _output(graph, name)
        if old is None:
            raise VlmcError(f"the vision graph has no {name!r} output (vision.token_aligned_outputs)")
        shape = list(old.shape) if old.shape is not None else None
        old.name = f"{name}_unpruned"
        new = b.one("Gather", [old, index], {"axis": int(axis)})
        new.name = name
        new.dtype = old.dtype or ir.DataType.FLOAT
        if shape is not None:
            shape[int(axis)] = "image_tokens"
            new.shape = ir.Shape(shape)
        _replace_output(graph, old, new)


@register
class PruneVisualTokens(Pass):
    """Keep k visual tokens per image (attention-ranked or baseline), fixed k, original order."""

    name = "prune_visual_tokens"
    summary = (
        "drop visual tokens in the vision graph (TopK on attention scores, static k); lossy, reports fidelity"
    )
    lossy = True
    # The pruned vision graph is a new model (rewrite builds it); the snapshot keeps the original.
    changes_input = False
    requires = ("unmerged",)
    options = (
        Option(
            "keep",
            int,
            None,
            "visual tokens kept per image (k); give keep or ratio",
            min=1,
            max=limits.MAX_TOKENS_PER_IMAGE,
        ),
        Option(
            "ratio",
            float,
            None,
            "fraction of visual tokens kept per image, in (0, 1]; give keep or ratio",
            min=0.0,
            max=1.0,
        ),
        Option(
            "method",
            str,
            "cls_attention",
            "token score: CLS attention (FasterVLM), attention received "
            "(no-CLS encoders), or the uniform/random baselines",
            choices=METHODS,
        ),
        Option("seed", int, 0, "seed for method random", min=0, max=2**32 - 1),
        Option(
            "recompute_attention",
            bool,
            False,
            "score from a side branch recomputing the layer's attention "
            "from Q and K even when the graph exposes it",
        ),
        Option(
            "force", bool, False, "prune even image chains that end in a fusion graph (learned query tokens)"
        ),
        Option(
            "calibration_images", int, 2, "demo images for the fidelity report (0 skips it)", min=0, max=64
        ),
        Option("calibration_prompt", str, measure.DEFAULT_PROMPT, "prompt used for the fidelity report"),
        Option(
            "fidelity_tokens", int, 8, "greedy tokens compared for the common-prefix length", min=1, max=256
        ),
        Option("picture", bool, True, "store pruning.png (kept patches on the first calibration image)"),
    )

    @classmethod
    def check_options(cls, opts: dict, where: str) -> None:
        if (opts.get("keep") is None) == (opts.get("ratio") is None):
            raise VlmcError(f"{where}: give exactly one of keep (tokens per image) or ratio (fraction kept)")
        if opts.get("ratio") is not None and opts["ratio"] <= 0:
            raise VlmcError(f"{where}: ratio={opts['ratio']} must be above 0")

    # ---- refusal rules (manifest facts only) --------------------------------------------------
    def _plan(self, pkg) -> dict:
        m = pkg.manifest
        v = m["vision"]
        chain = m.get("pipeline", {}).get("image") or []
        if not chain:
            raise VlmcError("the package has no image chain (pipeline.image); nothing to prune")
        target = chain[-1]
        refusal = v.get("prune") or {}
        if refusal.get("supported") is False:
            # A family states why its visual tokens cannot be pruned (e.g. anyres tiles with unpadding).
            raise VlmcError(
                f"cannot prune this package: {refusal.get('reason', 'the family does not support it')}"
            )
        if v.get("pruning"):
            raise VlmcError(
                f"the package is already pruned to {v['pruning'].get('keep')} tokens per image; "
                "prune the unpruned package instead"
            )
        method = self.opts["method"]
        fused = pkg.info(target)["role"] == "fusion"
        if fused and not self.opts["force"]:
            raise VlmcError(
                f"the image chain ends in fusion graph {target!r}: its tokens are learned queries "
                "(e.g. BLIP-2's Q-Former), not image patches, so there is nothing to prune; "
                "set force: true to drop query tokens anyway (uniform or random)"
            )
        if fused and method not in BASELINES:
            raise VlmcError(
                f"method {method} scores image patches, but {target!r} outputs query tokens; "
                "use method uniform or random with force: true"
            )
        tokens = v.get("tokens_per_image")
        packed = None
        if isinstance(tokens, int):
            k = keep_count(self.opts, tokens)
            if k >= tokens:
                raise VlmcError(
                    f"keep={k} is not below the {tokens} visual tokens per image; nothing to prune"
                )
        elif v.get("token_table"):
            # anyres tiles, HD crops: each image's count depends on its size; every separator is kept
            table = v["token_table"]
            if self.opts["keep"] is None:
                what = table.get("what", "anyres tiles")
                raise VlmcError(
                    f"the token count per image depends on the image size here ({what}); "
                    "give keep (tokens per image) instead of ratio"
                )
            k = int(self.opts["keep"])
            if k <= int(table["most_rows"]):
                # most_rows: the most separator tokens one image has (llava-next packages predate "kept")
                kept = table.get(
                    "kept", "feature rows an image can have: every row's image_newline token is kept"
                )
                raise VlmcError(
                    f"keep={k} must be above the {table['most_rows']} {kept}, and at least one image token "
                    "besides them"
                )
            packed = {"table": table, "max_tokens": MAX_PACKED_TOKENS}
        else:
            inputs = [i["name"] for i in pkg.info(target)["inputs"]]
            if not (v.get("packed_features") and GRID_INPUT in inputs):
                raise VlmcError(
                    f"the manifest gives no fixed vision.tokens_per_image and graph {target!r} has no "
                    f"{GRID_INPUT} input to count tokens per image; cannot prune this package"
                )
            if self.opts["keep"] is None:
                raise VlmcError(
                    "the token count per image depends on the image size here (dynamic resolution); "
                    "give keep (tokens per image) instead of ratio"
                )
            k = int(self.opts["keep"])
            packed = {
                "grid_input": GRID_INPUT,
                "group": int(v.get("spatial_merge_size", 1) or 1) ** 2,
                "max_tokens": MAX_PACKED_TOKENS,
            }
        att = v.get("attention")
        if method not in BASELINES:
            if not att:
                # vision.attention_note: the exporter's reason there are no attention facts, if it gave one
                why = f" ({v['attention_note']})" if v.get("attention_note") else ""
                raise VlmcError(
                    f"method {method} needs the exporter's vision.attention facts, which this package lacks"
                    f"{why}; use method uniform or random"
                )
            if att.get("graph") != target:
                raise VlmcError(
                    f"the scoring attention is in graph {att.get('graph')!r} but image_features come from "
                    f"{target!r}; use method uniform or random"
                )
            if method == "cls_attention" and att.get("query_index") is None:
                raise VlmcError(
                    "method cls_attention needs a CLS token, which this vision encoder lacks; "
                    "use method attention_received"
                )
            if method == "attention_received" and att.get("masked") and self.opts["recompute_attention"]:
                raise VlmcError(
                    "the scoring attention is masked, so it cannot be recomputed from Q and K alone; "
                    "keep the exported attention (recompute_attention: false)"
                )
        aligned = v.get("token_aligned_outputs") or None
        return {
            "target": target,
            "tokens": tokens,
            "keep": k,
            "attention": att,
            "packed": packed,
            "aligned": aligned,
        }

    def check_package(self, package) -> dict:
        return self._plan(package)

    def run(self, package, plan=None):
        plan = plan if plan is not None else self._plan(package)
        target, tokens, k = plan["target"], plan["tokens"], plan["keep"]
        original = package.model(target)
        original_vision = copy.deepcopy(package.manifest["vision"])
        new, info = rewrite(
            original,
            self.opts["method"],
            k,
            tokens,
            plan["attention"],
            self.opts["seed"],
            self.opts["recompute_attention"],
            plan["packed"],
            plan.get("aligned"),
        )
        # tokens_before is None for dynamic resolution: each image had prod(grid)/merge² tokens.
        facts = {
            "method": self.opts["method"],
            "keep": k,
            "tokens_before": tokens,
            "unpruned_tokens_per_image": original_vision.get("tokens_per_image"),
            "graph": target,
            "indices_output": measure.INDICES_OUTPUT,
            "score_source": info["score_source"],
            "seed": self.opts["seed"] if self.opts["method"] == "random" else None,
            "positions": "original" if package.manifest["text"].get("position") == "mrope" else "contiguous",
        }
        package.set_graph(target, new)
        package.manifest["vision"]["tokens_per_image"] = k
        package.manifest["vision"]["pruning"] = facts
        report = {
            "method": facts["method"],
            "keep": k,
            "tokens_before": tokens,
            "score_source": info["score_source"],
            "ops_added": info["ops_added"],
        }
        unpruned = measure.variant(package, {target: original}, original_vision)
        report["savings"] = self._savings(package, unpruned, k)
        if tokens is None:  # dynamic resolution: report the count of the first calibration image
            report["tokens_before"] = (
                f"{report['savings']['visual_tokens_before']} (demo:0; depends on the image size)"
            )
        if self.opts["picture"] and package.manifest["vision"].get("token_table"):
            report["picture"] = "not drawn: the tokens come from several tiles or crops, not one patch grid"
        elif self.opts["picture"]:
            image = "demo:0"
            package.files["pruning.png"] = measure.picture(package, image)
            report["picture"] = "pruning.png"
        return PassResult(package, report=report)

    def evaluate(self, before, after, result) -> dict | None:
        """Fidelity of the chosen method and of the baselines at equal k, against the unpruned package."""
        if not self.opts["calibration_images"]:
            return None
        return self._fidelity(after, before, self._plan(before))

    def _fidelity(self, pruned, unpruned, plan) -> dict:
        images = [f"demo:{i}" for i in range(self.opts["calibration_images"])]
        variants = {self.opts["method"]: pruned}
        original = unpruned.model(plan["target"])
        for base in BASELINES:
            if base not in variants:
                model, _ = rewrite(
                    original,
                    base,
                    plan["keep"],
                    plan["tokens"],
                    seed=self.opts["seed"],
                    packed=plan["packed"],
                    aligned=plan.get("aligned"),
                )
                variants[base] = measure.variant(pruned, {plan["target"]: model})
        result = measure.fidelity(
            unpruned, variants, images, self.opts["calibration_prompt"], self.opts["fidelity_tokens"]
        )
        result["calibration_images"] = len(images)
        return result

    def _savings(self, pruned, unpruned, keep: int) -> dict:
        """KV bytes and FastV prefill FLOPs for the calibration prompt with the first demo image."""
        from vlmc.runtime import Pipeline

        inp = Pipeline(unpruned).prepare([self.opts["calibration_prompt"]], [["demo:0"]])
        visual = int((inp.input_ids == int(unpruned.manifest["vision"]["image_token_id"])).sum())
        return measure.savings(pruned.manifest, visual, keep, int(inp.attention_mask.sum()) - visual)
