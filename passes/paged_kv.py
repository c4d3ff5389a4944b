"""paged_kv: rewrite contiguous-KV decoder graphs to read a paged KV block pool and return this step's rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from vlmc import samples, tensor_names
from vlmc.errors import VlmcError
from vlmc.pass_api import Option, Pass, PassResult, register

logger = logging.getLogger(__name__)

# Graph roles whose contiguous KV interface is rewritten (the merged graph has the same decoder IO).
ROLES = ("decoder", "vlm")
NUM_BLOCKS_DIM = "num_blocks"
MAX_BLOCKS_DIM = "max_blocks"
# Interface v2 (docs/architecture.md): the graph returns this step's rows; whoever runs it writes them.
NEW_INPUTS = tensor_names.PAGED_INPUTS
# Documented in docs/paged_kv.md: a negative slot marks a padding position, masked and never stored.
PADDING_RULE = "slot < 0 marks padding: masked for every query, and its row is not written to the pool"
# The definition the graph's mask relies on (docs/paged_kv.md, recorded in the manifest as kv.context_lens).
CONTEXT_LENS_RULE = (
    "tokens stored for the sequence after this step, this step's real (slot >= 0) tokens included; "
    "the past read from the pool is the first context_lens - (real tokens in the step) slots"
)
PREFIX = (
    "paged_kv/"  # prefix of every tensor and node this pass adds, so names never clash with the decoder's
)


@dataclass(frozen=True)
class Plan:
    """What ``check_package`` found: the graphs to rewrite, or why there is nothing to do."""

    graphs: tuple[str, ...]
    skipped: str | None = None


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

    def check_package(self, package) -> Plan:
        """The decoder graphs with the contiguous KV interface; refuses one whose interface is broken."""
        kv = package.manifest["kv"]
        if kv.get("layout") == "paged":
            return Plan((), "already paged")
        names = tuple(
            name
            for name in package.graph_names
            if package.info(name)["role"] in ROLES
            and any(tensor_names.PAST_RE.match(i["name"]) for i in package.info(name)["inputs"])
        )
        if not names:
            return Plan((), "no graph with a contiguous KV interface")
        for name in names:
            info = package.info(name)
            check_interface([i["name"] for i in info["inputs"]], [o["name"] for o in info["outputs"]], name)
        return Plan(names)

    def run(self, package, plan: Plan | None = None) -> PassResult:
        plan = plan if plan is not None else self.check_package(package)
        if plan.skipped is not None:
            logger.warning("paged_kv: %s; nothing to do", plan.skipped)
            return PassResult(package, False, {"skipped": plan.skipped})
        kv = package.manifest["kv"]
        block_size, num_blocks = self.opts["block_size"], self.opts["num_blocks"]
        pool_dim = num_blocks if num_blocks is not None else NUM_BLOCKS_DIM
        report = {"block_size": block_size, "num_blocks": pool_dim, "graphs": {}}
        # A tensor-parallel package's rank-local graphs hold the rank's share of the KV heads.
        heads = int((package.manifest.get("tensor_parallel") or {}).get("kv_heads_per_rank", kv["kv_heads"]))
        for name in plan.graphs:
            model = package.model(name)  # edited in place; its weights are never read
            nodes = len(model.graph)
            layers = rewrite(model, block_size, num_blocks, heads, int(kv["head_dim"]), where=name)
            added = sum(1 for n in model.graph if (n.name or "").startswith(PREFIX))
            package.set_graph(name, model)
            # The sample pools are ~21 MB per layer at 7B widths: written one at a time, never all held.
            samples.store_streamed(package, name, iter_sample_feeds(package, name, block_size))
            report["graphs"][name] = {
                "layers": layers,
                "nodes": len(model.graph),
                "copies_removed": nodes + added - len(model.graph),
            }
        kv.update(
            {
                "layout": "paged",
                "block_size": block_size,
                "num_blocks": pool_dim,
                "padding_slot": PADDING_RULE,
                "context_lens": CONTEXT_LENS_RULE,
            }
        )
        return PassResult(package, True, report)


def check_interface(inputs: list[str], outputs: list[str], where: str) -> None:
    """Refuse a graph that does not have the contiguous decoder KV interface (one-line VlmcError)."""
    past = {(int(m[1]), m[2]) for name in inputs if (m := tensor_names.PAST_RE.match(name))}
    present = {(int(m[1]), m[2]) for name in outputs if (m := tensor_names.PRESENT_RE.match(name))}
    if "attention_mask" not in inputs:
        raise VlmcError(
            f"paged_kv: graph {where} has past_key_values inputs but no attention_mask input; "
            "it does not have the contiguous decoder interface"
        )
    if past != present:
        raise VlmcError(
            f"paged_kv: graph {where}: past_key_values inputs and present outputs do not pair up "
            f"({len(past)} inputs, {len(present)} outputs)"
        )
    taken = [
        *NEW_INPUTS,
        *(tensor_names.cache(i, kind) for i, kind in sorted(past)),
        *(tensor_names.new_rows(i, kind) for i, kind in sorted(past)),
    ]
    existing = set(inputs) | set(outputs)
    for name in taken:
        if name in existing:
            raise VlmcError(f"paged_kv: graph {where} already has a tensor named {name!r}")


def rewrite(
    model: ir.Model,
    block_size: int,
    num_blocks: int | None,
    kv_heads: int,
    head_dim: int,
    where: str = "decoder",
) -> list[int]:
    """Rewrite one graph in place from the contiguous to the paged KV interface; return its layer ids.

    The decoder's own weights are not read and its nodes are kept, but for single-input Concats
    of a past (copies, :func:`_drop_copies_of_past`): the change is a prefix that produces the former ``attention_mask`` and ``past_key_values.*`` inputs (the same
    IR values, so every use in the decoder stays as it is) and a suffix that takes this step's rows
    out of each former ``present.*`` output. The prefix only depends on graph inputs and its own
    constants and goes before the first node, the suffix after the last, so the node order stays
    topological without a sort.

    Raises:
        VlmcError: the graph does not have the contiguous decoder interface.
    """
    graph = model.graph
    check_interface([v.name for v in graph.inputs], [v.name for v in graph.outputs], where)
    inputs = {v.name: v for v in graph.inputs}
    past = {(int(m[1]), m[2]): v for name, v in inputs.items() if (m := tensor_names.PAST_RE.match(name))}
    present = {
        (int(m[1]), m[2]): v for v in graph.outputs if (m := tensor_names.PRESENT_RE.match(v.name or ""))
    }
    layers = sorted({i for i, _ in past})
    mask = inputs["attention_mask"]
    kv_type = past[(layers[0], "key")].dtype
    embeds = inputs.get("inputs_embeds")
    batch = _dim(embeds, 0, "batch")
    seq = _dim(embeds, 1, "sequence")
    pool_dim = num_blocks if num_blocks is not None else NUM_BLOCKS_DIM

    # The former inputs become values the prefix computes; the former present outputs stay as the
    # decoder's internal values. Their recorded shapes describe the contiguous interface, so they go.
    former = {id(v) for v in (mask, *past.values(), *present.values())}
    kept_inputs = [v for v in graph.inputs if id(v) not in former]
    kept_outputs = [v for v in graph.outputs if id(v) not in former]
    graph.inputs.clear()
    graph.outputs.clear()
    for value in (mask, *past.values(), *present.values()):
        value.shape = None

    build = _Builder(graph)
    block_tables = ir.val("block_tables", ir.DataType.INT32, [batch, MAX_BLOCKS_DIM])
    slot_mapping = ir.val("slot_mapping", ir.DataType.INT32, [batch, seq])
    context_lens = ir.val("context_lens", ir.DataType.INT32, [batch])
    bs = build.const("bs", np.array([block_size], np.int64))
    zero = build.const("zero", np.array(0, np.int64))
    one = build.const("one", np.array(1, np.int64))
    axis1 = build.const("axis1", np.array([1], np.int64))
    big = build.const("big", np.array([np.iinfo(np.int64).max], np.int64))
    axis2 = build.const("axis2", np.array([2], np.int64))
    flat_bp = build.const("flat_bp", np.array([0, -1], np.int64))
    rows_shape = build.const("rows_shape", np.array([-1, head_dim], np.int64))
    offsets = build.const("offsets", np.arange(block_size, dtype=np.int64))
    heads = build.const("heads", np.array([kv_heads], np.int64))
    head_ids = build.const("head_ids", np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1))

    # Shared: gathered past length P = max_blocks * block_size.
    bt_shape = build.op("Shape", [block_tables], "bt_shape")
    max_blocks = build.op("Gather", [bt_shape, axis1], "max_blocks", axis=0)
    past_len1d = build.op("Mul", [max_blocks, bs], "past_len1d")  # [1] int64
    past_len = build.op("Squeeze", [past_len1d], "past_len")
    # Real (non-padding) new tokens and each sequence's past length: context_lens counts the
    # tokens stored after this step, this step's real ones included (CONTEXT_LENS_RULE).
    slots64 = build.op("Cast", [slot_mapping], "slots64", to=ir.DataType.INT64)
    is_new = build.op("GreaterOrEqual", [slots64, zero], "is_new")
    is_new64 = build.op("Cast", [is_new], "is_new64", to=ir.DataType.INT64)
    n_new = build.op("ReduceSum", [is_new64, axis1], "n_new", keepdims=1)  # [B, 1]
    ctx64 = build.op("Cast", [context_lens], "ctx64", to=ir.DataType.INT64)
    ctx_col = build.op("Unsqueeze", [ctx64, axis1], "ctx_col")
    past_real = build.op("Sub", [ctx_col, n_new], "past_real")  # [B, 1]
    past_pos = build.op("Range", [zero, past_len, one], "past_pos")  # [P]
    # The gathered past is the sequence's positions 0..P-1 in order; the first past_real are
    # stored rows, the rest (this step's slots, not yet written, and unused blocks) are masked.
    past_valid = build.op("Less", [past_pos, past_real], "past_valid")  # [B, P]
    past_mask = build.op("Cast", [past_valid], "past_mask", to=mask.dtype)
    # A padding position (left-padded prompt, finished batch row) is masked for every query,
    # as the contiguous runtime's attention_mask does; the decoder adds causality itself.
    new_mask = build.op("Cast", [is_new], "new_mask", to=mask.dtype)
    build.op("Concat", [past_mask, new_mask], output=mask, axis=1)
    # Row index of every gathered K/V row, in the decoder's past layout [B, kv_heads, P]: the pool
    # viewed as [num_blocks*block_size*kv_heads, head_dim] has row (slot*kv_heads + head), and
    # slot = block_tables[b, j // block_size]*block_size + j % block_size. One Gather per pool
    # then yields past_key_values directly: no gathered copy to transpose (3x faster on ORT CPU
    # than Gather+Transpose at LLaVA widths), and the index is built once per step for all pools.
    bt64 = build.op("Cast", [block_tables], "bt64", to=ir.DataType.INT64)
    bt3 = build.op("Unsqueeze", [bt64, axis2], "bt3")  # [B, MB, 1]
    block_base = build.op("Mul", [bt3, bs], "block_base")
    slots3 = build.op("Add", [block_base, offsets], "slots3")  # [B, MB, bs]
    past_slots = build.op("Reshape", [slots3, flat_bp], "past_slots")  # [B, P]
    past_slots3 = build.op("Unsqueeze", [past_slots, axis1], "past_slots3")  # [B, 1, P]
    row_base = build.op("Mul", [past_slots3, heads], "row_base")
    row_idx = build.op("Add", [row_base, head_ids], "row_idx")  # [B, H, P]

    pools, rows_out = [], []
    for i in layers:
        for kind in tensor_names.KV_KINDS:
            pool = ir.val(tensor_names.cache(i, kind), kv_type, [pool_dim, block_size, kv_heads, head_dim])
            label = f"{kind}{i}_"
            # A view, not a copy: onnxruntime's Reshape aliases its input (the tests check that
            # no pool is copied), so only the gathered rows are read.
            rows = build.op("Reshape", [pool, rows_shape], label + "rows")  # [NB*bs*H, D]
            build.op("Gather", [rows, row_idx], output=past[(i, kind)], axis=0)  # [B, H, P, D]
            pools.append(pool)
            # present = past ++ this step's rows along the sequence axis: the rows are its last seq
            # positions, keys already rotated; they leave the graph in the pool's row layout.
            new = build.op("Slice", [present[(i, kind)], past_len1d, big, axis2], label + "new", after=True)
            out = ir.val(tensor_names.new_rows(i, kind), kv_type, [batch, seq, kv_heads, head_dim])
            build.op("Transpose", [new], output=out, perm=[0, 2, 1, 3], after=True)  # [B, S, H, D]
            rows_out.append(out)

    first = next(iter(graph), None)
    if first is None:
        graph.extend(build.prefix.nodes)
    else:
        graph.insert_before(first, build.prefix.nodes)
    graph.extend(build.suffix.nodes)
    _drop_copies_of_past(graph, past.values())
    # Cache inputs follow the other inputs, in layer order, as the architecture doc lists them.
    graph.inputs.extend([*kept_inputs, *pools, block_tables, slot_mapping, context_lens])
    graph.outputs.extend([*kept_outputs, *rows_out])
    return layers


def _drop_copies_of_past(graph: ir.Graph, values) -> int:
    """Remove single-input Concats of a gathered past (``torch.cat([past], dim)`` in the export): each
    is a whole copy of the past, the largest tensor of a decode step (measured on the 512 M LLaVA at
    batch 8 and 608 tokens: 80 MB, about a tenth of the step), and computes nothing. Their users read
    the past itself; returns how many went."""
    dropped = 0
    for value in values:
        for node, _ in list(value.uses()):
            out = node.outputs[0]
            if node.op_type != "Concat" or len(node.inputs) != 1 or out.is_graph_output():
                continue
            ir.convenience.replace_all_uses_with(out, value)
            graph.remove(node, safe=True)
            dropped += 1
    return dropped


def _dim(value: ir.Value | None, axis: int, default: str) -> int | str:
    """A dimension of a graph input for the new IO's shapes: its size, its symbol, or ``default``."""
    if value is None or value.shape is None or len(value.shape) <= axis:
        return default
    dim = value.shape[axis]
    if isinstance(dim, int):
        return dim
    return dim.value or f"d{axis}"


