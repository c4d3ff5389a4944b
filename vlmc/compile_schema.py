"""compile.json's schema as declarative data (the manifest's schema language), its cross-field rules and bounds.

A build directory is untrusted input like a package (docs/security.md): ``vlmc run BUILD_DIR`` reads
compile.json's ``builds[*]`` runner facts and the tensor-parallel host plan, and allocates feeds and
paged pools from them. Everything the runner reads is typed and bounded here (``vlmc schema compile``
prints the JSON Schema, docs/compile.schema.json), the references between fields are checked in
:func:`cross_check`, and the memory the largest gear and the paged pools need is checked against
this machine's available memory in :func:`check_memory`, all before any graph is loaded.
Keys the runner does not read (the lowering reports, ATC commands, notes) are bounded facts.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vlmc import limits, memory, tensor_names
from vlmc.errors import VlmcError
from vlmc.manifest_schema import (
    DTYPES,
    NAME,
    REL_PATH,
    SCALAR_FACTS,
    SYMBOL,
    Facts,
    Int,
    List,
    Map,
    Nullable,
    Obj,
    OneOf,
    Req,
    SchemaError,
    Str,
    Tagged,
    _show,
)

logger = logging.getLogger(__name__)

# ATC takes at most 100 profiles in --dynamic_dims (vlmc/backends/ascend/atc.py, MAX_PROFILES).
MAX_PROFILES = 100
# One dimension of a build input at a gear (sequence, batch, patches, pool blocks).
MAX_DIM = 1 << 31
# Dtypes a build's IO may have: the manifest's that numpy (the host side) holds.
IO_DTYPES = tuple(d for d in DTYPES if d not in ("bfloat16", "int4", "uint4", "float8_e4m3fn", "float8_e5m2"))

BUILD_NAME = Str(128, pattern=NAME, doc="a build name (also its om/ and builds/ entry)")
GRAPH_NAME = Str(128, pattern=NAME, doc="a graph of the runtime package's vlmc.json")
DIM = OneOf((Int(0, MAX_DIM), SYMBOL), "a dimension: an int or a symbol")
INPUT = Obj(
    {
        "name": Req(Str(1024, min_len=1)),
        "dtype": Req(Str(choices=IO_DTYPES)),
        "shape": Req(List(Int(-1, MAX_DIM), 0, 16, doc="the build's shape: -1 where the gear decides")),
        "dims": Req(List(DIM, 0, 16, doc="the graph's symbolic dims, axis by axis")),
    },
    SCALAR_FACTS,
)
OUTPUT = Obj(
    {
        "name": Req(Str(1024, min_len=1)),
        "dtype": Req(Str(choices=IO_DTYPES)),
        "dims": Req(List(DIM, 0, 16)),
    },
    SCALAR_FACTS,
)
BUILD = Obj(
    {
        "name": Req(BUILD_NAME),
        "graph": Req(GRAPH_NAME),
        "variant": Req(Str(64, pattern=NAME, doc="full, prefill or decode")),
        "file": Req(REL_PATH),
        "om": Req(REL_PATH),
        "inputs": Req(List(INPUT, 0, 1024)),
        "outputs": Req(List(OUTPUT, 1, 1024)),
        "gears": Req(
            List(List(Int(1, MAX_DIM), 1, 64), 0, MAX_PROFILES, doc="one value per -1 of the input shapes")
        ),
        "gear_symbols": Req(List(SYMBOL, 0, 64)),
        "bindings": Req(
            Map(List(Int(0, MAX_DIM), 1, MAX_PROFILES), key=r"[^\x00-\x1f]{1,128}", max_items=64)
        ),
        "rank": Int(0, limits.MAX_HEADS - 1, doc="tensor-parallel builds: the rank that runs it"),
        "segment": Int(0, 1 << 20),
    },
    Facts(depth=4, max_items=65536, max_str=1 << 20),
)
SEGMENT = Obj(
    {
        "step": Req(Str(choices=("segment",))),
        "graphs": Req(List(GRAPH_NAME, 1, limits.MAX_HEADS, doc="the segment's graph on each rank")),
        "builds": Req(List(Map(BUILD_NAME, key=NAME, max_items=8), 1, limits.MAX_HEADS)),
    },
    SCALAR_FACTS,
)
ALL_REDUCE = Obj(
    {
        "step": Req(Str(choices=("all_reduce",))),
        "op": Req(Str(choices=("sum",))),
        "input": Req(Str(1024, min_len=1)),
        "output": Req(Str(1024, min_len=1)),
    },
    SCALAR_FACTS,
)
TENSOR_PARALLEL = Obj(
    {
        "size": Req(Int(2, limits.MAX_HEADS, doc="ranks; the runtime package's tensor_parallel.size")),
        "plan": Req(List(Tagged("step", {"segment": SEGMENT, "all_reduce": ALL_REDUCE}), 1, 1 << 16)),
        "ranks": Map(List(BUILD_NAME, 0, 65536), key=r"[0-9]{1,6}", max_items=limits.MAX_HEADS),
        "replicated_builds": List(BUILD_NAME, 0, 65536),
        "rank_table": Req(REL_PATH),
        "kv_heads_per_rank": Int(1, limits.MAX_HEADS),
    },
    Facts(depth=4, max_items=65536),
)
COMPILE = Obj(
    {
        "backend": Req(Str(choices=("ascend",))),
        "builds": Req(List(BUILD, 1, 65536)),
        "runner": Req(Obj({"runtime_package": Req(REL_PATH)}, Facts(depth=3))),
        "tensor_parallel": Nullable(TENSOR_PARALLEL),
        "paged_kv": Nullable(Facts(depth=4, max_items=65536)),
        "graphs": Facts(depth=12, max_items=1 << 20, max_str=1 << 20),
        "target": Facts(depth=4),
        "warnings": List(Str(1 << 16), 0, 65536),
    },
    Facts(depth=8, max_items=65536, max_str=1 << 20),
)


def check(summary: Any, where: str) -> dict:
    """compile.json against :data:`COMPILE`, then :func:`cross_check` without the runtime package."""
    try:
        COMPILE.check(summary, "")
    except SchemaError as exc:
        raise VlmcError(f"{where}: {exc}") from None
    cross_check(summary, None, where)
    return summary


def _dynamic(build: dict) -> int:
    return sum(1 for i in build["inputs"] for d in i["shape"] if d == -1)


def cross_check(summary: dict, manifest: dict | None, where: str) -> None:
    """References between fields, and to the runtime package's manifest when given.

    Build names are unique; every gear gives one value per -1 of the input shapes; a build's input
    shape and dims have one entry per axis; every graph a build or the plan names is a graph of the
    runtime package; the tensor-parallel plan names, for every rank, existing builds of that rank's
    graph, and every all-reduce reads a tensor the segment before it returns and feeds one the segment
    after it takes.
    """
    builds = summary["builds"]
    by_name: dict[str, dict] = {}
    for i, b in enumerate(builds):
        at = f"{where}: builds[{i}] ({b['name']})"
        if b["name"] in by_name:
            raise VlmcError(f"{at}: the name is used by another build too")
        by_name[b["name"]] = b
        for spec in b["inputs"]:
            if len(spec["shape"]) != len(spec["dims"]):
                raise VlmcError(
                    f"{at}: input {_show(spec['name'])} has {len(spec['shape'])} shape entries and "
                    f"{len(spec['dims'])} dims"
                )
        n = _dynamic(b)
        if b["gears"] and len(b["gear_symbols"]) != n:
            raise VlmcError(f"{at}: {len(b['gear_symbols'])} gear_symbols for {n} -1 entries of the inputs")
        if not b["gears"] and n:
            raise VlmcError(f"{at}: the inputs have {n} -1 entries but the build has no gears")
        for g, gear in enumerate(b["gears"]):
            if len(gear) != n:
                raise VlmcError(f"{at}: gears[{g}] has {len(gear)} values for {n} -1 entries of the inputs")
        if manifest is not None and b["graph"] not in manifest["graphs"]:
            raise VlmcError(f"{at}: graph {_show(b['graph'])} is not a graph of the runtime package")
    tp = summary.get("tensor_parallel")
    if not tp:
        ranked = next((b["name"] for b in builds if "rank" in b), None)
        if ranked is not None:
            raise VlmcError(
                f"{where}: build {ranked} has a rank but compile.json has no tensor_parallel section"
            )
        return
    _check_plan(tp, by_name, manifest, where)


def _check_plan(tp: dict, by_name: dict[str, dict], manifest: dict | None, where: str) -> None:
    size = tp["size"]
    graphs = {b["graph"] for b in by_name.values()}
    for name, b in by_name.items():
        if b.get("rank", 0) >= size:
            raise VlmcError(f"{where}: build {name} is for rank {b['rank']}, the build has {size} ranks")
    for r, names in (tp.get("ranks") or {}).items():
        for name in names:
            if name not in by_name or by_name[name].get("rank") != int(r):
                raise VlmcError(
                    f"{where}: tensor_parallel.ranks.{r} names {_show(name)}, not a build of rank {r}"
                )
    for name in tp.get("replicated_builds") or []:
        if name not in by_name or "rank" in by_name[name]:
            raise VlmcError(
                f"{where}: tensor_parallel.replicated_builds names {_show(name)}, not a replicated build"
            )
    plan = tp["plan"]
    for s, step in enumerate(plan):
        at = f"{where}: tensor_parallel.plan[{s}]"
        if step["step"] == "segment":
            if len(step["graphs"]) != size or len(step["builds"]) != size:
                raise VlmcError(
                    f"{at}: names {len(step['graphs'])} graphs and {len(step['builds'])} build sets for {size} ranks"
                )
            for r, (graph, named) in enumerate(zip(step["graphs"], step["builds"])):
                if graph not in graphs:
                    raise VlmcError(f"{at}: graph {_show(graph)} of rank {r} has no build")
                for name in named.values():
                    b = by_name.get(name)
                    if b is None or b["graph"] != graph or b.get("rank", r) != r:
                        raise VlmcError(f"{at}: {_show(name)} is not a build of {graph} for rank {r}")
    for s, step in enumerate(plan):  # every segment's builds exist (above); now what flows between them
        at = f"{where}: tensor_parallel.plan[{s}]"
        if step["step"] == "segment":
            continue
        before = next((p for p in reversed(plan[:s]) if p["step"] == "segment"), None)
        after = next((p for p in plan[s + 1 :] if p["step"] == "segment"), None)
        if before is None or after is None:
            raise VlmcError(f"{at}: an all_reduce must sit between two segments")
        made = {o["name"] for n in before["builds"][0].values() for o in by_name[n]["outputs"]}
        taken = {i["name"] for n in after["builds"][0].values() for i in by_name[n]["inputs"]}
        if step["input"] not in made:
            raise VlmcError(f"{at}: input {_show(step['input'])} is not an output of the segment before it")
        if step["output"] not in taken:
            raise VlmcError(f"{at}: output {_show(step['output'])} is not an input of the segment after it")
    if manifest is None:
        return
    own = manifest.get("tensor_parallel")
    if not own or own.get("size") != size:
        raise VlmcError(
            f"{where}: tensor_parallel.size {size} is not the runtime package's "
            f"({own.get('size') if own else 'not tensor-parallel'})"
        )
    keys = ("step", "graphs", "input", "output")
    if [tuple(p.get(k) for k in keys) for p in plan] != [tuple(p.get(k) for k in keys) for p in own["plan"]]:
        raise VlmcError(
            f"{where}: tensor_parallel.plan does not match the runtime package's; re-run `vlmc compile`"
        )


def _feed_bytes(build: dict, gear: list[int] | None) -> int:
    values = iter(gear or [])
    total = 0
    for spec in build["inputs"]:
        n = np.dtype(spec["dtype"]).itemsize
        for d in spec["shape"]:
            n *= next(values) if d == -1 else d
        total += n
    return total


def check_memory(summary: dict, manifest: dict, where: str, rank: int | None = None) -> int:
    """The bytes the largest gear's feeds and the paged pools need; VlmcError above the available memory.

    Checked before anything is allocated: a gear of 10^12 tokens or a pool of 16 M blocks in a tampered
    compile.json or runtime vlmc.json is one line, not a MemoryError in the middle of a run. Returns the
    bytes needed (the runner logs it).
    """
    builds = [b for b in summary["builds"] if rank is None or b.get("rank", rank) == rank]
    feeds, widest = 0, None
    for b in builds:
        for gear in b["gears"] or [None]:
            n = _feed_bytes(b, gear)
            if n > feeds:
                feeds, widest = n, (b["name"], gear)
    pools = 0
    kv = manifest["kv"]
    if kv.get("layout") == "paged" and isinstance(kv.get("num_blocks"), int):
        tp = manifest.get("tensor_parallel") or {}
        heads = tp.get("kv_heads_per_rank", kv["kv_heads"]) if rank is not None else kv["kv_heads"]
        block = (
            kv["num_blocks"] * (kv.get("block_size") or 1) * heads * kv["head_dim"] * 4
        )  # fp32 on the host
        pools = 2 * kv["layers"] * block
    for b in builds:  # pools held as build inputs must match the package's (a pool input per layer)
        for spec in b["inputs"]:
            if spec["name"].startswith(tuple(tensor_names.CACHE_PREFIX.values())) and spec["shape"]:
                blocks = spec["shape"][0]
                if isinstance(kv.get("num_blocks"), int) and blocks not in (-1, kv["num_blocks"]):
                    raise VlmcError(
                        f"{where}: build {b['name']} input {spec['name']} has {blocks} blocks, the runtime "
                        f"package's kv.num_blocks is {kv['num_blocks']}; re-run `vlmc compile`"
                    )
    need = feeds + pools
    have = memory.available()
    if need > have:
        what = f"build {widest[0]} at gear {widest[1]}" if widest and widest[1] else "the builds"
        raise VlmcError(
            f"{where}: {what} needs {need / 2**30:.1f} GiB for its inputs and the paged pools "
            f"({pools / 2**30:.1f} GiB), more than the {have / 2**30:.1f} GiB this machine has available; "
            "compile with smaller gears or pools"
        )
    return need


def json_schema() -> dict:
    s = COMPILE.json()
    s.update(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://vlmc.dev/compile.schema.json",
            "title": "vlmc compile output (compile.json, the ascend backend)",
        }
    )
    return s
