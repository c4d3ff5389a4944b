"""Every bad input from the hardening issue through the real CLI: exit 2, one line, no traceback, nothing written."""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmc import interop
from vlmc.cli import main

RECIPE = "passes:\n  - fold_constants\n  - simplify\n"


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root with a content hash: equal trees mean nothing was written or changed."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@dataclass
class Case:
    """One bad input: ``setup(work, pkg) -> argv`` prepares files under ``work`` and returns the CLI arguments."""

    id: str
    setup: Callable[[Path, Path], list[str]]
    expect: tuple[str, ...]  # fragments the one error line must contain (the problem and the fix)
    exit_code: int = 2


def _copy(pkg: Path, work: Path, name: str = "pkg") -> Path:
    dest = work / name
    shutil.copytree(pkg, dest)
    return dest


def _recipe(work: Path, text: str = RECIPE) -> str:
    p = work / "recipe.yaml"
    p.write_text(text)
    return str(p)


def _edit_manifest(pkg: Path, edit: Callable[[dict], None]) -> None:
    m = json.loads((pkg / "vlmc.json").read_text())
    edit(m)
    (pkg / "vlmc.json").write_text(json.dumps(m, indent=2))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ---- model sources ------------------------------------------------------------------------------
def nonexistent_model(work, pkg):
    return ["export", str(work / "no" / "such-model"), "-o", str(work / "out")]


def hub_id_offline(work, pkg):
    return ["export", "some-org/some-model", "-o", str(work / "out")]


def unsupported_architecture(work, pkg):
    from transformers import BertConfig

    d = work / "bert"
    BertConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    ).save_pretrained(d)
    return ["export", str(d), "-o", str(work / "out")]


def pickle_weights(work, pkg):
    from vlmc.exporters import zoo

    d = work / "pickled"
    zoo.tiny_llava_config().save_pretrained(d)
    # A pickle that would create a file if it were ever unpickled: refusing must happen before loading.
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(work / "PWNED")))
    return ["export", str(d), "-o", str(work / "out")]


class _Tripwire:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def remote_code_without_flag(work, pkg):
    d = work / "custom"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "my_custom_vlm",
                "architectures": ["MyVLM"],
                "auto_map": {"AutoConfig": "configuration_my.MyConfig"},
            }
        )
    )
    (d / "configuration_my.py").write_text(f"open({str(work / 'PWNED')!r}, 'w').close()\n")
    return ["export", str(d), "-o", str(work / "out")]


# ---- packages on disk ---------------------------------------------------------------------------
def truncated_onnx(work, pkg):
    p = _copy(pkg, work)
    _truncate(p / "decoder.onnx", 1000)
    return ["optimize", str(p), "-r", _recipe(work), "-o", str(work / "out")]


def missing_external_data(work, pkg):
    p = _copy(pkg, work)
    (p / "decoder.onnx.data").unlink()
    return ["run", str(p), "--prompt", "hi"]


def truncated_external_data(work, pkg):
    p = _copy(pkg, work)
    _truncate(p / "vision_encoder.onnx.data", 1000)
    return ["inspect", str(p)]


def newer_format_version(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m.update(format_version=m["format_version"] + 1))
    return ["run", str(p), "--prompt", "hi"]


def manifest_not_json(work, pkg):
    p = _copy(pkg, work)
    (p / "vlmc.json").write_text('{"format_version": 1,\n  "graphs": {\n')
    return ["inspect", str(p)]


def pipeline_names_missing_graph(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m["pipeline"].update(embed="no_such_graph"))
    return ["run", str(p), "--prompt", "hi"]


def signature_edited(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m["graphs"]["decoder"]["inputs"][0].update(name="renamed_by_hand"))
    return ["optimize", str(p), "-r", _recipe(work), "-o", str(work / "out")]


def graph_file_swapped(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m["graphs"]["decoder"].update(file="embed_tokens.onnx"))
    return ["run", str(p), "--prompt", "hi"]


def unknown_preprocess_kind(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m["vision"]["preprocess"].update(kind="from_the_future"))
    return ["run", str(p), "--image", "demo", "--prompt", "<image> hi"]


