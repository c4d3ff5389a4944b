"""merge and split passes on every built-in family: numerics, interfaces, weight sharing, composition."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

from vlmc import exporters, graphs, interop, manager, recipe, report, samples
from vlmc.errors import PassFailed, VlmcError
from vlmc.exporters import zoo
from vlmc.package import Package
from vlmc.pass_api import get
from vlmc.runtime import Pipeline, kv

exporters.families()  # family modules register their built-ins on import
BUILTINS = sorted(zoo.BUILTINS)
PROMPTS = ["Describe the image.", "What is in it?"]
IMAGES = [["demo:0"], ["demo:1"]]
TOKENS = 6
# ops the ATC ONNX parser registers; Constant is converted by the parser itself (see the file's header)
ATC_OPS = {
    line.split("\t")[0]
    for line in (Path(__file__).resolve().parents[2] / "vlmc/backends/ascend/data/onnx_ops.tsv")
    .read_text()
    .splitlines()
    if line and not line.startswith("#")
} | {"Constant"}


def _run(pkg_dir: Path, passes: list[dict]) -> Package:
    return manager.run(Package.load(pkg_dir), recipe.from_dict({"passes": passes}).steps)


def _saved(pkg: Package, tmp_path: Path, name: str) -> Package:
    return Package.load(pkg.save(tmp_path / name))


def _generate(pkg: Package, prompts=PROMPTS, images=IMAGES):
    pipe = Pipeline(pkg)
    return pipe.generate_from(pipe.prepare(prompts, images), TOKENS)


def _assert_same_generation(a, b, tol: float = 1e-5) -> None:
    assert a.tokens == b.tokens
    assert len(a.step_logits) == len(b.step_logits)
    assert float(np.max(np.abs(a.prefill_logits - b.prefill_logits))) <= tol
    for x, y in zip(a.step_logits, b.step_logits):
        assert float(np.max(np.abs(x - y))) <= tol


def _run_graph(pkg: Package, name: str, feeds: dict) -> dict:
    return Pipeline(pkg).run_graph(name, feeds)


@pytest.fixture(scope="module")
def source(exported, tmp_path_factory):
    """A private copy of the session's exported built-in: saving derived packages hard-links their
    unchanged data files, and onnx's loader refuses files with several links, which would break other
    test modules that read the session package with onnx directly."""
    import shutil

    cache: dict[str, Path] = {}

    def get_(name: str) -> Path:
        if name not in cache:
            cache[name] = Path(shutil.copytree(exported(name), tmp_path_factory.mktemp("source") / name))
        return cache[name]

    return get_


@pytest.fixture(scope="module")
def merged(source, tmp_path_factory):
    """merge(p) for a built-in, saved and reloaded: name -> package directory."""
    cache: dict[str, Path] = {}

    def get_(name: str) -> Path:
        if name not in cache:
            out = tmp_path_factory.mktemp("merged") / name
            _run(source(name), [{"merge": {}}]).save(out)
            cache[name] = out
        return cache[name]

    return get_


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """The built-in's architecture with a 4-layer text model (so 3 ranges are possible), exported once."""
    import torch

    cache: dict[str, Path] = {}

    def get_(name: str) -> Path:
        if name not in cache:
            model = zoo.build(name)
            cfg = copy.deepcopy(model.config)
            text = getattr(cfg, "text_config", cfg)  # qwen_vl's config is flat, as the hub's is
            text.num_hidden_layers = 4
            if getattr(text, "layer_types", None):
                text.layer_types = text.layer_types[:1] * 4
            torch.manual_seed(0)
            d = type(model)(cfg).eval()
            exporters._eager(d)
            src = exporters.Source(
                name=name, model=d, config=d.config, family=zoo.BUILTINS[name][0], builtin=True
            )
            out = tmp_path_factory.mktemp("deep") / name
            exporters.export(src).save(out)
            cache[name] = out
        return cache[name]

    return get_


