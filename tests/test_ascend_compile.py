"""`compile` for Ascend: every emitted command obeys docs/atc-facts.md, every lowered graph parses, and the
precheck stops bad graphs (naming the node) before anything is written."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmc import manifest
from vlmc.backends import ascend
from vlmc.backends.ascend import atc, ops, precheck, soc
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package

HIDDEN, HEADS, HEAD_DIM, LAYERS, VOCAB = 8, 2, 4, 2, 32
OPSET = 17


def _model(nodes, inputs, outputs, inits=(), opset=OPSET, extra_opsets=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _vision(qwen: bool) -> onnx.ModelProto:
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((12 if qwen else 16, HIDDEN)).astype(np.float32), "proj"
    )
    if qwen:
        nodes = [
            helper.make_node("MatMul", ["pixel_values", "proj"], ["f"], name="patch_proj"),
            helper.make_node("Unsqueeze", ["f", "ax0"], ["image_features"], name="add_images"),
        ]
        return _model(
            nodes,
            [_vi("pixel_values", ["patches", 12]), _vi("image_grid_thw", ["images", 3], TensorProto.INT64)],
            [_vi("image_features", [1, "patches", HIDDEN])],
            [w, numpy_helper.from_array(np.array([0], np.int64), "ax0")],
        )
    nodes = [
        helper.make_node("Reshape", ["pixel_values", "shape"], ["p"], name="patchify"),
        helper.make_node("MatMul", ["p", "proj"], ["image_features"], name="patch_proj"),
    ]
    return _model(
        nodes,
        [_vi("pixel_values", ["images", 3, 8, 8])],
        [_vi("image_features", ["images", 12, HIDDEN])],
        [w, numpy_helper.from_array(np.array([0, 12, 16], np.int64), "shape")],
    )


def _embed() -> onnx.ModelProto:
    table = numpy_helper.from_array(
        np.random.default_rng(1).standard_normal((VOCAB, HIDDEN)).astype(np.float32), "table"
    )
    return _model(
        [helper.make_node("Gather", ["table", "input_ids"], ["inputs_embeds"], name="lookup")],
        [_vi("input_ids", ["batch", "sequence"], TensorProto.INT64)],
        [_vi("inputs_embeds", ["batch", "sequence", HIDDEN])],
        [table],
    )


def _decoder(
    mrope: bool = False, extra_nodes=(), lm_head_qdq: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "lm_head"),
        numpy_helper.from_array(np.array([0, 0, HEADS, HEAD_DIM], np.int64), "kv_shape"),
        numpy_helper.from_array(np.array([0, 2, 1, 3], np.int64), "perm_unused"),
    ]
    nodes = [
        helper.make_node("MatMul", ["inputs_embeds", "lm_head"], ["logits"], name="lm_head_mm"),
        helper.make_node("Reshape", ["inputs_embeds", "kv_shape"], ["kv_bshd"], name="split_heads"),
        helper.make_node("Transpose", ["kv_bshd"], ["kv"], name="to_bhsd", perm=[0, 2, 1, 3]),
    ]
    outputs = [_vi("logits", ["batch", "sequence", VOCAB])]
    inputs = [
        _vi("inputs_embeds", ["batch", "sequence", HIDDEN]),
        _vi("attention_mask", ["batch", "total_sequence"], TensorProto.INT64),
        _vi("position_ids", [3, "batch", "sequence"] if mrope else ["batch", "sequence"], TensorProto.INT64),
    ]
    for i in range(LAYERS):
        for kind in ("key", "value"):
            inputs.append(_vi(f"past_key_values.{i}.{kind}", ["batch", HEADS, "past_sequence", HEAD_DIM]))
            nodes.append(
                helper.make_node(
                    "Concat",
                    [f"past_key_values.{i}.{kind}", "kv"],
                    [f"present.{i}.{kind}"],
                    name=f"cat_{i}_{kind}",
                    axis=2,
                )
            )
            outputs.append(_vi(f"present.{i}.{kind}", ["batch", HEADS, "total_sequence", HEAD_DIM]))
    return _model(nodes + list(extra_nodes), inputs, outputs, inits)


def _paged_decoder() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inputs = [
        _vi("inputs_embeds", ["batch", "sequence", HIDDEN]),
        _vi("position_ids", ["batch", "sequence"], TensorProto.INT64),
        _vi("block_tables", ["batch", "max_blocks"], TensorProto.INT32),
        _vi("slot_mapping", ["batch", "sequence"], TensorProto.INT32),
        _vi("context_lens", ["batch"], TensorProto.INT32),
    ]
    nodes = [helper.make_node("MatMul", ["inputs_embeds", "lm_head"], ["logits"], name="lm_head_mm")]
    outputs = [_vi("logits", ["batch", "sequence", VOCAB])]
    for i in range(LAYERS):
        for kind in ("key", "value"):
            inputs.append(_vi(f"{kind}_cache.{i}", ["num_blocks", 16, HEADS, HEAD_DIM]))
            nodes.append(
                helper.make_node(
                    "Identity", [f"{kind}_cache.{i}"], [f"{kind}_cache_out.{i}"], name=f"keep_{kind}_{i}"
                )
            )
            outputs.append(_vi(f"{kind}_cache_out.{i}", ["num_blocks", 16, HEADS, HEAD_DIM]))
    return _model(
        nodes,
        inputs,
        outputs,
        [numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "lm_head")],
    )


def _manifest(family: str, paged: bool = False) -> dict:
    m = manifest.new(family, "Test", "test", "0")
    m["vision"] = {"image_size": [8, 8], "tokens_per_image": 12, "image_token_id": 31, "preprocess": {}}
    m["text"] = {"vocab_size": VOCAB, "eos_token_id": 2, "max_positions": 4096}
    m["kv"] = {
        "layers": LAYERS,
        "kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "layout": "paged" if paged else "contiguous",
        "block_size": 16 if paged else None,
    }
    return m


def _package(kind: str, decoder: onnx.ModelProto | None = None, precision: str = "fp32") -> Package:
    pkg = Package(_manifest(kind, paged=kind == "paged"))
    qwen = kind == "qwen2_vl"
    if qwen:
        pkg.manifest["vision"]["preprocess"] = {"patch_size": 2}
    pkg.set_graph("vision_encoder", ir.from_proto(_vision(qwen)), role="vision")
    if kind == "blip2":
        qformer = _model(
            [helper.make_node("ReduceMean", ["image_features"], ["query_features"], name="pool", axes=[1])],
            [_vi("image_features", ["images", 12, HIDDEN])],
            [_vi("query_features", ["images", 1, HIDDEN])],
        )
        pkg.set_graph("qformer", ir.from_proto(qformer), role="fusion")
    pkg.set_graph("embed_tokens", ir.from_proto(_embed()), role="embed")
    if decoder is None:
        decoder = _paged_decoder() if kind == "paged" else _decoder(mrope=qwen)
    if isinstance(decoder, onnx.ModelProto):
        decoder = ir.from_proto(decoder)
    pkg.set_graph("decoder", decoder, role="decoder", precision=precision)
    pkg.manifest["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}
    return pkg


def _qdq_decoder() -> onnx.ModelProto:
    """The decoder with lm_head quantized the way onnxruntime's QDQ quantize_static writes it."""
    model = _decoder()
    rng = np.random.default_rng(4)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "lm_head"))
    s_w = np.float32(np.abs(w).max() / 127)
    inits = [
        numpy_helper.from_array(np.clip(np.rint(w / s_w), -127, 127).astype(np.int8), "lm_head_q"),
        numpy_helper.from_array(s_w, "lm_head_scale"),
        numpy_helper.from_array(np.int8(0), "lm_head_zp"),
        numpy_helper.from_array(np.float32(0.02), "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"),
        numpy_helper.from_array(rng.standard_normal(VOCAB).astype(np.float32), "lm_bias"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "kept_w"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["inputs_embeds", "x_scale", "x_zp"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xdq"], name="x_dq"),
        helper.make_node(
            "DequantizeLinear", ["lm_head_q", "lm_head_scale", "lm_head_zp"], ["w"], name="w_dq"
        ),
        helper.make_node("MatMul", ["xdq", "w"], ["acc"], name="lm_head_mm"),
        helper.make_node("Add", ["acc", "lm_bias"], ["logits_pre"], name="lm_bias_add"),
        helper.make_node("MatMul", ["inputs_embeds", "kept_w"], ["side"], name="sensitive_mm"),
        helper.make_node("ReduceSum", ["side"], ["side_sum"], name="side_sum", keepdims=1),
        helper.make_node("Add", ["logits_pre", "side_sum"], ["logits"], name="mix"),
    ]
    kept = [n for n in model.graph.node if n.name != "lm_head_mm"]
    del model.graph.node[:]
    model.graph.node.extend(nodes + kept)
    model.graph.initializer.extend(inits)
    return model


FAMILIES = ["llava", "qwen2_vl", "blip2", "paged"]


def _compile(pkg: Package, out: Path, **target) -> dict:
    return ascend.compile(pkg, out, {"soc": "Ascend910B", "soc_variant": "Ascend910B2", **target})


def _assert_obeys_rules(out: Path, summary: dict) -> None:
    """The rules of docs/atc-facts.md, checked on what was written, independently of how it was built."""
    assert summary["soc_version"] in soc.VARIANTS_910B
    for b in summary["builds"]:
        argv = (out / b["workdir"] / "atc.cmd").read_text().split("\n")[0]
        import shlex

        opts = atc.parse_argv(shlex.split(argv))
        assert atc.problems(opts, quantized=b["quantized"], sequence=opts.get("input_format") == "ND") == []
        assert "input_shape_range" not in opts and all(f in atc.FLAGS for f in opts)
        model_path = (out / b["workdir"] / opts["model"]).resolve()
        model = onnx.load(str(model_path), load_external_data=False)
        assert precheck.check_ops(ir.load(str(model_path)), b["name"], lowered=True) == []
        assert all(ops.supported(n.op_type, n.domain, {"": OPSET}) for n in model.graph.node)
        declared = dict(atc.parse_input_shape(opts["input_shape"]))
        inits = {t.name for t in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
        assert list(declared) == graph_inputs  # every input gets an entry, or ATC goes fully dynamic
        n_dyn = sum(d == "-1" for dims in declared.values() for d in dims)
        if n_dyn:
            profiles = opts["dynamic_dims"].split(";")
            assert 2 <= len(profiles) <= 100 and all(len(p.split(",")) == n_dyn for p in profiles)
        else:
            assert not any(g in opts for g in atc.GEAR_FLAGS)
        if b["variant"] != "full" or "sequence" in json.dumps(b["bindings"]):
            assert opts["input_format"] == "ND"
        _assert_npu_quant_forms(onnx.load(str(model_path)))


def _assert_npu_quant_forms(model: onnx.ModelProto) -> dict:
    """The quantized forms the NPU builds (issue 14), checked on the written graph; returns counts.

    AscendQuant offset 0; one deq_scale value per AscendDequant behind MatMul/Gemm; WQBMMv2 group size
    0 or a multiple of 32 at most k-1 with float16 antiquant parameters (ops-nn op proto).
    """
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    prod = {o: n for n in model.graph.node for o in n.output}
    counts = {"AscendQuant": 0, "AscendDequant": 0, "NPUWeightQuantBatchMatmulV2": 0}
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "AscendQuant":
            assert attrs["offset"] == 0.0, f"{n.name}: AscendQuant offset {attrs['offset']}"
        elif n.op_type == "AscendDequant":
            src = prod[n.input[0]]
            if src.op_type == "Add":  # the int32 bias Add between MatMul and dequant
                src = next(prod[i] for i in src.input if i in prod)
            if src.op_type in ("MatMul", "Gemm"):
                assert inits[n.input[1]].size == 1, f"{n.name}: per-channel deq_scale behind {src.op_type}"
        elif n.op_type == "NPUWeightQuantBatchMatmulV2":
            k = inits[n.input[1]].shape[0]
            g = attrs["antiquant_group_size"]
            assert g == 0 or (g % 32 == 0 and g <= k - 1), f"{n.name}: group {g} for k={k}"
            assert all(inits[i].dtype == np.float16 for i in n.input[2:4] if i)
        if n.op_type in counts:
            counts[n.op_type] += 1
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_compiles_to_commands_atc_accepts(tmp_path, family):
    out = tmp_path / "build"
    summary = _compile(_package(family), out, sequence_buckets=[128, 256, 512])
    _assert_obeys_rules(out, summary)
    assert json.loads((out / "compile.json").read_text()) == summary
    assert (out / "vlmc-build.json").is_file()
    names = [b["name"] for b in summary["builds"]]
    assert "decoder_prefill" in names and "decoder_decode" in names


def test_contiguous_decoder_prefill_and_decode_builds(tmp_path):
    summary = _compile(
        _package("llava"), tmp_path / "b", sequence_buckets=[128, 256], past_buckets=[256, 512, 1024]
    )
    by = {b["name"]: b for b in summary["builds"]}
    prefill, decode = by["decoder_prefill"], by["decoder_decode"]
    assert "past_key_values" not in prefill["input_shape"]
    assert prefill["input_shape"].startswith("inputs_embeds:1,-1,8;attention_mask:1,-1;position_ids:1,-1")
    assert prefill["dynamic_dims"] == "128,128,128;256,256,256"
    assert (
        "inputs_embeds:1,1,8" in decode["input_shape"]
        and "past_key_values.key:2,1,2,-1,4" in decode["input_shape"]  # stacked: [layers, ...] (stack_kv.py)
    )
    # attention_mask covers past + the new token: 257 for a 256 past; then the stacked past key and value.
    assert decode["dynamic_dims"].split(";")[0] == "257,256,256"
    assert by["embed_tokens"]["dynamic_dims"] == "1;128;256"
    assert (
        by["vision_encoder"]["dynamic_dims"] is None
        and "pixel_values:1,3,8,8" in by["vision_encoder"]["input_shape"]
    )


def test_prefill_graph_shares_weights_and_runs(tmp_path):
    out = tmp_path / "b"
    _compile(_package("llava"), out)
    assert not (out / "graphs" / "decoder_prefill.onnx.data").exists()
    sess = ort.InferenceSession(
        str(out / "graphs" / "decoder_prefill.onnx"), providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(0).standard_normal((1, 5, HIDDEN)).astype(np.float32)
    outs = sess.run(
        None,
        {"inputs_embeds": x, "attention_mask": np.ones((1, 5), np.int64), "position_ids": np.arange(5)[None]},
    )
    assert outs[0].shape == (1, 5, VOCAB) and outs[1].shape == (1, HEADS, 5, HEAD_DIM)


def test_paged_decoder_has_static_pool_and_batch_gears(tmp_path):
    summary = _compile(_package("paged"), tmp_path / "b", sequence_buckets=[128, 256], batch_sizes=[1, 2, 4])
    decode = next(b for b in summary["builds"] if b["name"] == "decoder_decode")
    # max context 257 with 16-token blocks -> 17 blocks per sequence, 4 sequences and the reserved
    # block 0 -> a pool of 69 blocks.
    assert "key_cache:2,69,16,2,4" in decode["input_shape"] and "block_tables:-1,17" in decode["input_shape"]
    assert decode["profiles"] == 3 and decode["bindings"]["sequence"] == [1]


def test_gear_plan_over_100_profiles_is_an_error(tmp_path):
    with pytest.raises(VlmcError, match="at most 100.*paged_kv"):
        _compile(
            _package("llava"),
            tmp_path / "b",
            batch_sizes=list(range(1, 12)),
            past_buckets=[64 * i for i in range(1, 11)],
        )
    assert not (tmp_path / "b").exists()


def test_ort_only_op_fails_precheck_naming_node_and_writes_nothing(tmp_path):
    gqa = helper.make_node(
        "GroupQueryAttention", ["inputs_embeds"], ["unused"], name="gqa_0", domain="com.microsoft"
    )
    decoder = _decoder(extra_nodes=[gqa])
    decoder.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(CheckFailed, match=r"node 'gqa_0'.*com\.microsoft::GroupQueryAttention.*onnxruntime"):
        _compile(_package("llava", decoder), tmp_path / "b")
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []


def test_opset_19_fails_precheck_with_export_suggestion(tmp_path):
    decoder = _decoder()
    decoder.opset_import[0].version = 19
    with pytest.raises(CheckFailed, match=r"opset 19.*export at opset 17.*'lm_head_mm'"):
        _compile(_package("llava", decoder), tmp_path / "b")


@pytest.mark.parametrize("opset,ok", [(16, False), (17, True), (18, True)])
def test_layer_normalization_only_at_17_and_18(opset, ok):
    model = _model(
        [helper.make_node("LayerNormalization", ["x", "g"], ["y"], name="ln")],
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "g")],
        opset=opset,
    )
    found = precheck.check_ops(ir.from_proto(model), "g", lowered=True)
    assert (found == []) is ok
    if not ok:
        assert "'ln'" in str(found[0]) and "opset 17" in found[0].message


def test_portable_qdq_is_left_to_lowering_but_not_allowed_after():
    q = _model(
        [helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="q")],
        [_vi("x", [2])],
        [_vi("y", [2], TensorProto.UINT8)],
        [numpy_helper.from_array(np.float32(0.1), "s")],
    )
    assert precheck.check_ops(ir.from_proto(q), "g", lowered=False) == []
    assert "run the quantize lowering" in str(precheck.check_ops(ir.from_proto(q), "g", lowered=True)[0])


def test_int8_package_lowers_and_obeys_quantized_rules(tmp_path):
    out = tmp_path / "b"
    summary = _compile(_package("llava", _qdq_decoder(), precision="int8"), out)
    _assert_obeys_rules(out, summary)
    lowering = summary["graphs"]["decoder"]["lowering"]
    assert lowering["quantized_layers"] == ["lm_head_mm"] and lowering["kept_fp32"] == ["sensitive_mm"]
    decode = next(b for b in summary["builds"] if b["name"] == "decoder_decode")
    assert (
        decode["quantized"]
        and decode["precision_mode_v2"] == "fp16"
        and decode["config_files"] == ["keep_dtype.cfg"]
    )
    assert (out / "builds" / "decoder_decode" / "keep_dtype.cfg").read_text() == "sensitive_mm\n"
    ops_ = [n.op_type for n in onnx.load(str(out / "graphs" / "decoder.onnx")).graph.node]
    assert {"AscendQuant", "AscendDequant"} <= set(ops_) and "QuantizeLinear" not in ops_
    with pytest.raises(VlmcError, match="origin"):
        _compile(_package("llava", _qdq_decoder(), precision="int8"), tmp_path / "c", precision="origin")


def test_mixed_precision_gets_mixlist(tmp_path):
    out = tmp_path / "b"
    summary = _compile(
        _package("llava", precision="mixed"), out, precision="mixed_float16", keep_fp32_ops=["SoftmaxV2"]
    )
    decode = next(b for b in summary["builds"] if b["name"] == "decoder_decode")
    assert decode["precision_mode_v2"] == "mixed_float16" and "modify_mixlist.json" in decode["config_files"]
    mix = json.loads((out / "builds" / "decoder_decode" / "modify_mixlist.json").read_text())
    assert mix == {"black-list": {"to-add": ["SoftmaxV2"]}}
    auto = _compile(_package("llava", precision="mixed"), tmp_path / "c")
    assert {b["precision_mode_v2"] for b in auto["builds"] if b["graph"] == "decoder"} == {"mixed_float16"}


def test_build_script_and_makefile(tmp_path):
    out = tmp_path / "b"
    summary = _compile(_package("llava"), out)
    script = (out / "build.sh").read_text()
    assert "set -euo pipefail" in script and "logs/$name.log" in script
    assert os.stat(out / "build.sh").st_mode & stat.S_IXUSR
    for b in summary["builds"]:
        assert f"build {b['name']} " in script
    mk = (out / "atc.mk").read_text()
    assert "vlmc-om:" in mk and all(f"om/{b['name']}.om:" in mk for b in summary["builds"])


def test_run_without_atc_writes_everything_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    summary = _compile(_package("llava"), tmp_path / "b", run=True)
    assert summary["run"]["status"] == "skipped" and "atc is not on PATH" in summary["run"]["message"]
    assert (tmp_path / "b" / "build.sh").is_file()


def _fake_atc(bindir: Path, body: str) -> None:
    bindir.mkdir()
    exe = bindir / "atc"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)


