"""`vlmc run BUILD_DIR` on a tensor-parallel compile output: one process per rank on its own builds.

Each rank opens the build restricted to its rank's builds (plus the replicated embed and vision), runs
compile.json's host plan on the reference executor (the lowered graphs on CPU, strict about gears and
dtypes), and the ranks are joined by torch.distributed with gloo: the collective chosen for the
reference executor. The ground truth is the unsharded package on onnxruntime and the unsharded build
on the same executor. The hccl path (``--executor acl``) cannot run here: its selection and refusal are
tested, not its numbers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vlmc import manager, recipe
from vlmc.backends import ascend
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline, collective
from vlmc.runtime.executors import build as runner
from vlmc.runtime.ranks import RankDecoder, RankGroup

PROMPTS = ["Describe the image."]
IMAGES = [["demo"]]
TOKENS = 4
TARGET = {"soc": "Ascend910B2", "sequence_buckets": [64, 256]}
INT4 = {"decoder": {"weights": "int4", "group_size": 32}, "eval_samples": 0, "eval_tokens": 0}
PAGED = {"paged_kv": {"block_size": 16}}
# name -> (passes of the unsharded reference, passes of the sharded one)
SPECS = {
    "plain": ([], [{"tensor_parallel": {"size": 2}}]),
    "paged": ([PAGED], [{"tensor_parallel": {"size": 2}}, PAGED]),
    "int4": ([{"quantize": INT4}], [{"tensor_parallel": {"size": 2}}, {"quantize": INT4}]),
    "plain-tp4": ([], [{"tensor_parallel": {"size": 4}}]),
}


def _package(src: Path, out: Path, passes: list[dict]) -> Path:
    if not passes:
        return src
    manager.run(Package.load(src), recipe.from_dict({"passes": passes}).steps).save(out)
    return out


@pytest.fixture(scope="module")
def built(tiny_llava, tmp_path_factory):
    """name -> {"ref": (package, build), "tp": (package, build)}; unsharded references shared by name."""
    root = tmp_path_factory.mktemp("tp-builds")
    out: dict[str, dict[str, tuple[Path, Path]]] = {}
    refs: dict[str, tuple[Path, Path]] = {}
    for name, (ref_passes, tp_passes) in SPECS.items():
        key = json.dumps(ref_passes)
        if key not in refs:
            pkg = _package(tiny_llava, root / f"{name}-ref", ref_passes)
            ascend.compile(Package.load(pkg), root / f"{name}-ref-910b", dict(TARGET))
            refs[key] = (pkg, root / f"{name}-ref-910b")
        pkg = _package(tiny_llava, root / f"{name}-tp", tp_passes)
        ascend.compile(Package.load(pkg), root / f"{name}-tp-910b", dict(TARGET))
        out[name] = {"ref": refs[key], "tp": (pkg, root / f"{name}-tp-910b")}
    return out


@pytest.fixture(scope="module")
def groups(built):
    """One rank group per size on the reference executor, shared by the checks (process start costs seconds)."""
    started: dict[int, RankGroup] = {}

    def get(name: str) -> RankGroup:
        build = built[name]["tp"][1]
        size = json.loads((build / "compile.json").read_text())["tensor_parallel"]["size"]
        if size not in started:
            started[size] = RankGroup(build, executor="reference")
        else:
            started[size].open(build)
        return started[size]

    yield get
    for g in started.values():
        g.close()


def _build_run(build: Path):
    pkg, executor = runner.open_build(build, "reference")
    pipe = Pipeline(pkg, executor=executor)
    try:
        return pipe.generate(PROMPTS, IMAGES, TOKENS)
    finally:
        pipe.close()


# Largest |logit| difference from the unsharded build on the same executor. The ranks add their partial
# sums in another order than the unsharded MatMul; with INT4 weights the segments' fp16 outputs round
# differently too (measured: plain 2.9e-06, paged 1.7e-05, int4 6.3e-03).
LOGIT_TOLERANCE = {"plain": 1e-4, "paged": 1e-4, "int4": 2e-2, "plain-tp4": 1e-4}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "paged", "int4", "plain-tp4"])
def test_tp_build_is_token_exact_with_the_unsharded_build_and_package(name, built, groups):
    (ref_pkg, ref_build), (_, tp_build) = built[name]["ref"], built[name]["tp"]
    want_pkg = Pipeline(Package.load(ref_pkg)).generate(PROMPTS, IMAGES, TOKENS)
    want = _build_run(ref_build)
    group = groups(name)
    runs_before, reduces_before = group.runs(), group.collectives()
    got = group.generate(PROMPTS, IMAGES, TOKENS)  # also checks every rank produced the same tokens
    assert got.tokens == want.tokens == want_pkg.tokens and len(got.tokens[0]) == TOKENS
    tol = LOGIT_TOLERANCE[name]
    for a, b in zip([got.prefill_logits, *got.step_logits], [want.prefill_logits, *want.step_logits]):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)
    # The collective really is gloo (torch.distributed's own report), chosen for the reference executor.
    assert group.backends() == ["gloo"] * group.size
    summary = json.loads((tp_build / "compile.json").read_text())
    tp = summary["tensor_parallel"]
    layers = Package.load(ref_pkg).manifest["kv"]["layers"]
    steps = len(got.step_logits)
    assert [a - b for a, b in zip(group.collectives(), reduces_before)] == [2 * layers * steps] * tp["size"]
    # Each rank ran every one of its own builds (prefill and decode variants) and the replicated ones,
    # and no other rank's: its executor holds nothing else (open_build(..., rank=r)).
    for rank, (after, before) in enumerate(zip(group.runs(), runs_before)):
        ran = {b for b, n in after.items() if n > before.get(b, 0)}
        assert ran == set(tp["ranks"][str(rank)]) | set(tp["replicated_builds"])
    # In the plan's order: segment builds of one step, then the all-reduce that follows it.
    segments = [s for s in tp["plan"] if s["step"] == "segment"]
    assert len(segments) == 2 * layers + 1 and all(len(s["builds"]) == tp["size"] for s in segments)


def test_paged_tp_build_gives_each_rank_a_pool_of_its_kv_heads(built):
    """Per-rank paged KV: each rank's pools hold its share of the KV heads, with the unsharded pool's
    block count (block 0 reserved); the strict reference device refuses any other pool shape."""
    ref = json.loads((built["paged"]["ref"][1] / "compile.json").read_text())
    tp = json.loads((built["paged"]["tp"][1] / "compile.json").read_text())

    def pools(summary, build_name):
        b = next(b for b in summary["builds"] if b["name"] == build_name)
        return {
            i["name"]: i["shape"] for i in b["inputs"] if i["name"].startswith(("key_cache.", "value_cache."))
        }

    # The unsharded build takes its pools stacked, [layers, num_blocks, ...] (stack_kv.py).
    whole = next(
        i["shape"][1:]
        for b in ref["builds"]
        if b["name"] == "decoder_decode"
        for i in b["inputs"]
        if i["name"] == "key_cache"
    )
    heads = tp["tensor_parallel"]["kv_heads_per_rank"]
    assert heads * tp["tensor_parallel"]["size"] == whole[2]
    for rank in range(tp["tensor_parallel"]["size"]):
        shapes = pools(tp, f"decoder.rank{rank}.0_decode")
        assert shapes == {
            "key_cache.0": [whole[0], whole[1], heads, whole[3]],
            "value_cache.0": shapes["value_cache.0"],
        }
    # The runtime package each rank reads fixes the pool size to the builds' (the allocator's block count).
    _, runtime = runner.read_build(built["paged"]["tp"][1])
    assert runtime.manifest["kv"]["num_blocks"] == whole[0]


@pytest.mark.slow
def test_vlmc_run_on_a_tp_build_starts_the_ranks_and_agrees_with_the_package(built):
    (ref_pkg, _), (_, tp_build) = built["plain"]["ref"], built["plain"]["tp"]
    want = Pipeline(Package.load(ref_pkg)).generate(PROMPTS, IMAGES, TOKENS)
    res = CliRunner().invoke(
        main,
        ["run", str(tp_build), "--executor", "reference", "--image", "demo", "--prompt", PROMPTS[0]]
        + ["--max-new-tokens", str(TOKENS), "--against", str(ref_pkg), "--json"],
    )
    assert res.exit_code == 0, res.output
    assert "starting 2 ranks (torch.distributed, gloo, each on the reference executor)" in res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["tokens"] == want.tokens
    assert out["agreement"]["tokens_agree"] == out["agreement"]["tokens"] == TOKENS
    assert out["agreement"]["max_logit_diff"] < 1e-4


# ---- the collective seam ------------------------------------------------------------------------------
def test_collective_is_chosen_from_the_executor():
    assert collective.for_executor("ort").backend == "gloo"
    assert collective.for_executor("reference").backend == "gloo"
    hccl = collective.for_executor("acl")
    assert hccl.backend == "hccl" and "torch_npu" in hccl.modules
    assert set(collective.COLLECTIVES) == {"ort", *runner.EXECUTORS}  # every executor has one
    with pytest.raises(VlmcError, match="no collective for executor 'cuda'"):
        collective.for_executor("cuda")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_hccl_without_torch_npu_names_it():
    """A real import probe (torch_npu is not installed here), not a patched module table."""
    hccl = collective.for_executor("acl")
    assert hccl.missing() == ["torch_npu"]
    with pytest.raises(VlmcError, match="torch_npu's hccl backend, but torch_npu does not import here"):
        hccl.check()
    with pytest.raises(VlmcError, match="torch_npu does not import"):
        hccl.join(0, 2, 1, 0)  # the rank's side refuses the same way before touching torch.distributed


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_acl_executor_on_a_tp_build_without_torch_npu_is_one_line(built):
    res = CliRunner().invoke(
        main,
        ["run", str(built["plain"]["tp"][1]), "--executor", "acl", "--prompt", "Hi", "--max-new-tokens", "2"],
    )
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlmc: error:"), res.output
    assert "torch_npu" in lines[0] and "hccl" in lines[0] and "--executor reference" in lines[0]
    if importlib.util.find_spec("acl") is None:
        assert "acl (pyACL)" in lines[0]


def test_rank_table_gives_each_rank_its_device(built, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(built["plain"]["tp"][1], build)
    assert runner.rank_devices(build, 2) == [0, 1]
    table = json.loads((build / "rank_table.json").read_text())
    table["server_list"][0]["device"] = [
        {"device_id": "6", "rank_id": "1"},
        {"device_id": "4", "rank_id": "0"},
    ]
    (build / "rank_table.json").write_text(json.dumps(table))
    assert runner.rank_devices(build, 2) == [4, 6]
    table["server_list"][0]["device"].pop()
    (build / "rank_table.json").write_text(json.dumps(table))
    with pytest.raises(VlmcError, match=r"gives ranks \[1\], the build has 2"):
        runner.rank_devices(build, 2)
    (build / "rank_table.json").write_text("{")
    with pytest.raises(VlmcError, match="is not a rank table"):
        runner.rank_devices(build, 2)


# ---- one rank's view of the build ---------------------------------------------------------------------
def test_a_rank_opens_only_its_own_builds(built):
    build = built["plain"]["tp"][1]
    tp = json.loads((build / "compile.json").read_text())["tensor_parallel"]
    _, executor = runner.open_build(build, "reference", rank=1)
    held = {b.name for specs in executor.builds.values() for b in specs}
    assert held == set(tp["ranks"]["1"]) | set(tp["replicated_builds"])
    with pytest.raises(VlmcError, match="no build of graph 'decoder.rank0.0'"):
        executor.inputs("decoder.rank0.0")
    with pytest.raises(VlmcError, match="rank 2 is not one of the build's 2 tensor-parallel ranks"):
        runner.open_build(build, "reference", rank=2)


def test_single_process_run_of_a_tp_build_is_refused(built):
    pkg, executor = runner.open_build(built["plain"]["tp"][1], "reference")
    with pytest.raises(VlmcError, match="split over 2 ranks"):
        Pipeline(pkg, executor=executor).generate(PROMPTS, IMAGES, 2)
    res = CliRunner().invoke(
        main,
        [
            "run",
            str(built["plain"]["tp"][1]),
            "--executor",
            "reference",
            "--device-id",
            "1",
            "--prompt",
            "Hi",
        ],
    )
    assert res.exit_code == 2 and "rank_table.json names" in res.output


def test_rank_follows_compile_json_plan_only_if_it_matches_the_package(built):
    summary, pkg = runner.read_build(built["plain"]["tp"][1])
    plan = summary["tensor_parallel"]["plan"]
    decoder = RankDecoder(pkg.manifest, 1, None, plan=plan)
    assert decoder.graphs() == [s["graphs"][1] for s in plan if s["step"] == "segment"]
    assert decoder.tp["plan"][0]["builds"][1]["decode"] == "decoder.rank1.0_decode"
    swapped = [dict(s) for s in plan]
    swapped[0]["graphs"] = swapped[0]["graphs"][::-1]
    with pytest.raises(VlmcError, match="does not match the runtime package's"):
        RankDecoder(pkg.manifest, 1, None, plan=swapped)


@pytest.mark.slow
def test_a_rank_that_fails_mid_step_stops_the_group_in_one_line(built, tmp_path):
    """Rank 1 cannot load its second attention segment; rank 0 is then blocked in the all-reduce after
    its own. The group reports rank 1's error and stops, instead of waiting out the collective's timeout."""
    build = tmp_path / "build"
    shutil.copytree(built["plain"]["tp"][1], build)
    summary = json.loads((build / "compile.json").read_text())
    broken = next(b for b in summary["builds"] if b["name"] == "decoder.rank1.2_prefill")
    # A well-formed ONNX file (open_build checks every build's file before the ranks start) that the
    # device cannot load: an op no runtime knows, so rank 1 fails when it reaches the segment.
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="vlmc.test.unknown")
    graph = helper.make_graph(
        [node], "broken", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]
    )
    (build / broken["file"]).write_bytes(helper.make_model(graph).SerializeToString())
    group = RankGroup(build, executor="reference")
    try:
        start = time.monotonic()
        with pytest.raises(VlmcError) as err:
            group.generate(PROMPTS, IMAGES, TOKENS)
        took = time.monotonic() - start
    finally:
        group.close()
    message = str(err.value)
    assert message.startswith("tensor-parallel generate failed: rank 1:") and "\n" not in message, message
    assert took < 60, took  # the collective's own timeout is 300 s


def test_a_plan_naming_other_builds_than_the_build_list_is_refused(built, tmp_path):
    from vlmc.runtime.ranks import _Target

    build = tmp_path / "build"
    shutil.copytree(built["plain"]["tp"][1], build)
    decoder, pipe = _Target(build, "reference").open(1, None, None)  # what rank 1's process opens
    assert decoder.graphs()[0] == "decoder.rank1.0" and pipe.executor.builds.keys() >= set(decoder.graphs())
    summary = json.loads((build / "compile.json").read_text())
    summary["tensor_parallel"]["plan"][0]["builds"][1] = {"prefill": "decoder.rank0.0_prefill"}
    (build / "compile.json").write_text(json.dumps(summary))
    # compile.json's own check (vlmc/compile_schema.py) refuses it before any rank opens a build
    with pytest.raises(
        VlmcError, match=r"'decoder.rank0.0_prefill' is not a build of decoder.rank1.0 for rank 1"
    ):
        _Target(build, "reference").open(1, None, None)
