"""Gear planning: turn each graph's symbolic dims into ATC --input_shape and --dynamic_dims profiles.

A graph is built the way it runs. The decoder gets a prefill build (no past, sequence gears) and a
decode build (sequence 1, past-length gears; for paged KV a static block pool with batch gears).
Each symbolic dim is bound to a list of values; the profiles are the product of the free symbols'
values, and dims derived from them (``total_sequence = past_sequence + sequence``) follow. A symbol
with one value becomes a static dimension; a build whose symbols all have one value is static.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmc.backends.ascend import atc
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

SEQUENCE_DIMS = ("sequence", "past_sequence", "total_sequence")


@dataclass
class Build:
    """One ATC build of one graph: its static-or--1 input shapes and its gear profiles."""

    name: str
    graph: str
    variant: str  # "full" | "prefill" | "decode"
    input_shape: list[tuple[str, list[int]]]
    symbols: list[str] = field(default_factory=list)  # the symbol behind each -1, in input_shape order
    profiles: list[list[int]] = field(default_factory=list)  # --dynamic_dims, one value per -1
    bindings: dict[str, list[int]] = field(default_factory=dict)  # every symbol's values, for compile.json
    sequence: bool = False  # takes token sequences -> --input_format=ND
    file: str = ""  # the lowered ONNX file (under graphs/) the build reads

    @property
    def input_format(self) -> str:
        """ND for sequence graphs, any non-image input and every build with --dynamic_dims gears;
        NCHW only for a static all-4-D image build.

        The ATC --dynamic_dims page describes the option as gears "in ND format" and uses
        --input_format=ND in every example (hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--dynamic_dims.md),
        and aclmdlSetInputDynamicDims is documented for ND inputs.
        """
        if self.sequence or self.profiles or any(len(dims) != 4 for _, dims in self.input_shape):
            return "ND"
        return "NCHW"

    def input_shape_text(self) -> str:
        return ";".join(f"{n}:{','.join(str(d) for d in dims)}" for n, dims in self.input_shape)

    def dynamic_dims_text(self) -> str:
        return ";".join(",".join(str(v) for v in p) for p in self.profiles)


@dataclass
class DimContext:
    """What the planner knows about dims beyond the target options: manifest facts and samples."""

    fixed: dict[str, int | list[int]] = field(default_factory=dict)  # target option `dims`
    sample_shapes: dict[str, list[int]] = field(default_factory=dict)  # input name -> traced shape
    block_size: int | None = None
    patches: int | None = None  # patches per image, from the manifest's preprocessing facts
    max_positions: int | None = None
    # resolution gears (dynamic-resolution vision graphs): symbol -> (combine, per-image values), see
    # vlmc.runtime.preprocess.GearRule; a symbol the target's ``dims`` names is not here
    resolution: dict[str, tuple[str, list[int]]] = field(default_factory=dict)


def per_image(symbol: str) -> str:
    """The planner's own axis behind a ``paired`` resolution gear (never a graph dim)."""
    return f"{symbol}/image"


def free_values(variant: str, role: str, opts: dict, ctx: DimContext) -> dict[str, list[int]]:
    """Values of the symbols that vary independently in a build (before derived ones)."""
    seq_cap, past_cap = caps(ctx.max_positions)
    seq = _buckets(opts["sequence_buckets"], seq_cap)
    past = _buckets(opts.get("past_buckets") or opts["sequence_buckets"], past_cap)
    vals: dict[str, list[int]] = {
        "batch": sorted(set(opts["batch_sizes"])),
        "images": sorted(set(opts.get("images") or [1])),
    }
    if variant == "decode":
        vals["sequence"] = [1]
        vals["past_sequence"] = past
    elif role == "embed":
        # One embedding build serves prefill and decode, so decode's single token is a gear too.
        vals["sequence"] = sorted({1, *seq})
    else:
        vals["sequence"] = seq
    vals["past_sequence"] = vals.get("past_sequence", [0])
    max_context = max(max(seq), max(past) + 1)
    if ctx.block_size:
        max_blocks = math.ceil(max_context / ctx.block_size)
        vals["max_blocks"] = [max_blocks]
        vals["num_blocks"] = [pool_blocks(max_blocks, max(vals["batch"]))]
    for name, (combine, values) in ctx.resolution.items():
        if combine == "paired":  # name = images x a per-image gear, one gear per request (derived)
            vals[per_image(name)] = sorted(set(values))
        elif combine == "sum":  # the request's total, padded up to a gear
            vals[name] = sorted({n * v for n in vals["images"] for v in values})
        else:  # "max": a per-image axis, padded up to a gear
            vals[name] = sorted(set(values))
    for name, v in ctx.fixed.items():
        vals[name] = sorted(set(v)) if isinstance(v, list) else [int(v)]
    return vals