# ---- merge ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_merged_greedy_equals_split(name, source, merged):
    split_pkg, merged_pkg = Package.load(source(name)), Package.load(merged(name))
    assert merged_pkg.manifest["pipeline"]["vlm"] == "vlm"
    assert merged_pkg.graphs_with_role("vlm") == ["vlm"]
    assert not merged_pkg.graphs_with_role("vision") and not merged_pkg.graphs_with_role("fusion")
    vlm = merged_pkg.model("vlm")
    interop.check(vlm, "vlm")
    ins = [i.name for i in vlm.graph.inputs]
    vision_inputs = [i["name"] for i in split_pkg.info(split_pkg.manifest["pipeline"]["image"][0])["inputs"]]
    assert ins[: len(vision_inputs) + 1] == [*vision_inputs, "input_ids"]
    # deepstack inputs (text.deepstack) are computed inside the merged graph
    ds = split_pkg.manifest["text"].get("deepstack") or {}
    inside = {ds.get("mask_input"), ds.get("embeds_input")}
    expected = [i["name"] for i in split_pkg.info("decoder")["inputs"]][1:]
    assert ins[len(vision_inputs) + 1 :] == [n for n in expected if n not in inside]
    assert [o.name for o in vlm.graph.outputs] == [o["name"] for o in split_pkg.info("decoder")["outputs"]]
    hist = graphs.op_histogram(vlm)
    for op in ("Equal", "CumSum", "Max", "Gather", "Where"):
        assert hist.get(op, 0) >= 1, op
    assert set(hist) <= ATC_OPS, sorted(set(hist) - ATC_OPS)
    # prefill (merged graph with images) and decode steps (text-only graphs) against the stage package
    _assert_same_generation(_generate(split_pkg), _generate(merged_pkg))


@pytest.mark.parametrize("name", BUILTINS[:1])
def test_merged_text_only_prompt_uses_decode_path(name, source, merged):
    _assert_same_generation(
        _generate(Package.load(source(name)), ["Hello"], [[]]),
        _generate(Package.load(merged(name)), ["Hello"], [[]]),
    )