def unknown_position_kind(work, pkg):
    p = _copy(pkg, work)
    _edit_manifest(p, lambda m: m["text"].update(position="from_the_future"))
    return ["run", str(p), "--prompt", "hi"]


def not_a_package(work, pkg):
    d = work / "plain"
    d.mkdir()
    return ["inspect", str(d)]


# ---- recipes ------------------------------------------------------------------------------------
def recipe_bad_yaml(work, pkg):
    return [
        "optimize",
        str(pkg),
        "-r",
        _recipe(work, "passes:\n  - simplify\n   - x: [\n"),
        "-o",
        str(work / "out"),
    ]


def recipe_unknown_pass(work, pkg):
    return ["optimize", str(pkg), "-r", _recipe(work, "passes: [simplfy]\n"), "-o", str(work / "out")]


def recipe_unknown_option(work, pkg):
    return [
        "optimize",
        str(pkg),
        "-r",
        _recipe(work, "passes: [{simplify: {skip_fuse: true}}]\n"),
        "-o",
        str(work / "out"),
    ]


def recipe_wrong_type(work, pkg):
    return [
        "optimize",
        str(pkg),
        "-r",
        _recipe(work, "passes: [{paged_kv: {block_size: sixteen}}]\n"),
        "-o",
        str(work / "out"),
    ]


def tp_size_not_dividing_heads(work, pkg):
    return [
        "-q",  # the pass refuses once work has begun ("running passes ..." is a progress note)
        "optimize",
        str(pkg),
        "-r",
        _recipe(work, "passes: [{tensor_parallel: {size: 8}}]\n"),
        "-o",
        str(work / "out"),
    ]


def recipe_out_of_range(work, pkg):
    return [
        "optimize",
        str(pkg),
        "-r",
        _recipe(work, "passes: [{paged_kv: {block_size: 100}}]\n"),
        "-o",
        str(work / "out"),
    ]


def recipe_python_tag(work, pkg):
    text = f"passes: !!python/object/apply:pathlib.Path.touch [{str(work / 'PWNED')!r}]\n"
    return ["optimize", str(pkg), "-r", _recipe(work, text), "-o", str(work / "out")]


def recipe_missing(work, pkg):
    return ["optimize", str(pkg), "-r", str(work / "nope.yaml"), "-o", str(work / "out")]


def build_without_model(work, pkg):
    return ["build", "-r", _recipe(work), "-o", str(work / "out")]


# ---- outputs ------------------------------------------------------------------------------------
def output_exists(work, pkg):
    (work / "out").mkdir()
    (work / "out" / "mine.txt").write_text("user data")
    return ["optimize", str(pkg), "-r", _recipe(work), "-o", str(work / "out")]


def output_exists_not_vlmc_force(work, pkg):
    (work / "out").mkdir()
    (work / "out" / "mine.txt").write_text("user data")
    return ["optimize", str(pkg), "-r", _recipe(work), "-o", str(work / "out"), "--force"]


def output_is_a_file_force(work, pkg):
    (work / "out").write_text("user data")
    return ["export", "tiny-llava", "-o", str(work / "out"), "--force"]


def output_inside_input(work, pkg):
    p = _copy(pkg, work)
    return ["optimize", str(p), "-r", _recipe(work), "-o", str(p / "optimized")]


def disk_full(work, pkg):
    return ["-q", "optimize", str(pkg), "-r", _recipe(work), "-o", str(work / "out")]


# ---- run inputs ---------------------------------------------------------------------------------
def image_not_an_image(work, pkg):
    (work / "notes.png").write_text("this is text, not a PNG")
    return ["run", str(pkg), "--image", str(work / "notes.png"), "--prompt", "<image> hi"]


def image_is_a_directory(work, pkg):
    (work / "photos").mkdir()
    return ["run", str(pkg), "--image", str(work / "photos"), "--prompt", "<image> hi"]


def image_missing(work, pkg):
    return ["run", str(pkg), "--image", str(work / "cat.png"), "--prompt", "<image> hi"]


