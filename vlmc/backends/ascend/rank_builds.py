"""Tensor-parallel builds: the host plan in terms of builds and the rank table (docs/tensor_parallel.md)."""

from __future__ import annotations

from vlmc.backends.ascend import gears

# The collective the host calls between a rank's segment builds (no ONNX parser plugin registers an
# HCCL op, so no .om can hold it: docs/atc-facts.md, "Several cards").
_HCCL_SOURCES = [
    "hicann/hccl include/hccl.h: HcclAllReduce(sendBuf, recvBuf, count, dataType, op, comm, stream)",
    "hicann/hccl docs/api/context/HcclAllReduce.md",
    "hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--cluster_config.md (AllGather only, not on Atlas A2)",
]
RANK_TABLE = "rank_table.json"


def rank_table(size: int) -> dict:
    """A rank table for one server with ``size`` devices, device i as rank i (the layout in
    docs/atc-facts.md). ATC does not read it; HCCL reads it at run time."""
    return {
        "status": "completed",
        "version": "1.0",
        "server_count": "1",
        "server_list": [
            {
                "server_id": "node_0",
                "device": [{"device_id": str(i), "rank_id": str(i)} for i in range(size)],
            }
        ],
    }


def host_schedule(manifest: dict, builds: list[gears.Build]) -> dict | None:
    """The host plan of a tensor-parallel package in terms of builds, for compile.json; None otherwise.

    Each rank loads its own builds on its own device; a segment step runs the rank's build for the
    phase (``prefill`` or ``decode`` where the segment reads the KV cache, else the one ``full`` build),
    an all-reduce step calls HcclAllReduce (sum) from the named output into the next segment's input on every rank.
    """
    tp = manifest.get("tensor_parallel")
    if not tp:
        return None
    by_graph: dict[str, dict[str, str]] = {}
    for b in builds:
        by_graph.setdefault(b.graph, {})[b.variant] = b.name
    steps = []
    for step in tp["plan"]:
        if step["step"] == "segment":
            steps.append({**step, "builds": [by_graph[g] for g in step["graphs"]]})
        else:
            steps.append(
                {
                    **step,
                    "call": (
                        f"HcclAllReduce(sendBuf={step['input']}, recvBuf={step['output']}, count=batch*seq*hidden, "
                        "dataType=the segment output's (HCCL_DATA_TYPE_FP32 or _FP16), op=HCCL_REDUCE_SUM, comm, stream)"
                    ),
                }
            )
    size = int(tp["size"])
    return {
        "size": size,
        "ranks": {
            str(r): sorted(b.name for b in builds if manifest["graphs"][b.graph].get("rank") == r)
            for r in range(size)
        },
        "replicated_builds": sorted(b.name for b in builds if "rank" not in manifest["graphs"][b.graph]),
        "plan": steps,
        "kv_heads_per_rank": tp["kv_heads_per_rank"],
        "kv": tp["kv"],
        "rank_table": RANK_TABLE,
        "sources": list(_HCCL_SOURCES),
    }
