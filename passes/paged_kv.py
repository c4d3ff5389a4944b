"""paged_kv: rewrite contiguous-KV decoder graphs to read a paged KV block pool and return this step's rows."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from vlmc import samples, tensor_names
from vlmc.errors import VlmcError
from vlmc.pass_api import Option, Pass, PassResult, register

logger = logging.getLogger(__name__)

# Graph roles whose contiguous KV interface is rewritten (the merged graph has the same decoder IO).
ROLES = ("decoder", "vlm")
NUM_BLOCKS_DIM = "num_blocks"
MAX_BLOCKS_DIM = "max_blocks"
PAST_RE = tensor_names.PAST_RE
PRESENT_RE = tensor_names.PRESENT_RE
CACHE_IN = {k: p + "{}" for k, p in tensor_names.CACHE_PREFIX.items()}
# Interface v2 (docs/architecture.md): the graph returns this step's rows; whoever runs it writes them.
NEW_OUT = {k: p + "{}" for k, p in tensor_names.NEW_PREFIX.items()}
NEW_INPUTS = tensor_names.PAGED_INPUTS
# Documented in docs/paged_kv.md: a negative slot marks a padding position, masked and never stored.
PADDING_RULE = "slot < 0 marks padding: masked for every query, and its row is not written to the pool"
# The definition the graph's mask relies on (docs/paged_kv.md, recorded in the manifest as kv.context_lens).
CONTEXT_LENS_RULE = (
    "tokens stored for the sequence after this step, this step's real (slot >= 0) tokens included; "
    "the past read from the pool is the first context_lens - (real tokens in the step) slots"
)
_P = "paged_kv/"  # prefix of every tensor and node this pass adds, so names never clash with the decoder's


@register
class PagedKV(Pass):
    """Wrap each decoder so that its past K/V come from a block pool and its new K/V rows come out.

    The original decoder graph is kept whole (its attention, RoPE and masking are not re-derived):
    a prefix gathers each sequence's blocks into a contiguous past and builds the 2-D attention
    mask from ``context_lens`` and ``slot_mapping``; a suffix takes this step's rows (the last
    ``seq`` positions of each ``present``) out as ``new_key.{i}``/``new_value.{i}``. The pool is
    only read: the runtime stores the rows at ``slot_mapping`` in place, so a step costs what its
    context costs, whatever the pool's size (interface v2, docs/paged_kv.md).
    """

    name = "paged_kv"
    summary = (
        "paged KV cache: the decoder reads a (num_blocks, block_size, kv_heads, head_dim) block pool via "
        "block tables and returns this step's K/V rows for the runtime to store in place"
    )
    options = (
        Option(
            "block_size",
            int,
            128,
            "tokens per KV block (ATB/IFA limit: multiple of 16, at most 512)",
            min=16,
            max=512,
            multiple_of=16,
        ),
        Option(
            "num_blocks",
            int,
            None,
            "blocks in the pool; unset keeps it a symbolic dimension 'num_blocks'",
            min=1,
            max=1 << 24,
        ),
    )

    def run(self, package):
        kv = package.manifest["kv"]
        if kv.get("layout") == "paged":
            logger.warning("paged_kv: the package's KV layout is already paged; nothing to do")
            return PassResult(package, False, {"skipped": "already paged"})
        names = [
            n
            for n in package.graph_names
            if package.info(n)["role"] in ROLES
            and any(PAST_RE.match(i["name"]) for i in package.info(n)["inputs"])
        ]
        if not names:
            logger.warning("paged_kv: no decoder graph has past_key_values inputs; nothing to do")
            return PassResult(package, False, {"skipped": "no graph with a contiguous KV interface"})
        bs, nb = self.opts["block_size"], self.opts["num_blocks"]
        report = {"block_size": bs, "num_blocks": nb if nb is not None else NUM_BLOCKS_DIM, "graphs": {}}
        # A tensor-parallel package's rank-local graphs hold the rank's share of the KV heads.
        heads = int((package.manifest.get("tensor_parallel") or {}).get("kv_heads_per_rank", kv["kv_heads"]))
        for name in names:
            model = package.graph(name)
            layers = rewrite(model, bs, nb, heads, int(kv["head_dim"]), where=name)
            package.set_graph(name, model)
            samples.store(package, name, sample_feeds(package, name, bs))
            report["graphs"][name] = {"layers": layers, "nodes": len(model.graph.node)}
        kv.update(
            {
                "layout": "paged",
                "block_size": bs,
                "num_blocks": nb if nb is not None else NUM_BLOCKS_DIM,
                "padding_slot": PADDING_RULE,
                "context_lens": CONTEXT_LENS_RULE,
            }
        )
        return PassResult(package, True, report)


def rewrite(
    model: onnx.ModelProto,
    block_size: int,
    num_blocks: int | None,
    kv_heads: int,
    head_dim: int,
    where: str = "decoder",
) -> list[int]:
    """Rewrite one graph in place from the contiguous to the paged KV interface; return its layer ids.

    The proto is edited directly rather than through onnx-graphsurgeon: the change is a prefix and
    a suffix around an untouched graph, and re-exporting every weight through GS would only cost time.

    Raises:
        VlmcError: the graph does not have the contiguous decoder interface.
    """
    g = model.graph
    inputs = {i.name: i for i in g.input}
    outputs = {o.name: o for o in g.output}
    past = {(int(m[1]), m[2]): n for n in inputs if (m := PAST_RE.match(n))}
    present = {(int(m[1]), m[2]): n for n in outputs if (m := PRESENT_RE.match(n))}
    if "attention_mask" not in inputs:
        raise VlmcError(
            f"paged_kv: graph {where} has past_key_values inputs but no attention_mask input; "
            "it does not have the contiguous decoder interface"
        )
    if set(past) != set(present):
        raise VlmcError(
            f"paged_kv: graph {where}: past_key_values inputs and present outputs do not pair up "
            f"({len(past)} inputs, {len(present)} outputs)"
        )
    taken = [*NEW_INPUTS, *(CACHE_IN[k].format(i) for i, k in past), *(NEW_OUT[k].format(i) for i, k in past)]
    for name in taken:
        if name in inputs or name in outputs:
            raise VlmcError(f"paged_kv: graph {where} already has a tensor named {name!r}")
    layers = sorted({i for i, _ in past})
    kv_type = inputs[past[(layers[0], "key")]].type.tensor_type.elem_type
    mask_type = inputs["attention_mask"].type.tensor_type.elem_type
    batch = _dim(inputs["inputs_embeds"], 0) if "inputs_embeds" in inputs else "batch"
    seq = _dim(inputs["inputs_embeds"], 1) if "inputs_embeds" in inputs else "sequence"
    nb_dim = num_blocks if num_blocks is not None else NUM_BLOCKS_DIM

    prefix: list[onnx.NodeProto] = []
    suffix: list[onnx.NodeProto] = []
    inits = [
        _const("bs", np.array([block_size], np.int64)),
        _const("zero", np.array(0, np.int64)),
        _const("one", np.array(1, np.int64)),
        _const("axis1", np.array([1], np.int64)),
        _const("big", np.array([np.iinfo(np.int64).max], np.int64)),
        _const("axis2", np.array([2], np.int64)),
        _const("flat_bp", np.array([0, -1], np.int64)),
        _const("rows_shape", np.array([-1, head_dim], np.int64)),
        _const("offsets", np.arange(block_size, dtype=np.int64)),
        _const("heads", np.array([kv_heads], np.int64)),
        _const("head_ids", np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1)),
    ]
    n = _Namer()
    # Shared: gathered past length P = max_blocks * block_size.
    prefix += [
        n.node("Shape", ["block_tables"], ["bt_shape"]),
        n.node("Gather", ["bt_shape", _P + "axis1"], ["max_blocks"], axis=0),
        n.node("Mul", ["max_blocks", _P + "bs"], ["past_len1d"]),  # [1] int64
        n.node("Squeeze", ["past_len1d"], ["past_len"]),
        # Real (non-padding) new tokens and each sequence's past length: context_lens counts the
        # tokens stored after this step, this step's real ones included (CONTEXT_LENS_RULE).
        n.node("Cast", ["slot_mapping"], ["slots64"], to=TensorProto.INT64),
        n.node("GreaterOrEqual", ["slots64", _P + "zero"], ["is_new"]),
        n.node("Cast", ["is_new"], ["is_new64"], to=TensorProto.INT64),
        n.node("ReduceSum", ["is_new64", _P + "axis1"], ["n_new"], keepdims=1),  # [B, 1]
        n.node("Cast", ["context_lens"], ["ctx64"], to=TensorProto.INT64),
        n.node("Unsqueeze", ["ctx64", _P + "axis1"], ["ctx_col"]),
        n.node("Sub", ["ctx_col", "n_new"], ["past_real"]),  # [B, 1]
        n.node("Range", [_P + "zero", "past_len", _P + "one"], ["past_pos"]),  # [P]
        # The gathered past is the sequence's positions 0..P-1 in order; the first past_real are
        # stored rows, the rest (this step's slots, not yet written, and unused blocks) are masked.
        n.node("Less", ["past_pos", "past_real"], ["past_valid"]),  # [B, P]
        n.node("Cast", ["past_valid"], ["past_mask"], to=mask_type),
        # A padding position (left-padded prompt, finished batch row) is masked for every query,
        # as the contiguous runtime's attention_mask does; the decoder adds causality itself.
        n.node("Cast", ["is_new"], ["new_mask"], to=mask_type),
        n.node("Concat", ["past_mask", "new_mask"], ["attention_mask"], axis=1, raw=True),
        # Row index of every gathered K/V row, in the decoder's past layout [B, kv_heads, P]: the pool
        # viewed as [num_blocks*block_size*kv_heads, head_dim] has row (slot*kv_heads + head), and
        # slot = block_tables[b, j // block_size]*block_size + j % block_size. One Gather per pool
        # then yields past_key_values directly: no gathered copy to transpose (3x faster on ORT CPU
        # than Gather+Transpose at LLaVA widths), and the index is built once per step for all pools.
        n.node("Cast", ["block_tables"], ["bt64"], to=TensorProto.INT64),
        n.node("Unsqueeze", ["bt64", _P + "axis2"], ["bt3"]),  # [B, MB, 1]
        n.node("Mul", ["bt3", _P + "bs"], ["block_base"]),
        n.node("Add", ["block_base", _P + "offsets"], ["slots3"]),  # [B, MB, bs]
        n.node("Reshape", ["slots3", _P + "flat_bp"], ["past_slots"]),  # [B, P]
        n.node("Unsqueeze", ["past_slots", _P + "axis1"], ["past_slots3"]),  # [B, 1, P]
        n.node("Mul", ["past_slots3", _P + "heads"], ["row_base"]),
        n.node("Add", ["row_base", _P + "head_ids"], ["row_idx"]),  # [B, H, P]
    ]
    new_inputs = [
        helper.make_tensor_value_info("block_tables", TensorProto.INT32, [batch, MAX_BLOCKS_DIM]),
        helper.make_tensor_value_info("slot_mapping", TensorProto.INT32, [batch, seq]),
        helper.make_tensor_value_info("context_lens", TensorProto.INT32, [batch]),
    ]
    pool_inputs, row_outputs = [], []
    for i in layers:
        for k in ("key", "value"):
            pool, rows = CACHE_IN[k].format(i), NEW_OUT[k].format(i)
            t = f"{k}{i}_"
            prefix += [
                # A view, not a copy: onnxruntime's Reshape aliases its input (the tests check that
                # no pool is copied), so only the gathered rows are read.
                n.node("Reshape", [pool, _P + "rows_shape"], [t + "rows"]),  # [NB*bs*H, D]
                n.node(
                    "Gather", [t + "rows", _P + "row_idx"], [past[(i, k)]], axis=0, raw=True
                ),  # [B, H, P, D]
            ]
            # present = past ++ this step's rows along the sequence axis: the rows are its last seq
            # positions, keys already rotated; they leave the graph in the pool's row layout.
            suffix += [
                n.node("Slice", [present[(i, k)], "past_len1d", _P + "big", _P + "axis2"], [t + "new"]),
                n.node("Transpose", [t + "new"], [rows], perm=[0, 2, 1, 3], raw=True),  # [B, S, H, D]
            ]
            pool_inputs.append(
                helper.make_tensor_value_info(pool, kv_type, [nb_dim, block_size, kv_heads, head_dim])
            )
            row_outputs.append(helper.make_tensor_value_info(rows, kv_type, [batch, seq, kv_heads, head_dim]))

    keep_in = [i for i in g.input if i.name != "attention_mask" and not PAST_RE.match(i.name)]
    keep_out = [o for o in g.output if not PRESENT_RE.match(o.name)]
    # Cache inputs follow the other inputs, in layer order, as the architecture doc lists them.
    del g.input[:]
    g.input.extend(keep_in + pool_inputs + new_inputs)
    del g.output[:]
    g.output.extend(keep_out + row_outputs)
    body = list(g.node)
    del g.node[:]
    g.node.extend(prefix + body + suffix)
    g.initializer.extend(inits)
    # Intermediate shapes recorded for the old inputs/outputs would now be wrong or duplicated.
    stale = {"attention_mask", *past.values(), *present.values()}
    keep_vi = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    return layers


def _dim(vi: onnx.ValueInfoProto, axis: int) -> int | str:
    d = vi.type.tensor_type.shape.dim[axis]
    return d.dim_value if d.HasField("dim_value") else (d.dim_param or f"d{axis}")


def _const(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, _P + name)


class _Namer:
    """Makes nodes whose tensor names carry the pass prefix, except names the decoder already uses."""

    def __init__(self) -> None:
        self.count = 0

    def node(self, op: str, ins: list[str], outs: list[str], raw: bool = False, **attrs) -> onnx.NodeProto:
        self.count += 1
        ins = [x if _external(x) else _P + x for x in ins]
        outs = [x if (raw or _external(x)) else _P + x for x in outs]
        return helper.make_node(op, ins, outs, name=f"{_P}{op}_{self.count}", **attrs)


def _external(name: str) -> bool:
    """Graph IO and decoder tensors keep their own names; everything else this pass makes is prefixed."""
    return (
        name.startswith(_P)
        or name in NEW_INPUTS
        or name == "attention_mask"
        or bool(PAST_RE.match(name))
        or bool(PRESENT_RE.match(name))
        or tensor_names.is_paged_io(name)
    )


def sample_feeds(package, name: str, block_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Consistent sample inputs for a paged graph: two sequences with shuffled blocks, one padded position.

    Generated samples (zeros everywhere) would make every position padding and every past empty.
    """
    rng = np.random.default_rng(seed)
    specs = {i["name"]: i for i in package.info(name)["inputs"]}
    batch, seq, past, real = 2, 3, [5, 2], [3, 2]  # row 1 is left-padded by one position
    max_blocks = max(-(-(p + seq) // block_size) for p in past)
    pool_dim = specs[CACHE_IN["key"].format(min(_layers(specs)))]["shape"][0]
    nb = pool_dim if isinstance(pool_dim, int) else 2 * batch * max_blocks + 1
    order = rng.permutation(np.arange(1, nb))  # block 0 stays unowned, as the runtime's null block
    tables = np.zeros((batch, max_blocks), np.int32)
    slots = np.full((batch, seq), -1, np.int32)
    pos = np.ones((batch, seq), np.int64)
    for b in range(batch):
        tables[b] = order[b * max_blocks : (b + 1) * max_blocks]
        p = np.arange(past[b], past[b] + real[b])
        slots[b, seq - real[b] :] = tables[b][p // block_size] * block_size + p % block_size
        pos[b, seq - real[b] :] = p
    ctx = np.array([p + r for p, r in zip(past, real)], np.int32)
    feeds: dict[str, np.ndarray] = {"block_tables": tables, "slot_mapping": slots, "context_lens": ctx}
    sizes = {"batch": batch, "sequence": seq, NUM_BLOCKS_DIM: nb}
    for n, spec in specs.items():
        if n in feeds:
            continue
        shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in spec["shape"]]
        if n == "position_ids":
            feeds[n] = np.broadcast_to(pos, shape).astype(spec["dtype"])
        elif np.dtype(spec["dtype"]).kind == "f":
            feeds[n] = rng.standard_normal(shape).astype(spec["dtype"])
        else:
            feeds[n] = np.zeros(shape, spec["dtype"])
    return feeds


def _layers(specs: dict) -> list[int]:
    return tensor_names.cache_layers(specs)
