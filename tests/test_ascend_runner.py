"""Running a compile output: `vlmc run BUILD_DIR`, the reference executor, the dims vector and the build fixes it needs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from vlmc import pass_api
from vlmc.backends import ascend
from vlmc.backends.ascend import atc, gears, pools
from vlmc.backends.ascend.rules import _weight_only_matmul
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline
from vlmc.runtime.executors import build as runner
from vlmc.runtime.executors import reference
from vlmc.runtime.paged import BlockAllocator, OutOfBlocks

PROMPTS = ["Describe the image."]
IMAGES = [["demo"]]
BLOCK = 16
NEW_TOKENS = 5
SOC = "Ascend910B2"


def _target(pkg: Package, **extra) -> dict:
    """A small gear plan; a dynamic-resolution family's patch count is the demo picture's own."""
    target = {"soc": SOC, "sequence_buckets": [64, 256], **extra}
    vision = Pipeline(pkg).prepare(PROMPTS, IMAGES).vision
    if "image_grid_thw" in vision:
        target["dims"] = {"patches": int(vision["pixel_values"].shape[0])}
    return target


def _package(exported, name: str, layout: str, tmp_path: Path) -> Package:
    pkg = Package.load(exported(name))
    if layout == "paged":
        pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
        pkg.save(tmp_path / "paged")
        pkg = Package.load(tmp_path / "paged")
    return pkg


def _cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result


# ---- the dims vector ---------------------------------------------------------------------------------
def test_dims_vector_reproduces_the_atc_doc_example():
    # aclmdlSetInputDynamicDims / acl.mdl.set_input_dynamic_dims: input_shape
    # "data:1,1,40,-1;label:1,-1;mask:-1,-1", dynamic_dims "20,20,1,1;40,40,2,2;80,60,4,4"; gear 0 is
    # data(1,1,40,20) + label(1,20) + mask(1,1): dimCount 8, dims [1,1,40,20,1,20,1,1].
    text = "data:1,1,40,-1;label:1,-1;mask:-1,-1"
    shape = [(name, [int(d) for d in dims]) for name, dims in atc.parse_input_shape(text)]
    assert runner.dims_vector(shape, [20, 20, 1, 1]) == [1, 1, 40, 20, 1, 20, 1, 1]
    assert runner.dims_vector(shape, [80, 60, 4, 4]) == [1, 1, 40, 80, 1, 60, 4, 4]
    with pytest.raises(VlmcError, match="has 3 values but the input shape has 4"):
        runner.dims_vector(shape, [20, 20, 1])


# ---- reference executor == onnxruntime on the package --------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl", "tiny-blip2"])
def test_reference_executor_gives_the_package_tokens(exported, tmp_path, name, layout):
    pkg = _package(exported, name, layout, tmp_path)
    ref = Pipeline(pkg).generate(PROMPTS, IMAGES, NEW_TOKENS)
    summary = ascend.compile(pkg, tmp_path / "build", _target(pkg))
    run_pkg, executor = runner.open_build(tmp_path / "build", "reference")
    got = Pipeline(run_pkg, executor=executor).generate(PROMPTS, IMAGES, NEW_TOKENS)
    assert got.tokens == ref.tokens and len(got.tokens[0]) == NEW_TOKENS
    # Every build ran (prefill and decode included), each at a declared gear (the device checks that).
    assert set(executor.runs) == {b["name"] for b in summary["builds"]}
    report = runner.agreement(ref, got)
    assert report["first_divergence"] is None and report["tokens_agree"] == NEW_TOKENS
    # fp32 graphs on CPU; paged pools hold the rows in float16 (the device dtype), the rest is fp32.
    assert report["max_logit_diff"] < (2e-2 if layout == "paged" else 1e-4), report


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_merged_package_compiles_with_a_prefill_only_vlm_build(exported, tmp_path, layout):
    """The merged graph (role vlm) only prefills; its build takes no past, so no gear or dim is 0."""
    pkg = Package.load(exported("tiny-llava"))
    pass_api.get("merge")().run(pkg)
    if layout == "paged":
        pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
    pkg.save(tmp_path / "merged")
    pkg = Package.load(tmp_path / "merged")
    ref = Pipeline(pkg).generate(PROMPTS, IMAGES, NEW_TOKENS)
    summary = ascend.compile(pkg, tmp_path / "build", _target(pkg))
    vlm = [b for b in summary["builds"] if b["graph"] == "vlm"]
    assert [b["variant"] for b in vlm] == ["prefill" if layout == "contiguous" else "full"]
    assert not any(i["name"].startswith("past_") for b in vlm for i in b["inputs"])
    run_pkg, executor = runner.open_build(tmp_path / "build", "reference")
    got = Pipeline(run_pkg, executor=executor).generate(PROMPTS, IMAGES, NEW_TOKENS)
    assert got.tokens == ref.tokens and executor.runs[vlm[0]["name"]] == 1


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_batch_and_images_are_padded_to_their_gears(exported, tmp_path, layout):
    # 3 prompts on batch gears [1, 4] (one copied row), 2 images on image gears [1, 2], a text-only prompt.
    pkg = _package(exported, "tiny-llava", layout, tmp_path)
    prompts = ["Describe the image.", "What is it? Answer in a few words please.", "Hi"]
    images = [["demo"], ["demo:1"], []]
    ref = Pipeline(pkg).generate(prompts, images, 4)
    target = {"soc": SOC, "sequence_buckets": [64, 256], "batch_sizes": [1, 4], "images": [1, 2]}
    ascend.compile(pkg, tmp_path / "build", target)
    run_pkg, executor = runner.open_build(tmp_path / "build", "reference")
    got = Pipeline(run_pkg, executor=executor).generate(prompts, images, 4)
    assert got.tokens == ref.tokens
    assert runner.agreement(ref, got)["max_logit_diff"] < (5e-2 if layout == "paged" else 1e-4)


class _CountingPool(reference.HostPool):
    writes = 0

    def write(self, rows, slot_mapping):
        type(self).writes += 1
        super().write(rows, slot_mapping)

    def write_layer(self, layer, rows, slot_mapping):  # a stacked pool (stack_kv.py): one layer's rows
        type(self).writes += 1
        super().write_layer(layer, rows, slot_mapping)


def test_pools_held_by_the_device_take_the_same_path(paged_build, exported, tmp_path):
    # The NPU keeps the pools (PagedKV asks the executor's new_pool and stores rows with pool.write);
    # the reference device can hold them the same way, so that path is checked on CPU too.
    root, summary = paged_build
    run_pkg, _ = runner.open_build(root, "reference")
    device = reference.ReferenceDevice(device_pools=True)
    device.new_pool = _CountingPool
    executor = runner.BuildExecutor(root, summary, device)
    got = Pipeline(run_pkg, executor=executor).generate(PROMPTS, IMAGES, NEW_TOKENS)
    ref = Pipeline(_package(exported, "tiny-llava", "paged", tmp_path)).generate(PROMPTS, IMAGES, NEW_TOKENS)
    assert got.tokens == ref.tokens
    layers = run_pkg.manifest["kv"]["layers"]
    assert _CountingPool.writes == 2 * layers * NEW_TOKENS  # K and V of every layer, every step


def test_vlmc_run_build_matches_vlmc_run_package_for_paged_llava(exported, tmp_path):
    pkg = _package(exported, "tiny-llava", "paged", tmp_path)
    ascend.compile(pkg, tmp_path / "build", _target(pkg))
    args = ["--image", "demo", "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--json"]
    on_ort = _cli("run", str(pkg.root), *args)
    on_build = _cli("run", str(tmp_path / "build"), "--executor", "reference", *args)
    assert on_ort.exit_code == 0 and on_build.exit_code == 0, on_build.output
    assert json.loads(on_build.output)["tokens"] == json.loads(on_ort.output)["tokens"]
    # The runtime package beside the builds holds the manifest (no graphs), with the builds' pool size.
    kept = json.loads((tmp_path / "build" / "runtime" / "vlmc.json").read_text())
    assert not list((tmp_path / "build" / "runtime").glob("*.onnx"))
    compiled = json.loads((tmp_path / "build" / "compile.json").read_text())
    assert kept["kv"]["num_blocks"] == compiled["paged_kv"]["builds"]["decoder_decode"][0]


@pytest.mark.slow
def test_quantized_build_runs_and_reports_agreement(exported, tmp_path):
    pkg = Package.load(exported("tiny-llava"))
    pass_api.get("quantize")(
        vision_encoder={"weights": "int8", "activations": "int8", "calibration": {"count": 2}},
        decoder={"weights": "int8"},
        eval_tokens=0,
        eval_samples=0,
    ).run(pkg)
    pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
    pkg.save(tmp_path / "q")
    summary = ascend.compile(Package.load(tmp_path / "q"), tmp_path / "build", _target(pkg))
    rules = {g: r["lowering"]["rules"] for g, r in summary["graphs"].items()}
    assert rules["vision_encoder"]["qdq_matmul"]["applied"] > 0  # AscendQuant/AscendDequant on the path
    assert rules["decoder"]["weight_only_matmul"]["applied"] > 0  # NPUWeightQuantBatchMatmulV2
    out = _cli(
        "run", str(tmp_path / "build"), "--executor", "reference", "--against", str(tmp_path / "q"),
        "--image", "demo", "--prompt", PROMPTS[0], "--max-new-tokens", str(NEW_TOKENS), "--json",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)["agreement"]
    assert report["tokens"] == NEW_TOKENS and 0 <= report["tokens_agree"] <= NEW_TOKENS
    # The build emulates the 910B's fp16 quant arithmetic; the package runs QDQ in fp32: close, not equal.
    assert 0 < report["prefill_logit_diff"] < 1.0
    print(f"quantized tiny-llava build vs package: {report}")


# ---- strict: the reference device takes only declared gears and dtypes ----------------------------------
@pytest.fixture(scope="module")
def paged_build(exported, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paged_build")
    pkg = _package(exported, "tiny-llava", "paged", tmp)
    summary = ascend.compile(pkg, tmp / "build", _target(pkg))
    return tmp / "build", summary


def _spec(summary: dict, name: str) -> runner.BuildSpec:
    return runner.BuildSpec(next(b for b in summary["builds"] if b["name"] == name))


def test_reference_device_refuses_a_shape_that_is_not_a_gear(paged_build):
    root, summary = paged_build
    spec = _spec(summary, "embed_tokens")
    device = reference.ReferenceDevice()
    device.load(spec, root)
    ok = device.execute(spec, {"input_ids": np.zeros((1, 64), np.int64)}, [1, 64])
    assert ok["inputs_embeds"].shape[:2] == (1, 64)
    with pytest.raises(VlmcError, match=r"input shapes input_ids\[1, 63\] are not one of the build's gears"):
        device.execute(spec, {"input_ids": np.zeros((1, 63), np.int64)}, None)
    with pytest.raises(VlmcError, match="input input_ids is int32, the build declares int64"):
        device.execute(spec, {"input_ids": np.zeros((1, 64), np.int32)}, [1, 64])
    with pytest.raises(VlmcError, match="does not describe the feeds"):
        device.execute(spec, {"input_ids": np.zeros((1, 64), np.int64)}, [1, 256])


def test_reference_device_refuses_float32_pools(paged_build):
    root, summary = paged_build
    spec = _spec(summary, "decoder_decode")
    feeds = {}
    for i in spec.inputs:
        shape = [1 if d == -1 else d for d in i["shape"]]
        feeds[i["name"]] = np.zeros(shape, np.float32 if "cache" in i["name"] else np.dtype(i["dtype"]))
    device = reference.ReferenceDevice()
    device.load(spec, root)
    with pytest.raises(VlmcError, match="key_cache is float32, the build declares float16"):
        device.execute(spec, feeds, None)


def test_a_prompt_longer_than_every_gear_is_one_line(paged_build):
    root, _ = paged_build
    out = _cli("run", str(root), "--executor", "reference", "--prompt", "x" * 300, "--max-new-tokens", "2")
    assert out.exit_code != 0 and "Traceback" not in out.output
    assert "no gear holds sequence=" in out.output and "embed_tokens" in out.output


def test_acl_executor_is_import_guarded(paged_build):
    root, _ = paged_build
    from vlmc.runtime.executors import acl as acl_device

    if acl_device.available():
        pytest.skip("pyACL imports here")
    with pytest.raises(VlmcError, match="pyACL \\(acl\\) does not import here"):
        runner.open_build(root, "acl")
    assert runner.default_executor() == "reference"
    out = _cli("run", str(root), "--prompt", "Hi", "--max-new-tokens", "2", "--json")
    assert out.exit_code == 0 and len(json.loads(out.output.splitlines()[-1])["tokens"][0]) == 2


def test_executor_option_needs_a_compile_output(exported):
    out = _cli("run", str(exported("tiny-llava")), "--executor", "reference", "--prompt", "x")
    assert out.exit_code != 0 and "applies to a compile output" in out.output


def test_runner_facts_in_compile_json(paged_build):
    _, summary = paged_build
    assert summary["runner"]["dynamic_input"] == "ascend_mbatch_shape_data"
    for b in summary["builds"]:
        shape = [(i["name"], i["shape"]) for i in b["inputs"]]
        assert atc.parse_input_shape(b["input_shape"]) == [(n, [str(d) for d in s]) for n, s in shape]
        assert len(b["gears"]) == b["profiles"] and all(len(g) == len(b["gear_symbols"]) for g in b["gears"])
        if b["gears"]:
            assert len(b["dims_vector"]) == len(runner.dims_vector(shape, b["gears"][0]))
            assert b["dims_vector"][0] == f"{shape[0][0]}[0]"
        else:
            assert b["dims_vector"] is None


# ---- build fixes ---------------------------------------------------------------------------------------
def test_paged_pools_and_rows_are_float16_in_the_build(paged_build):
    root, summary = paged_build
    model = onnx.load(str(root / "graphs" / "decoder.onnx"), load_external_data=False)
    io = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    pools_io = {
        n: t for n, t in io.items() if n.startswith(("key_cache", "value_cache", "new_key.", "new_value."))
    }
    assert pools_io and set(pools_io.values()) == {TensorProto.FLOAT16}
    assert io["logits"] == TensorProto.FLOAT
    for b in summary["builds"]:
        if b["graph"] == "decoder":
            assert {i["dtype"] for i in b["inputs"] if "_cache" in i["name"]} == {"float16"}
            assert {o["dtype"] for o in b["outputs"] if o["name"].startswith("new_")} == {"float16"}
        # The graph's IO carries the dtype, so no ATC dtype flag is emitted (or advised).
        assert not {"input_fp16_nodes", "output_type"} & set(atc.parse_argv(b["argv"]))
    assert summary["paged_kv"]["dtype"] == "float16"
    # ... and the host-side advice matches what is emitted (it used to tell users to add the flags).
    assert "no --input_fp16_nodes/--output_type is needed" in summary["paged_kv"]["write"]["dtype"]


def _tiny_paged_graph() -> onnx.ModelProto:
    pool = helper.make_tensor_value_info("key_cache.0", TensorProto.FLOAT, [3, 2])
    rows = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])
    nodes = [
        helper.make_node("Add", ["key_cache.0", "x"], ["new_key.0"]),
        helper.make_node("Mul", ["new_key.0", "x"], ["logits"]),
    ]
    outs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 2]),
        helper.make_tensor_value_info("new_key.0", TensorProto.FLOAT, [3, 2]),
    ]
    graph = helper.make_graph(nodes, "g", [pool, rows], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fp16_pool_io_casts_at_the_boundary_only():
    graph = ir.from_proto(_tiny_paged_graph())
    assert pools.fp16_pool_io(graph) == ["key_cache.0", "new_key.0"]
    model = ir.to_proto(graph)
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Cast", "Add", "Mul", "Cast"]
    rng = np.random.default_rng(0)
    pool, x = rng.standard_normal((3, 2)).astype(np.float16), rng.standard_normal((3, 2)).astype(np.float32)
    logits, rows = ort.InferenceSession(model.SerializeToString()).run(None, {"key_cache.0": pool, "x": x})
    want = pool.astype(np.float32) + x
    np.testing.assert_allclose(logits, want * x, rtol=1e-6)  # computed in fp32 from the fp16 pool
    assert rows.dtype == np.float16 and np.array_equal(rows, want.astype(np.float16))
    # Nothing to do: a graph without pools, or one already in float16, is left as it is.
    assert pools.fp16_pool_io(graph) == []


def test_pool_counts_the_reserved_block(paged_build):
    _, summary = paged_build
    decode = next(b for b in summary["builds"] if b["name"] == "decoder_decode")
    max_blocks, batch = decode["bindings"]["max_blocks"][0], max(decode["bindings"]["batch"])
    blocks = summary["paged_kv"]["builds"]["decoder_decode"][0]
    assert blocks == max_blocks * batch + 1 == gears.pool_blocks(max_blocks, batch)
    # Every sequence can grow to max_blocks blocks (block 0 is never handed out) ...
    alloc = BlockAllocator(blocks, BLOCK)
    for s in range(batch):
        alloc.allocate(s, max_blocks * BLOCK)
    # ... which a pool without the reserved block could not hold.
    short = BlockAllocator(blocks - 1, BLOCK)
    with pytest.raises(OutOfBlocks):
        for s in range(batch):
            short.allocate(s, max_blocks * BLOCK)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_gears_stop_at_the_models_positions(exported, tmp_path, layout):
    # BLIP-2's OPT has a learned position table of exactly max_positions rows.
    pkg = _package(exported, "tiny-blip2", layout, tmp_path)
    limit = pkg.manifest["text"]["max_positions"]
    summary = ascend.compile(pkg, tmp_path / "b", {"soc": SOC, "sequence_buckets": [128, limit, 2 * limit]})
    builds = {b["name"]: b["bindings"] for b in summary["builds"]}
    assert max(builds["decoder_prefill"]["sequence"]) == limit
    if layout == "contiguous":
        assert max(builds["decoder_decode"]["past_sequence"]) == limit - 1
        assert max(builds["decoder_decode"]["total_sequence"]) == limit
    else:
        # The pool's blocks cover the model's positions, no more: ceil(limit / block) per sequence.
        assert builds["decoder_decode"]["max_blocks"] == [math.ceil(limit / BLOCK)]
    assert (
        f"past_buckets above max_positions {limit} less the decoded token are capped to {limit - 1}: "
        in " ".join(summary["warnings"])
    )


def test_image_count_gears_build_as_nd(exported, tmp_path):
    pkg = Package.load(exported("tiny-llava"))
    summary = ascend.compile(pkg, tmp_path / "b", {"soc": SOC, "sequence_buckets": [64], "images": [1, 2]})
    vision = next(b for b in summary["builds"] if b["graph"] == "vision_encoder")
    opts = atc.parse_argv(vision["argv"])
    assert opts["dynamic_dims"] == "1;2" and opts["input_format"] == "ND"
    assert not atc.problems(opts)
    assert "--dynamic_dims gears are for ND inputs: give --input_format=ND" in atc.problems(
        {**opts, "input_format": "NCHW"}
    )


def test_int4_notes_name_the_file_constant_parser_and_the_release_state():
    for note in (_weight_only_matmul.INT4_NOTE, _weight_only_matmul.INT4_PACKED_NOTE):
        assert "14b93e226" in note and "no CANN release tag" in note and "v9.1.0" in note
    assert "onnx_file_constant_parser.cc" in _weight_only_matmul.INT4_PACKED_NOTE
    assert "onnx_constant_parser.cc" not in _weight_only_matmul.INT4_PACKED_NOTE.replace("file_constant", "")


def test_prefill_graph_keeps_a_concat_of_the_past_alone():
    # The exporters leave `Concat(past_key_values.0.key)` (one input) in front of the attention; the
    # prefill form used to drop its only input, leaving a Concat with none (invalid ONNX, which the
    # reference executor refused). It now keeps the past, fed empty.
    from vlmc.backends.ascend import lower

    past = helper.make_tensor_value_info(
        "past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, "past_sequence", 4]
    )
    x = helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["batch", 2, "sequence", 4])
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key"], ["alone"], axis=-2),
        helper.make_node("Concat", ["alone", "inputs_embeds"], ["present.0.key"], axis=-2),
    ]
    out = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["batch", 2, "total_sequence", 4])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x, past], [out]), opset_imports=[helper.make_opsetid("", 17)]
    )
    prefill, empties = lower.strip_past(ir.from_proto(model), "decoder")
    prefill = ir.to_proto(prefill)
    assert [i.name for i in prefill.graph.input] == ["inputs_embeds"] and empties == 1
    assert all(len(n.input) for n in prefill.graph.node if n.op_type == "Concat")
    onnx.checker.check_model(prefill, full_check=True)
    feed = np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)
    (got,) = ort.InferenceSession(prefill.SerializeToString()).run(None, {"inputs_embeds": feed})
    np.testing.assert_array_equal(got, feed)


# ---- the reference executor: standard ops on onnxruntime, Ascend ops in numpy -------------------------
def _quantized_gather(width: int) -> onnx.ModelProto:
    """x -> AscendQuant -> int8 MatMul -> AscendDequant -> GatherElements over ``width`` columns -> Relu."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (8, width)).astype(np.int8)
    idx = np.stack([rng.permutation(width) for _ in range(3)]).astype(np.int64)

    inits = [
        onnx.numpy_helper.from_array(w, "w"),
        onnx.numpy_helper.from_array(reference.pack_deq_scale(np.array([0.01], np.float32)), "deq"),
        onnx.numpy_helper.from_array(idx, "idx"),
    ]
    nodes = [
        helper.make_node("AscendQuant", ["x"], ["xq"], scale=20.0, offset=0.0, dst_type="INT8"),
        helper.make_node("MatMul", ["xq", "w"], ["acc"]),
        helper.make_node("AscendDequant", ["acc", "deq"], ["y"], dtype=0),
        helper.make_node("GatherElements", ["y", "idx"], ["g"], axis=1),
        helper.make_node("Relu", ["g"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, width])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_reference_executor_runs_standard_ops_beyond_the_onnx_evaluators_limits():
    """GatherElements over 100 columns (onnx's reference evaluator uses np.choose: at most 64) runs on
    onnxruntime; the int8 MatMul accumulates exactly in int32; the Ascend ops keep their fp16 numerics."""

    model = _quantized_gather(100)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    session = reference.Session(model)
    kinds = [kind for kind, _ in session._stages]
    assert kinds == ["ascend", "ort", "ascend", "ort"]  # quant | matmul | dequant | gather + relu
    got = session.run({"x": x})["out"]
    xq = reference.ascend_quant(x, 20.0, 0.0)
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    y = reference.ascend_dequant(
        xq.astype(np.int32) @ w.astype(np.int32), reference.pack_deq_scale(np.float32(0.01))
    )
    idx = onnx.numpy_helper.to_array(model.graph.initializer[2])
    np.testing.assert_array_equal(got, np.maximum(np.take_along_axis(y, idx, axis=1), 0))
    assert got.dtype == np.float32


def test_reference_executor_names_an_op_it_has_no_kernel_for():

    model = _quantized_gather(4)
    model.graph.node[4].op_type = "NPUMish"
    with pytest.raises(VlmcError, match="no kernel for NPUMish"):
        reference.Session(model)


def test_cls_attention_pruning_and_merge_run_on_the_reference_build(exported, tmp_path):
    """The issue's case: LLaVA pruned by CLS attention (GatherElements over the 64 patch columns), merged,
    used to end in onnx's reference evaluator with 'Need at least 0 and at most 64 array objects'."""
    pkg = Package.load(exported("tiny-llava"))
    pass_api.get("prune_visual_tokens")(keep=16, calibration_images=0, picture=False).run(pkg)
    pass_api.get("merge")().run(pkg)
    pkg.save(tmp_path / "pruned")
    pkg = Package.load(tmp_path / "pruned")
    ref = Pipeline(pkg).generate(PROMPTS, IMAGES, NEW_TOKENS)
    ascend.compile(pkg, tmp_path / "build", _target(pkg))
    run_pkg, executor = runner.open_build(tmp_path / "build", "reference")
    got = Pipeline(run_pkg, executor=executor).generate(PROMPTS, IMAGES, NEW_TOKENS)
    assert got.tokens == ref.tokens
    assert runner.agreement(ref, got)["max_logit_diff"] < 1e-4