def _external_regions(pkg_dir: Path) -> dict[tuple[str, int], bytes]:
    regions = {}
    for entry in Package.load(pkg_dir).manifest["graphs"].values():
        model = onnx.load(str(pkg_dir / entry["file"]), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                with open(pkg_dir / info["location"], "rb") as f:
                    f.seek(int(info["offset"]))
                    regions[(info["location"], int(info["offset"]))] = f.read(int(info["length"]))
    return regions


@pytest.mark.parametrize("name", BUILTINS)
def test_merged_package_stores_each_weight_once(name, source, merged):
    out = merged(name)
    regions = _external_regions(out)
    digests = [hashlib.sha256(b).hexdigest() for b in regions.values()]
    assert len(digests) == len(set(digests)), "two stored regions hold the same weight bytes"
    assert {loc for loc, _ in regions} == {"weights.onnx.data"}
    data = (out / "weights.onnx.data").stat().st_size
    assert data - sum(len(b) for b in regions.values()) < 64 * len(regions)  # only alignment padding
    vlm = Package.load(out).model("vlm")
    inits = [
        hashlib.sha256(v.const_value.tobytes()).hexdigest()
        + str(v.const_value.shape)
        + str(v.const_value.dtype)
        for v in vlm.graph.initializers.values()
    ]
    assert len(inits) == len(set(inits))
    after, before = report.summary(Package.load(out)), report.summary(Package.load(source(name)))
    # the decode graphs repeat the decoder: summed per graph it is there twice, stored once
    assert after["total_weight_bytes"] > after["unique_weight_bytes"]
    assert after["unique_weight_bytes"] <= before["unique_weight_bytes"] + 1024  # + the scatter's constants


# ---- split ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_split_of_merge_restores_the_package(name, source, merged, tmp_path):
    original = Package.load(source(name))
    restored = _saved(_run(merged(name), [{"split": {}}]), tmp_path, "restored")
    assert restored.manifest["pipeline"] == original.manifest["pipeline"]
    assert sorted(restored.graph_names) == sorted(original.graph_names)
    for g in original.graph_names:
        a, b = original.info(g), restored.info(g)
        assert {k: a[k] for k in ("inputs", "outputs", "role", "precision", "file")} == {
            k: b[k] for k in ("inputs", "outputs", "role", "precision", "file")
        }
        assert "weights_file" not in b
        interop.check(restored.model(g), g)
        feeds = samples.inputs_for(original, g)
        want, got = _run_graph(original, g, feeds), _run_graph(restored, g, feeds)
        assert want.keys() == got.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("ranges", [2, 3])
@pytest.mark.parametrize("name", BUILTINS)
def test_decoder_ranges_token_exact(name, ranges, deep, tmp_path):
    whole = Package.load(deep(name))
    split = _saved(_run(deep(name), [{"split": {"decoder_ranges": ranges}}]), tmp_path, "split")
    chain = split.manifest["pipeline"]["decoder"]
    assert chain == [f"decoder.{k}" for k in range(ranges)]
    assert "decoder" not in split.manifest["graphs"]
    spans = [split.info(g)["kv_layers"] for g in chain]
    assert spans[0][0] == 0 and spans[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for k, (g, (a, z)) in enumerate(zip(chain, spans)):
        ins = [i["name"] for i in split.info(g)["inputs"]]
        outs = [o["name"] for o in split.info(g)["outputs"]]
        assert ins[0] == ("inputs_embeds" if k == 0 else f"hidden_states.{a}")
        assert outs[0] == ("logits" if k == ranges - 1 else f"hidden_states.{z}")
        layers = {int(n.split(".")[1]) for n in ins + outs if n.startswith(("past_key_values.", "present."))}
        assert layers == set(range(a, z))
        interop.check(split.model(g), g)
    _assert_same_generation(_generate(whole), _generate(split))


@pytest.mark.parametrize("name", BUILTINS[:1])
def test_merge_of_decoder_ranges_and_back(name, deep, tmp_path):
    whole = Package.load(deep(name))
    both = _saved(_run(deep(name), [{"split": {"boundaries": [1, 3]}}, {"merge": {}}]), tmp_path, "both")
    assert both.manifest["pipeline"]["decoder"] == ["decoder.0", "decoder.1", "decoder.2"]
    _assert_same_generation(_generate(whole), _generate(both))
    back = _run(both.root, [{"split": {}}])
    assert back.manifest["pipeline"]["decoder"] == ["decoder.0", "decoder.1", "decoder.2"]
    assert back.manifest["pipeline"]["image"] == whole.manifest["pipeline"]["image"]


# ---- refusals and no-ops -------------------------------------------------------------------------


def test_split_without_work_is_a_noop(source):
    pkg = Package.load(source(BUILTINS[0]))
    before = copy.deepcopy(pkg.manifest)
    result = get("split")().run(pkg)
    assert result.modified is False
    assert pkg.manifest == before


def test_refusals(source, merged):
    m = Package.load(merged(BUILTINS[0]))
    with pytest.raises(VlmcError, match="already merged"):
        get("merge")().check_package(m)
    p = Package.load(source(BUILTINS[0]))
    with pytest.raises(VlmcError, match="at most 2 ranges"):
        get("split")(decoder_ranges=3).check_package(p)
    with pytest.raises(VlmcError, match="boundaries"):
        get("split")(boundaries=[2, 1])
    with pytest.raises(VlmcError, match="decoder_ranges"):
        get("split")(boundaries=[1], decoder_ranges=3)
    get("split")(decoder_ranges=2).run(p)
    with pytest.raises(VlmcError, match="already split into 2 ranges"):
        get("split")(decoder_ranges=2).check_package(p)
    text_only = Package.load(source(BUILTINS[0]))
    text_only.manifest["pipeline"]["image"] = []
    with pytest.raises(VlmcError, match="no image chain"):
        get("merge")().check_package(text_only)


# ---- composition with pruning and quantization -------------------------------------------------

QUANTIZE = {"quantize": {"decoder": {"weights": "int8"}, "eval_samples": 0, "eval_tokens": 0}}
PRUNE = {"prune_visual_tokens": {"keep": 16, "method": "uniform", "calibration_images": 0, "picture": False}}


@pytest.mark.parametrize("step", [QUANTIZE, PRUNE], ids=["quantize", "prune"])
def test_lossy_pass_then_merge_and_split(step, source, tmp_path):
    name = "tiny-llava"
    base = _saved(_run(source(name), [step]), tmp_path, "base")
    merged_pkg = _saved(_run(base.root, [{"merge": {}}]), tmp_path, "merged")
    _assert_same_generation(_generate(base), _generate(merged_pkg))
    ranged = _saved(_run(base.root, [{"split": {"decoder_ranges": 2}}]), tmp_path, "ranged")
    _assert_same_generation(_generate(base), _generate(ranged))


@pytest.mark.parametrize("step", [QUANTIZE, PRUNE], ids=["quantize", "prune"])
def test_lossy_pass_after_merge_is_refused(step, merged, source, tmp_path):
    with pytest.raises(PassFailed, match="cannot run on a merged package.*before merge, or run split first"):
        _run(merged("tiny-llava"), [step])
    # split first, then the pass works
    pkg = _run(merged("tiny-llava"), [{"split": {}}, step])
    assert "vlm" not in pkg.manifest["graphs"]


MROPE = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"]


@pytest.mark.parametrize("name", MROPE)
def test_merge_of_a_pruned_mrope_package_places_the_kept_tokens(name, source, tmp_path):
    """The merged graph adds the kept tokens' offsets itself: token-exact against the unmerged pruned package."""
    step = {
        "prune_visual_tokens": {**PRUNE["prune_visual_tokens"], "keep": 5, "method": "attention_received"}
    }
    pruned = _saved(_run(source(name), [step]), tmp_path, "pruned")
    assert pruned.manifest["vision"]["pruning"]["positions"] == "original"
    merged_pkg = _saved(_run(pruned.root, [{"merge": {}}]), tmp_path, "merged")
    vlm = merged_pkg.manifest["pipeline"]["vlm"]
    assert merged_pkg.info(vlm)["positions_output"] == "prefill_position_ids"
    assert "prefill_position_ids" in [o["name"] for o in merged_pkg.info(vlm)["outputs"]]
    _assert_same_generation(_generate(pruned), _generate(merged_pkg), tol=1e-4)
    # The positions the merged graph used are the unmerged package's, kept tokens at their original
    # (t, h, w) and not at their image's start (what the runtime feeds the merged graph).
    unmerged, one = Pipeline(pruned), Pipeline(merged_pkg)
    inp_a, inp_b = unmerged.prepare(PROMPTS, IMAGES), one.prepare(PROMPTS, IMAGES)
    _, _, expected, _ = unmerged.start(inp_a)
    chain, _, given, extra = one.start(inp_b)
    feeds, _ = one.merged_inputs(inp_b, chain, inp_b.attention_mask, given, extra)
    state = kv.make(merged_pkg.manifest["kv"], len(PROMPTS), attention_mask=inp_b.attention_mask)
    one.step(feeds, [chain], state)
    assert not np.array_equal(given, expected)
    np.testing.assert_array_equal(feeds["position_ids"], expected)
    split_pkg = _run(merged_pkg.root, [{"split": {}}])
    assert "vlm" not in split_pkg.manifest["graphs"]
    _assert_same_generation(_generate(pruned), _generate(split_pkg), tol=1e-4)


def test_split_then_quantize_equals_quantize_then_split(source, tmp_path):
    first = _run(source("tiny-llava"), [{"split": {"decoder_ranges": 2}}, QUANTIZE])
    assert {first.info(g)["precision"] for g in first.manifest["pipeline"]["decoder"]} == {"int8_weight_only"}
    second = _run(source("tiny-llava"), [QUANTIZE, {"split": {"decoder_ranges": 2}}])
    _assert_same_generation(_generate(first), _generate(second))