def prompt_too_long(work, pkg):
    return ["run", str(pkg), "--prompt", "x" * 600]


def generation_past_context(work, pkg):
    return ["run", str(pkg), "--prompt", "x" * 400, "--max-new-tokens", "200"]


def more_images_than_placeholders(work, pkg):
    return ["run", str(pkg), "--image", "demo", "--image", "demo:1", "--prompt", "<image> one picture"]


def fewer_images_than_placeholders(work, pkg):
    return ["run", str(pkg), "--image", "demo", "--prompt", "<image> and <image>"]


def image_markers_out_of_order(work, pkg):
    from vlmc import exporters

    phi3_v = work / "phi3_v"  # a numbered-marker family: Phi-3-vision's <|image_N|>
    exporters.export(exporters.load_source("tiny-phi3-v")).save(phi3_v)
    prompt = "<|image_2|> then <|image_1|>: what differs?"
    return ["run", str(phi3_v), "--image", "demo", "--image", "demo:1", "--prompt", prompt]


# ---- compile outputs (`vlmc run BUILD_DIR`) ------------------------------------------------------------
def _build(work: Path, pkg: Path) -> Path:
    from vlmc.backends import ascend
    from vlmc.package import Package

    ascend.compile(Package.load(pkg), work / "b", {"soc": "Ascend910B2", "sequence_buckets": [64]})
    return work / "b"


def build_prompt_beyond_gears(work, pkg):
    return ["run", str(_build(work, pkg)), "--executor", "reference", "--prompt", "x" * 300]


def build_from_older_vlmc(work, pkg):
    build = _build(work, pkg)
    summary = json.loads((build / "compile.json").read_text())
    del summary["runner"]
    (build / "compile.json").write_text(json.dumps(summary))
    return ["run", str(build), "--executor", "reference", "--prompt", "Hi"]


def build_acl_missing(work, pkg):
    return ["run", str(_build(work, pkg)), "--executor", "acl", "--prompt", "Hi"]


def executor_on_a_package(work, pkg):
    return ["run", str(pkg), "--executor", "reference", "--prompt", "Hi"]