def pool_blocks(max_blocks: int, batch: int) -> int:
    """Blocks in a paged build's static pool: every sequence's ``max_blocks`` plus the reserved block 0.

    The runtime never hands out block 0 (vlmc/runtime/paged.py NULL_BLOCK: unused block-table entries
    point at it), so a pool of exactly ``max_blocks * batch`` would run out one block early.
    """
    return max_blocks * batch + 1


def caps(max_positions: int | None) -> tuple[int | None, int | None]:
    """The largest prefill sequence gear and the largest decode past gear the model's positions allow.

    A decode step at past ``p`` runs position ``p`` and attends ``p + 1`` positions, so past gears stop
    at ``max_positions - 1``; prefill runs positions ``0 .. s-1``, so sequence gears stop at ``max_positions``.
    (OPT's learned position table in BLIP-2 has exactly ``max_positions`` rows.)
    """
    if not max_positions:
        return None, None
    return max_positions, max(1, max_positions - 1)


def _buckets(values: list[int], cap: int | None) -> list[int]:
    """The bucket values with those above ``cap`` replaced by ``cap`` (so the model's longest input still has a gear)."""
    return sorted({min(v, cap) if cap else v for v in values})


def dropped_buckets(opts: dict, max_positions: int | None) -> list[str]:
    """One message per bucket option whose values exceed what the model's max_positions allows.

    Said once per compile by the caller: every build and every graph would otherwise repeat it.
    """
    seq_cap, past_cap = caps(max_positions)
    if not seq_cap:
        return []
    out = []
    for what, cap, why in (
        ("sequence_buckets", seq_cap, f"the model's max_positions {max_positions}"),
        ("past_buckets", past_cap, f"max_positions {max_positions} less the decoded token"),
    ):
        values = (
            opts.get(what) if what == "sequence_buckets" else opts.get(what) or opts.get("sequence_buckets")
        )
        over = sorted({v for v in values or [] if v > cap})
        if over:
            out.append(f"{what} above {why} are capped to {cap}: {over}")
    return out


def _derived(
    variant: str, ctx: DimContext
) -> tuple[dict[str, Callable[[dict[str, int]], int]], dict[str, list[str]]]:
    """Symbols computed from others: (symbol -> rule, symbol -> the axes it is computed from)."""
    out: dict[str, Callable[[dict[str, int]], int]] = {
        "total_sequence": lambda p: p.get("past_sequence", 0) + p["sequence"],
    }
    sources = {"total_sequence": ["past_sequence", "sequence"]}
    if ctx.patches:
        out["patches"] = lambda p: p["images"] * ctx.patches  # type: ignore[operator]
        sources["patches"] = ["images"]
    for name, (combine, _) in ctx.resolution.items():
        if combine == "paired":
            out[name] = lambda p, axis=per_image(name): p["images"] * p[axis]
            sources[name] = ["images", per_image(name)]
    return out, sources