def test_run_with_atc_collects_om_including_dynamic_suffix(tmp_path, monkeypatch):
    # The fake ATC writes the dynamic-shape name, <output>_linux_x86_64.om.
    _fake_atc(
        tmp_path / "bin",
        'for a in "$@"; do case "$a" in --output=*) o="${a#--output=}";; esac; done\n'
        'mkdir -p "$(dirname "$o")"; : > "${o}_linux_x86_64.om"; echo "ATC run success, welcome to the next use."\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    summary = _compile(_package("llava"), tmp_path / "b", run=True)
    assert summary["run"]["status"] == "ok"
    for name, r in summary["run"]["builds"].items():
        assert r["om"] == [str(tmp_path / "b" / "om" / f"{name}_linux_x86_64.om")]
        assert (tmp_path / "b" / "logs" / f"{name}.log").is_file()


def test_run_with_failing_atc_explains_error_code(tmp_path, monkeypatch):
    _fake_atc(
        tmp_path / "bin",
        'echo "ATC run failed, Please check the detail log"\n'
        'echo "E16002: No parser is registered for Op [x]"\nexit 1\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    with pytest.raises(CheckFailed, match="E16002: the ONNX parser has no plugin"):
        _compile(_package("llava"), tmp_path / "b", run=True)
    assert json.loads((tmp_path / "b" / "compile.json").read_text())["run"]["status"] == "failed"


@pytest.mark.parametrize(
    "target,match",
    [
        ({"soc": "Ascend910B9"}, "Ascend910B1"),
        ({"soc_variant": "B7"}, "not a Ascend910B variant"),
        ({"keep_fp32_ops": ["SoftmaxV2"]}, "mixed"),
        ({"sequence_buckets": []}, "at least one"),
        ({"enable_fusion": True}, "unknown option"),
        ({"precision": "fp32"}, "not one of"),
    ],
)
def test_bad_targets_are_rejected(target, match):
    with pytest.raises(VlmcError, match=match):
        ascend.options({"backend": "ascend", **target})


def test_registry_validates_targets():
    from vlmc import backends

    t = backends.validate_target({"backend": "ascend", "soc": "Ascend910B4"})
    assert t["sequence_buckets"] == [128, 256, 512, 1024, 2048] and t["precision"] == "auto"


def test_missing_external_data_fails_precheck(tmp_path):
    pkg = _package("llava")
    pkg.save(tmp_path / "pkg")
    loaded = Package.load(tmp_path / "pkg")
    (tmp_path / "pkg" / "embed_tokens.onnx.data").unlink()  # lost after the package was opened
    with pytest.raises(CheckFailed, match="embed_tokens.onnx.data.*missing"):
        _compile(loaded, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_existing_output_needs_force(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("x")
    with pytest.raises(VlmcError, match="already exists"):
        _compile(_package("llava"), tmp_path / "b")
    _compile(_package("llava"), tmp_path / "c")
    ascend.compile(_package("llava"), tmp_path / "c", {"soc": "Ascend910B1"}, force=True)
    assert json.loads((tmp_path / "c" / "compile.json").read_text())["soc_version"] == "Ascend910B1"


def _builtins() -> list[str]:
    from vlmc import exporters
    from vlmc.exporters import zoo

    exporters.families()  # family modules register their built-ins on import
    return sorted(zoo.BUILTINS)


_BUILTINS = _builtins()


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8-vision-int4-decoder"])
@pytest.mark.parametrize("name", _BUILTINS)
def test_every_builtin_compiles(name, quantized, exported, tmp_path):
    """Real exports of every built-in family (and their quantized forms) obey every ATC rule."""
    from vlmc import manager, recipe

    pkg = Package.load(exported(name))
    if quantized:
        vision = pkg.manifest["pipeline"]["image"][0]
        steps = recipe.parse(
            "passes:\n  - quantize:\n"
            f"      {vision}: {{weights: int8, activations: int8, calibration: {{count: 2}}}}\n"
            "      decoder: {weights: int4, group_size: 32}\n"
        ).steps
        pkg = manager.run(pkg, steps)
    out = tmp_path / "b"
    summary = _compile(pkg, out, sequence_buckets=[64, 128, 256])
    _assert_obeys_rules(out, summary)
    if quantized:
        _assert_quantized_summary(out, summary)


def _assert_quantized_summary(out: Path, summary: dict) -> None:
    assert any(b["quantized"] for b in summary["builds"])
    counts = {}
    for f in sorted((out / "graphs").glob("*.onnx")):
        for k, v in _assert_npu_quant_forms(onnx.load(str(f))).items():
            counts[k] = counts.get(k, 0) + v
    assert counts["AscendQuant"] and counts["AscendDequant"] and counts["NPUWeightQuantBatchMatmulV2"]
    # INT4 weights are held one per int8 on the NPU: compile.json and report.md say so
    lowering = [g["lowering"] for g in summary["graphs"].values()]
    assert any(r["int4_storage"] == "int8" for r in lowering)
    assert any("INT4 runs with INT8 storage on Ascend" in w for w in summary["warnings"])


def test_quantized_save_pretrained_llava_compiles_to_npu_forms(tmp_path):
    """A LLaVA from save_pretrained (not a built-in), quantized with the default (ascend) target."""
    import torch
    from transformers import LlavaForConditionalGeneration

    from vlmc import exporters, manager, recipe
    from vlmc.exporters import zoo

    torch.manual_seed(3)
    LlavaForConditionalGeneration(zoo.tiny_llava_config()).save_pretrained(tmp_path / "hf")
    exporters.export(exporters.load_source(str(tmp_path / "hf"))).save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    vision = pkg.manifest["pipeline"]["image"][0]
    steps = recipe.parse(
        "passes:\n  - quantize:\n"
        f"      {vision}: {{weights: int8, activations: int8, calibration: {{count: 2}}}}\n"
        "      decoder: {weights: int4, group_size: 32}\n"
    ).steps
    pkg = manager.run(pkg, steps)
    assert pkg.info(vision)["quantization"]["activations"]["symmetric"] is True
    out = tmp_path / "b"
    summary = _compile(pkg, out, sequence_buckets=[64, 128])
    _assert_obeys_rules(out, summary)
    _assert_quantized_summary(out, summary)
    # opt-in: INT4 as ONNX INT4 (two per byte) for an ATC that parses it
    out4 = tmp_path / "b4"
    packed = _compile(pkg, out4, sequence_buckets=[64, 128], int4_weights="int4")
    _assert_obeys_rules(out4, packed)
    assert packed["graphs"]["decoder"]["lowering"]["int4_storage"] == "int4"
    assert any("ONNX INT4" in w and "Unverified on hardware" in w for w in packed["warnings"])
    decoder = onnx.load(str(out4 / "graphs" / "decoder.onnx"))
    assert (
        any(t.data_type == TensorProto.INT4 for t in decoder.graph.initializer) and decoder.ir_version >= 10
    )
    size = {d: sum(f.stat().st_size for f in (d / "graphs").glob("decoder.onnx*")) for d in (out, out4)}
    assert size[out4] < size[out]  # the int4 weights take half the bytes


RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))

# A shipped recipe that names a hub model runs on the tiny built-in of the same family (no network
# here). What the hub model sizes by its own widths is scaled: a pruning `keep` becomes the same
# fraction of the built-in's tokens (the hub model's tokens per image are its published ones:
# LLaVA-1.5 336 px / 14 px patches = 576; Qwen2-VL at 448 x 448, 14 px patches, 2 x 2 merge = 256).
HUB_STAND_INS = {
    "llava-hf/llava-1.5-7b-hf": ("tiny-llava", 576),
    "Qwen/Qwen2-VL-2B-Instruct": ("tiny-qwen2-vl", 256),
}
# Calibration on the tiny built-in: a couple of samples say as much as 32 would.
TINY_CALIBRATION = 2


def _tiny_tokens(pkg_dir: Path) -> int:
    """Tokens per image of a built-in: fixed, or (dynamic resolution) what its smallest image gives."""
    vision = json.loads((pkg_dir / "vlmc.json").read_text())["vision"]
    if vision.get("tokens_per_image"):
        return vision["tokens_per_image"]
    pre = vision["preprocess"]
    return pre["min_pixels"] // (pre["patch_size"] * pre["merge_size"]) ** 2


def _on_builtin(r, exported):
    """The recipe's model and steps as they run on a built-in (unchanged for a built-in model)."""
    from vlmc.exporters import zoo
    from vlmc.recipe import Step

    if r.model in zoo.BUILTINS:
        return r.model, r.steps
    assert r.model in HUB_STAND_INS, f"recipe model {r.model!r}: add its family's built-in to HUB_STAND_INS"
    builtin, hub_tokens = HUB_STAND_INS[r.model]
    steps = []
    for s in r.steps:
        opts = json.loads(json.dumps(s.options))
        if s.name == "prune_visual_tokens" and opts.get("keep") is not None:
            opts["keep"] = max(1, round(opts["keep"] * _tiny_tokens(exported(builtin)) / hub_tokens))
        for spec in opts.values() if s.name == "quantize" else ():
            if isinstance(spec, dict) and isinstance(spec.get("calibration"), dict):
                spec["calibration"]["count"] = min(spec["calibration"].get("count") or 1, TINY_CALIBRATION)
        steps.append(Step(s.name, opts, s.index))
    return builtin, steps


@pytest.mark.parametrize("recipe_path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_compiles_for_ascend(recipe_path, exported, tmp_path):
    """Each shipped recipe's passes (on its family's built-in), then its ascend target (or the default
    910B target for other backends)."""
    from vlmc import manager, recipe

    r = recipe.load(recipe_path)
    model, steps = _on_builtin(r, exported)
    pkg = manager.run(Package.load(exported(model)), steps)
    assert [h["pass"] for h in pkg.manifest["history"]] == [s.name for s in steps]
    target = r.target if r.target and r.target["backend"] == "ascend" else {"backend": "ascend"}
    out = tmp_path / "b"
    if not target.get("soc"):
        target = {**target, "soc_variant": target.get("soc_variant") or "Ascend910B4"}
    summary = ascend.compile(pkg, out, target)
    _assert_obeys_rules(out, summary)


def test_quantize_pass_output_lowers_and_matches_on_references(tiny_llava, tmp_path):
    """The real quantize pass (int8 static decoder, int8 weight-only vision) -> lowering -> references."""
    from vlmc import interop, manager, recipe, samples
    from vlmc.backends.ascend import lower
    from vlmc.runtime.executors import reference

    steps = recipe.parse(
        "passes:\n  - quantize:\n"
        "      decoder: {weights: int8, activations: int8, calibration: {count: 2}}\n"
        "      vision_encoder: {weights: int8}\n"
    ).steps
    pkg = manager.run(Package.load(tiny_llava), steps)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for name, kind in (("decoder", "quantized_layers"), ("vision_encoder", "weight_only_layers")):
        model = pkg.model(name)
        feeds = samples.inputs_for(pkg, name)
        expected = ort.InferenceSession(
            interop.session_bytes(model), so, providers=["CPUExecutionProvider"]
        ).run(None, feeds)
        low, report = lower.lower(model.clone(), name, pkg.info(name))
        assert getattr(report, kind), f"{name}: nothing was lowered"
        got = reference.run(low, feeds, fp16=False)
        # weight-only antiquant scales are float16 on the NPU (the type of x): 2^-11 relative per weight
        tol = 1e-4 if kind == "quantized_layers" else 2e-3
        for out, e in zip(low.graph.outputs, expected):
            np.testing.assert_allclose(
                got[out.name], e, rtol=tol, atol=tol * max(1.0, float(np.abs(e).max()))
            )
    out = tmp_path / "b"
    _assert_obeys_rules(out, _compile(pkg, out, sequence_buckets=[64, 128]))


def test_buckets_above_max_positions_are_reported_once_per_compile(tmp_path, caplog):
    pkg = _package("llava")
    pkg.manifest["text"]["max_positions"] = 256
    with caplog.at_level("WARNING"):
        summary = _compile(pkg, tmp_path / "b", sequence_buckets=[128, 256, 512, 1024])
    said = [r.getMessage() for r in caplog.records if "are capped" in r.getMessage()]
    assert said == [
        "sequence_buckets above the model's max_positions 256 are capped to 256: [512, 1024]",
        "past_buckets above max_positions 256 less the decoded token are capped to 255: [256, 512, 1024]",
    ]
    assert [w for w in summary["warnings"] if "are capped" in w] == said
    assert len(summary["builds"]) > 1  # several builds, and still one message


# ---- memory: compile streams the weights --------------------------------------------------------

_STREAM_LAYERS, _STREAM_K, _STREAM_GROUP = 8, 2048, 128  # each lowered int8 weight is 4 MiB

_COMPILE_PEAK = """
import sys
from pathlib import Path
from vlmc.backends import ascend
from vlmc.package import Package

def status(key):  # kB -> bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

# Every module compile imports on first use is imported by a compile of a one-layer package first, so
# the figure below is compile's working set, not the import of lazily loaded modules.
ascend.compile(Package.load(sys.argv[3]), Path(sys.argv[2] + "-warm"), {"soc": "Ascend910B4"})
pkg = Package.load(sys.argv[1])
# this process's own peak from here: ru_maxrss would carry the parent's across exec
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
summary = ascend.compile(pkg, Path(sys.argv[2]), {"soc": "Ascend910B4"})
layers = len(summary["graphs"]["decoder"]["lowering"]["weight_only_layers"])
print(status("VmHWM") - before, layers)
"""


def _int4_decoder(layers: int, k: int, group: int) -> tuple[onnx.ModelProto, dict]:
    """The decoder with ``layers`` int4 weight-only [k, k] MatMuls in quantize's packed form (uint8
    [k/2, k], row 2i in the low nibble, stored q+8) between an up and a down projection."""
    model = _decoder()
    g = model.graph
    g.node.remove(next(n for n in g.node if n.name == "lm_head_mm"))
    rng = np.random.default_rng(0)
    g.initializer.extend(
        numpy_helper.from_array(a, n)
        for n, a in (
            ("up", rng.standard_normal((HIDDEN, k)).astype(np.float32) * 0.1),
            ("down", rng.standard_normal((k, VOCAB)).astype(np.float32) * 0.01),
            ("mask", np.uint8(0x0F)),
            ("four", np.uint8(4)),
            ("ax1", np.array([1], np.int64)),
            ("kk", np.array([k, k], np.int64)),
            ("eight", np.float32(8)),
            ("gshape", np.array([k // group, group, k], np.int64)),
        )
    )
    nodes = [helper.make_node("MatMul", ["inputs_embeds", "up"], ["h0"], name="up_mm")]
    facts = {}
    for i in range(layers):
        p = f"w{i}_packed"
        g.initializer.extend(
            [
                numpy_helper.from_array(rng.integers(0, 256, (k // 2, k), dtype=np.uint8), p),
                numpy_helper.from_array(np.full((k // group, 1, k), 0.01, np.float32), f"w{i}_scale"),
            ]
        )
        nodes += [
            helper.make_node("BitwiseAnd", [p, "mask"], [f"lo{i}"], name=f"lo{i}"),
            helper.make_node("BitShift", [p, "four"], [f"hi{i}"], name=f"hi{i}", direction="RIGHT"),
            helper.make_node("Unsqueeze", [f"lo{i}", "ax1"], [f"lo1_{i}"], name=f"lo1_{i}"),
            helper.make_node("Unsqueeze", [f"hi{i}", "ax1"], [f"hi1_{i}"], name=f"hi1_{i}"),
            helper.make_node("Concat", [f"lo1_{i}", f"hi1_{i}"], [f"pair{i}"], name=f"pair{i}", axis=1),
            helper.make_node("Reshape", [f"pair{i}", "kk"], [f"rows{i}"], name=f"rows{i}"),
            helper.make_node("Cast", [f"rows{i}"], [f"f{i}"], name=f"cast{i}", to=TensorProto.FLOAT),
            helper.make_node("Sub", [f"f{i}", "eight"], [f"c{i}"], name=f"center{i}"),
            helper.make_node("Reshape", [f"c{i}", "gshape"], [f"g{i}"], name=f"group{i}"),
            helper.make_node("Mul", [f"g{i}", f"w{i}_scale"], [f"m{i}"], name=f"scale{i}"),
            helper.make_node("Reshape", [f"m{i}", "kk"], [f"w{i}"], name=f"ungroup{i}"),
            helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"h{i + 1}"], name=f"mm{i}"),
        ]
        facts[f"mm{i}"] = {"axis": 1, "weight": p, "scale": f"w{i}_scale", "storage": "packed"}
    nodes.append(helper.make_node("MatMul", [f"h{layers}", "down"], ["logits"], name="lm_head_mm"))
    g.node.extend(nodes)
    model.opset_import[0].version = 18  # BitwiseAnd
    return model, {"weights": {"dtype": "int4", "group_size": group, "nodes": facts}}


def test_compile_holds_about_one_deploy_weight_whatever_the_layer_count(tmp_path):
    """A package of eight int4 layers on disk: compile (precheck, lowering, write) grows the peak RSS by
    about one layer's working set. Holding the graph's weights, as compile did on ModelProto, grew it
    by 2.9x all the deploy weights (188.8 MiB for 16 such layers, against 8.9 MiB now)."""
    import subprocess
    import sys

    decoder, facts = _int4_decoder(_STREAM_LAYERS, _STREAM_K, _STREAM_GROUP)
    pkg = _package("llava", decoder, precision="int4_weight_only")
    pkg.manifest["graphs"]["decoder"]["quantization"] = facts
    pkg.save(tmp_path / "pkg")
    del pkg, decoder
    small, small_facts = _int4_decoder(1, _STREAM_K, _STREAM_GROUP)
    warm = _package("llava", small, precision="int4_weight_only")
    warm.manifest["graphs"]["decoder"]["quantization"] = small_facts
    warm.save(tmp_path / "warm")
    del warm, small
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            _COMPILE_PEAK,
            str(tmp_path / "pkg"),
            str(tmp_path / "b"),
            str(tmp_path / "warm"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    growth, layers = map(int, res.stdout.split())
    weight = _STREAM_K * _STREAM_K  # one lowered int8 weight
    assert layers == _STREAM_LAYERS
    assert growth < 3.5 * weight, f"compile grew the peak RSS by {growth / 2**20:.1f} MiB"
    data = tmp_path / "b" / "graphs" / "decoder.onnx.data"
    assert data.stat().st_size >= _STREAM_LAYERS * weight  # and the weights were all written