class _Builder:
    """Records the nodes and constants this pass adds, each named with :data:`PREFIX`.

    Nodes go to one of two tapes, ``prefix`` (before the decoder) and ``suffix`` (after it), not
    yet in the graph, so the caller places them; constants are registered as initializers at once.
    """

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.prefix = ir.tape.Tape()
        self.suffix = ir.tape.Tape()
        self.count = 0

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        value = ir.val(PREFIX + name, const_value=ir.tensor(array, name=PREFIX + name))
        self.graph.register_initializer(value)
        return value

    def op(
        self,
        op_type: str,
        inputs: list[ir.Value],
        name: str | None = None,
        output: ir.Value | None = None,
        after: bool = False,
        **attributes,
    ) -> ir.Value:
        """One node (in ``suffix`` if ``after``); its output is ``output``, or a new value ``PREFIX + name``."""
        self.count += 1
        tape = self.suffix if after else self.prefix
        value = tape.op(
            op_type, inputs, attributes or None, name=f"{PREFIX}{op_type}_{self.count}", output=output
        )
        if output is None:
            value.name = PREFIX + name
        return value


def sample_feeds(package, name: str, block_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Consistent sample inputs for a paged graph: two sequences with shuffled blocks, one padded position.

    Generated samples (zeros everywhere) would make every position padding and every past empty.
    """
    return dict(iter_sample_feeds(package, name, block_size, seed))


def iter_sample_feeds(package, name: str, block_size: int, seed: int = 0):
    """:func:`sample_feeds` one array at a time, (name, array) in the graph's input order (the same values)."""
    rng = np.random.default_rng(seed)
    specs = {i["name"]: i for i in package.info(name)["inputs"]}
    batch, seq, past, real = 2, 3, [5, 2], [3, 2]  # row 1 is left-padded by one position
    max_blocks = max(-(-(p + seq) // block_size) for p in past)
    pool_dim = specs[tensor_names.cache(min(tensor_names.cache_layers(specs)), "key")]["shape"][0]
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
    fixed: dict[str, np.ndarray] = {"block_tables": tables, "slot_mapping": slots, "context_lens": ctx}
    yield from fixed.items()
    sizes = {"batch": batch, "sequence": seq, NUM_BLOCKS_DIM: nb}
    for n, spec in specs.items():
        if n in fixed:
            continue
        shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in spec["shape"]]
        if n == "position_ids":
            yield n, np.broadcast_to(pos, shape).astype(spec["dtype"])
        elif np.dtype(spec["dtype"]).kind == "f":
            yield n, rng.standard_normal(shape).astype(spec["dtype"])
        else:
            yield n, np.zeros(shape, spec["dtype"])