def plan(
    name: str, graph: str, variant: str, role: str, inputs: list[dict], opts: dict, ctx: DimContext
) -> Build:
    """Plan one build.

    Args:
        name: the build's name (``decoder_prefill`` ...), used for file names.
        graph: the package graph it builds.
        variant: "full", "prefill" or "decode".
        role: the graph's manifest role.
        inputs: the (lowered) graph's inputs: ``{"name", "dtype", "shape"}`` with symbolic dims.
        opts: the validated target options.
        ctx: manifest facts and sample shapes.

    Raises:
        VlmcError: a dim cannot be resolved, or the plan needs more than 100 profiles.
    """
    free = free_values(variant, role, opts, ctx)
    derived, sources = _derived(variant, ctx)
    used: list[str] = []
    for inp in inputs:
        for i, d in enumerate(inp["shape"]):
            if isinstance(d, int):
                continue
            sym = d if d != "?" else f"{inp['name']}[{i}]"
            if sym in ctx.fixed or (sym in free and sym not in derived) or sym in derived:
                if sym not in used:
                    used.append(sym)
                continue
            sample = ctx.sample_shapes.get(inp["name"])
            if sample is not None and i < len(sample):
                free[sym] = [int(sample[i])]
                used.append(sym)
                logger.info(
                    "%s: dim %s of %s taken from the package's sample inputs (%d)",
                    name,
                    sym,
                    inp["name"],
                    sample[i],
                )
                continue
            raise VlmcError(
                f"{name}: input {inp['name']} has dim {d!r} that vlmc cannot size; give it in the "
                f"target's dims option, e.g. dims: {{{sym!r}: N}}"
            )
    # Derived symbols depend on their sources, which must be enumerated even if no input names them.
    axes = [s for s in used if s not in derived or s in ctx.fixed]
    for s in used:
        if s in derived and s not in ctx.fixed:
            axes += [src for src in sources.get(s, []) if src not in axes]
    axes = [a for a in axes if a in free]
    combos = list(itertools.product(*(free[a] for a in axes)))
    points = []
    for combo in combos:
        p = dict(zip(axes, combo))
        for s in used:
            if s in derived and s not in ctx.fixed:
                p[s] = derived[s](p)
        points.append(p)
    bindings = {s: sorted({p[s] for p in points}) for s in used}
    shape: list[tuple[str, list[int]]] = []
    symbols: list[str] = []
    for inp in inputs:
        dims = []
        for i, d in enumerate(inp["shape"]):
            if isinstance(d, int):
                dims.append(d)
                continue
            sym = d if d != "?" else f"{inp['name']}[{i}]"
            if len(bindings[sym]) == 1:
                dims.append(bindings[sym][0])
            else:
                dims.append(-1)
                symbols.append(sym)
        shape.append((inp["name"], dims))
    profiles: list[list[int]] = []
    if symbols:
        seen = set()
        for p in points:
            prof = tuple(p[s] for s in symbols)
            if prof not in seen:
                seen.add(prof)
                profiles.append(list(prof))
    if len(profiles) > atc.MAX_PROFILES:
        sizes = " x ".join(f"{len(free[a])} {a}" for a in axes if len(free[a]) > 1)
        hint = "use coarser sequence/past buckets or fewer batch sizes" + (
            ", or run the paged_kv pass so decode needs only batch gears" if variant == "decode" else ""
        )
        if any(s in ctx.resolution for s in used):
            hint += ", or fewer resolution gears (patch_gears, tile_gears, image_token_gears)"
        raise VlmcError(
            f"{name}: the gear plan needs {len(profiles)} profiles ({sizes}) but ATC allows at most "
            f"{atc.MAX_PROFILES}; {hint}"
        )
    if any(v <= 0 for p in profiles for v in p) or any(d == 0 for _, dims in shape for d in dims):
        raise VlmcError(f"{name}: a gear or static dim is 0; ATC needs positive sizes")
    is_sequence = any(isinstance(d, str) and d in SEQUENCE_DIMS for inp in inputs for d in inp["shape"])
    return Build(
        name=name,
        graph=graph,
        variant=variant,
        input_shape=shape,
        symbols=symbols,
        profiles=profiles,
        bindings=bindings,
        sequence=is_sequence,
    )