CASES = [
    Case(
        "nonexistent-model-path", nonexistent_model, ("does not exist", "local Hugging Face model directory")
    ),
    Case("hub-id-offline", hub_id_offline, ("offline", "pass the local directory")),
    Case(
        "unsupported-architecture",
        unsupported_architecture,
        ("unsupported architecture", "model_type 'bert'", "supported families: llava"),
    ),
    Case("pickle-weights", pickle_weights, ("pickle", "--allow-pickle")),
    Case("remote-code-without-flag", remote_code_without_flag, ("--trust-remote-code",)),
    Case("truncated-onnx", truncated_onnx, ("decoder.onnx is not a readable ONNX file", "re-export")),
    Case("missing-external-data", missing_external_data, ("decoder.onnx.data", "missing", "re-export")),
    Case(
        "truncated-external-data",
        truncated_external_data,
        ("vision_encoder.onnx.data is truncated", "re-export"),
    ),
    Case("newer-format-version", newer_format_version, ("newer than this vlmc supports", "upgrade vlmc")),
    Case("manifest-not-json", manifest_not_json, ("not valid JSON", "line 3")),
    Case("pipeline-names-missing-graph", pipeline_names_missing_graph, ("pipeline.embed", "no_such_graph")),
    Case(
        "signature-edited-by-hand",
        signature_edited,
        ("graphs.decoder.inputs do not match decoder.onnx", "re-export"),
    ),
    Case("graph-file-swapped", graph_file_swapped, ("graphs.decoder.inputs do not match embed_tokens.onnx",)),
    Case(
        "unknown-preprocess-kind",
        unknown_preprocess_kind,
        (
            "unknown preprocessing kind 'from_the_future'",
            "known kinds: clip, resize, packed_patches",
            "upgrade vlmc",
        ),
    ),
    Case(
        "unknown-position-kind",
        unknown_position_kind,
        ("unknown position kind 'from_the_future'", "known kinds: 1d, mrope", "upgrade vlmc"),
    ),
    Case("not-a-package", not_a_package, ("is not a vlmc package", "vlmc export")),
    Case(
        "build-prompt-beyond-gears",
        build_prompt_beyond_gears,
        ("no build takes these inputs", "no gear holds sequence=", "sequence_buckets"),
    ),
    Case("build-from-older-vlmc", build_from_older_vlmc, ("older vlmc", "re-run `vlmc compile`")),
    Case(
        "build-acl-missing", build_acl_missing, ("pyACL (acl) does not import here", "--executor reference")
    ),
    Case("executor-on-a-package", executor_on_a_package, ("applies to a compile output",)),
    Case("recipe-bad-yaml", recipe_bad_yaml, ("YAML error at line 3",)),
    Case("recipe-unknown-pass", recipe_unknown_pass, ("unknown pass 'simplfy'", "valid passes:", "simplify")),
    Case(
        "recipe-unknown-option",
        recipe_unknown_option,
        ("unknown option 'skip_fuse'", "valid options:", "skip_fuse_bn"),
    ),
    Case("recipe-wrong-type", recipe_wrong_type, ("block_size", "int")),
    Case("recipe-out-of-range", recipe_out_of_range, ("block_size", "100", "multiple of 16")),
    Case(
        "tp-size-not-dividing-heads",
        tp_size_not_dividing_heads,
        ("size 8 does not divide the 4 attention heads", "use one of 2, 4"),
    ),
    Case("recipe-python-tag", recipe_python_tag, ("YAML error", "python/object")),
    Case("recipe-missing", recipe_missing, ("recipe", "does not exist")),
    Case("build-without-model", build_without_model, ("needs a 'model' key",)),
    Case("output-exists", output_exists, ("already exists", "--force")),
    Case("output-not-vlmc-with-force", output_exists_not_vlmc_force, ("not a vlmc output", "refusing")),
    Case("output-is-a-file-with-force", output_is_a_file_force, ("not a vlmc output",)),
    Case("output-inside-input", output_inside_input, ("inside the input package", "outside")),
    Case("disk-full", disk_full, ("No space left on device", "free some space")),
    Case("image-not-an-image", image_not_an_image, ("not a readable image", "PNG or JPEG")),
    Case("image-is-a-directory", image_is_a_directory, ("is not a file", "image file")),
    Case("image-missing", image_missing, ("does not exist",)),
    Case(
        "prompt-longer-than-context", prompt_too_long, ("longer than the model's context of 512", "shorten")
    ),
    Case(
        "generation-past-context",
        generation_past_context,
        ("and max_new_tokens 200 exceed the model's context of 512 tokens", "give at most"),
    ),
    Case(
        "more-images-than-placeholders",
        more_images_than_placeholders,
        ("2 image(s) given but the prompts take 1",),
    ),
    Case(
        "fewer-images-than-placeholders",
        fewer_images_than_placeholders,
        ("1 image(s) given but the prompts take 2",),
    ),
    Case(
        "image-markers-out-of-order",
        image_markers_out_of_order,
        (
            "image markers must be <|image_1|>, <|image_2|>, ... in order",
            "the prompt has <|image_2|>, <|image_1|>",
        ),
    ),
]


def _fill_disk_on_write(monkeypatch) -> None:
    """Simulate a full disk: graph files get half-written, then the write fails with ENOSPC."""

    def save(model, path):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(interop, "save", save)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly(case: Case, tiny_llava: Path, tmp_path: Path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    argv = case.setup(work, tiny_llava)
    if case.id == "disk-full":
        _fill_disk_on_write(monkeypatch)
    before, pkg_before = tree(work), tree(tiny_llava)

    result = CliRunner().invoke(main, argv)

    assert result.exit_code == case.exit_code, (result.exit_code, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"want one line on stderr, got: {result.stderr!r}"
    assert lines[0].startswith("vlmc: error: "), lines[0]
    for fragment in case.expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert tree(work) == before, "files were written or the input changed"
    assert tree(tiny_llava) == pkg_before
    assert not (work / "PWNED").exists(), "untrusted code ran"


def test_every_case_names_its_fix():
    """Each message names the problem and how to fix it: a table of cases without a fix fragment is a bug."""
    assert len({c.id for c in CASES}) == len(CASES)
    assert all(c.expect for c in CASES)


def test_disk_full_without_quiet_still_ends_in_one_error_line(tiny_llava, tmp_path, monkeypatch):
    _fill_disk_on_write(monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    recipe = _recipe(work)
    before = tree(work)
    result = CliRunner().invoke(main, ["optimize", str(tiny_llava), "-r", recipe, "-o", str(work / "out")])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("vlmc:")]
    assert errors == [lines[-1]] and "No space left on device" in lines[-1]
    assert all(line.endswith(" ...") for line in lines[:-1]), lines  # only progress notes precede it
    assert tree(work) == before


def test_verbose_shows_the_traceback(tmp_path):
    result = CliRunner().invoke(main, ["-v", "inspect", str(tmp_path)])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "is not a vlmc package" in result.stderr


def test_force_replaces_a_previous_vlmc_package(tiny_llava, tmp_path):
    """The one thing --force may delete: a directory that is itself a vlmc package."""
    out = tmp_path / "out"
    shutil.copytree(tiny_llava, out)
    (out / "stale.txt").write_text("from an older export")
    result = CliRunner().invoke(
        main, ["optimize", str(tiny_llava), "-r", _recipe(tmp_path), "-o", str(out), "--force"]
    )
    assert result.exit_code == 0, result.stderr
    assert not (out / "stale.txt").exists()
    assert [h["pass"] for h in json.loads((out / "vlmc.json").read_text())["history"]] == [
        "fold_constants",
        "simplify",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "recipe.yaml"]  # no .tmp-/.old- leftovers


def test_docs_list_every_case():
    text = (Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text()
    missing = [c.id for c in CASES if f"| `{c.id}` |" not in text]
    assert missing == [], f"docs/errors.md lacks rows for {missing}"


# ---- safe loading: nothing a recipe or pass names can land outside the output ------------------------
@pytest.mark.parametrize("rel", ["../escape.txt", "samples/../../escape.txt", "/tmp/vlmc-escape-test.txt"])
def test_package_files_cannot_escape_the_package(tiny_llava, tmp_path, rel):
    from vlmc.errors import VlmcError
    from vlmc.package import Package

    pkg = Package.load(tiny_llava)
    pkg.files[rel] = b"should never be written"
    with pytest.raises(VlmcError, match="outside the package"):
        pkg.save(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not Path("/tmp/vlmc-escape-test.txt").exists()


def test_external_data_outside_the_package_is_refused(tiny_llava, tmp_path):
    """A graph whose weights point outside its package (e.g. at ../secret) fails to open, one line."""
    import onnx

    p = _copy(tiny_llava, tmp_path)
    model = onnx.load(str(p / "embed_tokens.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    for e in tensor.external_data:
        if e.key == "location":
            e.value = "../secret.bin"
    (tmp_path / "secret.bin").write_bytes(b"\0" * 1_000_000)
    (p / "embed_tokens.onnx").write_bytes(model.SerializeToString())
    result = CliRunner().invoke(main, ["inspect", str(p)])
    assert result.exit_code == 2
    assert result.stderr.startswith("vlmc: error: ") and "outside" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_unknown_kv_layout_is_a_one_line_error():
    # The manifest check refuses such a package on load; a manifest built in memory reaches the runtime.
    from vlmc.errors import VlmcError
    from vlmc.runtime import kv

    with pytest.raises(
        VlmcError, match=r"unknown KV layout 'ring' \(kv.layout\); known layouts: contiguous, paged"
    ):
        kv.make({"layout": "ring", "layers": 1, "kv_heads": 1, "head_dim": 4}, batch=1)
    assert isinstance(
        kv.make({"layout": "contiguous", "layers": 1, "kv_heads": 1, "head_dim": 4}, batch=1), kv.ContiguousKV
    )
