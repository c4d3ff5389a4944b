"""Untrusted packages and recipes (issue 19): tampered inputs through the real CLI.

Every case prepares a copy of a real exported package (and files around it) under a work directory
that also holds a canary file and a victim file, runs one command in-process, and asserts:
the exit code, exactly one line on stderr naming the problem, no traceback, nothing written or
changed anywhere under the work directory (so the input's hash is unchanged and nothing landed
outside the package or the output), and the canary's contents in no output and no stdout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmc.cli import main

CANARY = "CANARY-7f3a9c1e-never-copy-me"
RECIPE = "passes:\n  - fold_constants\n"


def tree(root: Path) -> dict[str, str]:
    """Every entry under root with a content hash (links by target, so a swapped link shows too)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if p.is_dir() else "other"
    return out


def canary_leaks(root: Path) -> list[str]:
    """Files under root (other than the canary itself) whose bytes contain the canary text."""
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and p.name != "canary.txt":
            if CANARY.encode() in p.read_bytes():
                hits.append(p.relative_to(root).as_posix())
    return hits


@dataclass
class Case:
    id: str
    cls: str  # the class: write-outside, read-outside, unbounded, internal-error, silent
    setup: Callable[[Path, Path], list[str]]  # (work, package copy) -> argv
    expect: tuple[str, ...]
    exit_code: int = 2


# ---- helpers ------------------------------------------------------------------------------------
def edit(pkg: Path, fn: Callable[[dict], None]) -> None:
    m = json.loads((pkg / "vlmc.json").read_text())
    fn(m)
    (pkg / "vlmc.json").write_text(json.dumps(m, indent=2))


def recipe(work: Path, text: str = RECIPE) -> str:
    p = work / "recipe.yaml"
    p.write_text(text)
    return str(p)


def optimize(work: Path, pkg: Path, text: str = RECIPE) -> list[str]:
    return ["optimize", str(pkg), "-r", recipe(work, text), "-o", str(work / "out")]


def inspect(pkg: Path) -> list[str]:
    return ["inspect", str(pkg), "--json"]


def run(pkg: Path, *extra: str) -> list[str]:
    return ["run", str(pkg), "--prompt", "hi", "--max-new-tokens", "1", *extra]


def set_key(path: str, value) -> Callable[[Path, Path], list[str]]:
    """A case that sets one manifest value (dotted path) and opens the package."""

    def setup(work, pkg):
        def fn(m):
            node = m
            *parents, last = path.split(".")
            for k in parents:
                node = node[int(k)] if isinstance(node, list) else node[k]
            if isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value

        edit(pkg, fn)
        return inspect(pkg)

    return setup


def source_tokenizer(pkg: Path, template: str | None = "{{ messages[0].content[-1].text }}") -> None:
    """Give the package a real `tokenizers` tokenizer (and a chat template), as exports from hub models have."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    m = json.loads((pkg / "vlmc.json").read_text())
    vocab = {"[UNK]": 0, "hi": 5, "<image>": m["vision"]["image_token_id"]}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<image>"])
    (pkg / "tokenizer.json").write_text(tok.to_str())
    m["text"].update(tokenizer="source", tokenizer_file="tokenizer.json")
    if template is not None:
        (pkg / "chat_template.jinja").write_text(template)
        m["text"]["chat_template"] = "chat_template.jinja"
    (pkg / "vlmc.json").write_text(json.dumps(m, indent=2))


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims width x height (only a few bytes on disk: a bomb if decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def link(src: Path, target: Path) -> None:
    if src.exists() or src.is_symlink():
        src.unlink()
    src.symlink_to(target)


def victim_package(work: Path, pkg: Path) -> Path:
    """Someone else's package beside ours, which no command here may touch."""
    v = work / "theirs"
    shutil.copytree(pkg, v)
    (v / "their-notes.txt").write_text("keep me")
    return v


# ---- write outside the package ----------------------------------------------------------------------
def weights_file_parent(work, pkg):
    edit(pkg, lambda m: m["graphs"]["decoder"].update(weights_file="../victim.txt"))
    return optimize(work, pkg)


def weights_file_absolute(work, pkg):
    edit(pkg, lambda m: m["graphs"]["decoder"].update(weights_file=str(work / "victim.txt")))
    return optimize(work, pkg)


def weights_file_symlink_out(work, pkg):
    link(pkg / "shared.data", work / "victim.txt")
    edit(pkg, lambda m: m["graphs"]["decoder"].update(weights_file="shared.data"))
    return optimize(work, pkg)


def graph_file_parent(work, pkg):
    shutil.copy(pkg / "decoder.onnx", work / "decoder.onnx")
    edit(pkg, lambda m: m["graphs"]["decoder"].update(file="../decoder.onnx"))
    return inspect(pkg)


def graph_file_symlink_out(work, pkg):
    (work / "elsewhere").mkdir()
    shutil.move(pkg / "decoder.onnx", work / "elsewhere" / "decoder.onnx")
    link(pkg / "decoder.onnx", work / "elsewhere" / "decoder.onnx")
    return inspect(pkg)


def _set_location(pkg: Path, location: str) -> None:
    import onnx

    model = onnx.load(str(pkg / "embed_tokens.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    for e in tensor.external_data:
        if e.key == "location":
            e.value = location
    (pkg / "embed_tokens.onnx").write_bytes(model.SerializeToString())


def external_data_parent(work, pkg):
    shutil.copy(pkg / "embed_tokens.onnx.data", work / "secret.bin")
    _set_location(pkg, "../secret.bin")
    return inspect(pkg)


def external_data_absolute(work, pkg):
    _set_location(pkg, str(work / "canary.txt"))
    return inspect(pkg)


def external_data_symlink_out(work, pkg):
    shutil.move(pkg / "embed_tokens.onnx.data", work / "outside.data")
    link(pkg / "embed_tokens.onnx.data", work / "outside.data")
    return inspect(pkg)


def verify_report_md_symlink(work, pkg):
    link(pkg / "report.md", work / "victim.txt")
    return ["verify", str(pkg), "--max-new-tokens", "1"]


def verify_json_symlink(work, pkg):
    link(pkg / "verify.json", work / "victim.txt")
    return ["verify", str(pkg), "--max-new-tokens", "1"]


def compile_into_own_input(work, pkg):
    return ["compile", str(pkg), "--target", "ort", "-o", str(pkg / "build")]


def compile_around_own_input(work, pkg):
    return ["compile", str(pkg), "--target", "ort", "-o", str(work), "--force"]


def optimize_onto_own_input(work, pkg):
    return ["optimize", str(pkg), "-r", recipe(work), "-o", str(pkg), "--force"]


def force_through_symlink(work, pkg):
    v = victim_package(work, pkg)
    link(work / "out", v)
    return [*optimize(work, pkg), "--force"]


def dangling_symlink_output(work, pkg):
    link(work / "out", work / "not-yet")
    return optimize(work, pkg)


def export_dangling_symlink_output(work, pkg):
    link(work / "out", work / "not-yet")
    return ["export", "tiny-llava", "-o", str(work / "out")]


def force_marker_is_a_symlink(work, pkg):
    d = work / "out"
    d.mkdir()
    (d / "mine.txt").write_text("not a vlmc output")
    link(d / "vlmc.json", pkg / "vlmc.json")
    return [*optimize(work, pkg), "--force"]


def write_error_leaves_no_parents(work, pkg):
    # The disk fills while the output is written (see disk_full): the error leaves no directory vlmc
    # created on the way to it, not even the empty parents.
    return ["optimize", str(pkg), "-r", recipe(work), "-o", str(work / "new" / "deeper" / "out")]


def disk_full(monkeypatch) -> None:
    import errno

    from vlmc import interop

    def save(model, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(interop, "save", save)


# ---- read outside the package -----------------------------------------------------------------------
def tokenizer_file_etc_passwd(work, pkg):
    source_tokenizer(pkg, None)
    edit(pkg, lambda m: m["text"].update(tokenizer_file="/etc/passwd"))
    return run(pkg)


def tokenizer_file_parent(work, pkg):
    source_tokenizer(pkg, None)
    edit(pkg, lambda m: m["text"].update(tokenizer_file="../../canary.txt"))
    return run(pkg)


def chat_template_parent(work, pkg):
    source_tokenizer(pkg)
    edit(pkg, lambda m: m["text"].update(chat_template="../canary.txt"))
    return run(pkg)


def chat_template_symlink_out(work, pkg):
    source_tokenizer(pkg)
    link(pkg / "chat_template.jinja", work / "canary.txt")
    return run(pkg)


def tokenizer_symlink_out(work, pkg):
    source_tokenizer(pkg, None)
    shutil.move(pkg / "tokenizer.json", work / "tokenizer.json")
    link(pkg / "tokenizer.json", work / "tokenizer.json")
    return run(pkg)


def sample_symlink_out(work, pkg):
    link(pkg / "samples" / "extra.npz", work / "canary.txt")
    return optimize(work, pkg)


def samples_dir_symlink_out(work, pkg):
    (work / "loot").mkdir()
    (work / "loot" / "canary.txt").write_text(CANARY)
    shutil.rmtree(pkg / "samples")
    link(pkg / "samples", work / "loot")
    return optimize(work, pkg)


def picture_symlink_out(work, pkg):
    link(pkg / "pruning.png", work / "canary.txt")
    return ["inspect", str(pkg)]


def fifo_in_package(work, pkg):
    os.mkfifo(pkg / "samples" / "pipe.npz")
    return optimize(work, pkg)


def dangling_link_in_package(work, pkg):
    link(pkg / "notes.txt", work / "gone.txt")
    return optimize(work, pkg)


# ---- unbounded work ---------------------------------------------------------------------------------
def calibration_count_huge(work, pkg):
    return optimize(
        work,
        pkg,
        "passes:\n  - quantize: {decoder: {weights: int8, activations: int8}, calibration: {count: 1000000000000}}\n",
    )


def eval_samples_huge(work, pkg):
    return optimize(
        work, pkg, "passes:\n  - quantize: {decoder: {weights: int8}, eval_samples: 1000000000}\n"
    )


def recipe_nan(work, pkg):
    return optimize(work, pkg, "passes:\n  - prune_visual_tokens: {ratio: .nan}\n")


def recipe_inf(work, pkg):
    return optimize(work, pkg, "passes:\n  - fold_constants: {size_threshold_mb: .inf}\n")


def target_batch_huge(work, pkg):
    r = recipe(work, "target: {backend: ascend, batch_sizes: [1000000000000000000000000000000]}\n")
    return ["compile", str(pkg), "-r", r, "-o", str(work / "build")]


def target_too_many_gears(work, pkg):
    gears = ", ".join(str(i) for i in range(1, 1001))
    r = recipe(work, f"target: {{backend: ascend, sequence_buckets: [{gears}]}}\n")
    return ["compile", str(pkg), "-r", r, "-o", str(work / "build")]


def split_ranges_huge(work, pkg):
    return optimize(work, pkg, "passes:\n  - split: {decoder_ranges: 100000000}\n")


def chat_template_nested_loops(work, pkg):
    source_tokenizer(pkg, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    return run(pkg)


def chat_template_huge_output(work, pkg):
    source_tokenizer(pkg, "{{ 'a' * 1000000000 }}")
    return run(pkg)


def chat_template_format_bomb(work, pkg):
    source_tokenizer(pkg, "{{ '%1000000000d'|format(1) }}")
    return run(pkg)


def image_bomb_30000(work, pkg):
    png_header(work / "bomb.png", 30000, 30000)
    return run(pkg, "--image", str(work / "bomb.png"))


def image_past_bound(work, pkg):
    png_header(work / "big.png", 9000, 9000)
    return run(pkg, "--image", str(work / "big.png"))


def plan_batch_huge(work, pkg):
    return ["plan", str(pkg), "--device-memory", "16GiB", "--batch", str(10**30)]


def run_tokens_huge(work, pkg):
    return ["run", str(pkg), "--prompt", "hi", "--max-new-tokens", str(10**9)]


def kv_head_dim_not_the_graphs(work, pkg):
    # Valid by the schema, but not the decoder's: the KV feeds built from it do not fit the graph.
    edit(pkg, lambda m: m["kv"].update(head_dim=m["kv"]["head_dim"] + 1))
    return run(pkg)


def verify_threshold_nan(work, pkg):
    return ["verify", str(pkg), "--max-logit-diff", "nan"]


# ---- internal errors for bad input ------------------------------------------------------------------
def tokenizer_malformed(work, pkg):
    source_tokenizer(pkg, None)
    (pkg / "tokenizer.json").write_text('{"model": {"type": "WordLevel"')
    return run(pkg)


def tokenizer_not_utf8(work, pkg):
    source_tokenizer(pkg, None)
    (pkg / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    return run(pkg)


def tokenizer_ids_outside_vocab(work, pkg):
    from tokenizers import Tokenizer, models, pre_tokenizers

    source_tokenizer(pkg, None)
    m = json.loads((pkg / "vlmc.json").read_text())
    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, "hi": 100000, "<image>": m["vision"]["image_token_id"]}, "[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<image>"])
    (pkg / "tokenizer.json").write_text(tok.to_str())
    return run(pkg)


def prompt_lone_surrogate(work, pkg):
    return ["run", str(pkg), "--prompt", "hi \ud800 there", "--max-new-tokens", "1"]


def safetensors_bad_header(work, pkg):
    from vlmc.exporters import zoo

    d = work / "model"
    zoo.build("tiny-llava").config.save_pretrained(d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{not json")
    return ["export", str(d), "-o", str(work / "out")]


def config_negative_layers(work, pkg):
    from vlmc.exporters import zoo

    d = work / "model"
    zoo.build("tiny-llava").config.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = -1
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"")
    return ["export", str(d), "-o", str(work / "out")]


def manifest_deeply_nested(work, pkg):
    m = json.loads((pkg / "vlmc.json").read_text())
    text = json.dumps(m)[:-1] + ', "deep": ' + "[" * 100000 + "]" * 100000 + "}"
    (pkg / "vlmc.json").write_text(text)
    return inspect(pkg)


def manifest_nan(work, pkg):
    text = (
        (pkg / "vlmc.json")
        .read_text()
        .replace('"rescale_factor": 0.00392156862745098', '"rescale_factor": NaN')
    )
    (pkg / "vlmc.json").write_text(text)
    return inspect(pkg)


def graph_entry_deleted(work, pkg):
    edit(pkg, lambda m: m["graphs"].pop("embed_tokens"))
    return inspect(pkg)


def pass_keep_above_tokens(work, pkg):
    return optimize(work, pkg, "passes:\n  - prune_visual_tokens: {keep: 1000}\n")


def pass_unknown_graph(work, pkg):
    return optimize(work, pkg, "passes:\n  - simplify: {graphs: [no_such_graph]}\n")


CASES = [
    # write outside
    Case("weights-file-parent", "write-outside", weights_file_parent, ("graphs.decoder.weights_file",)),
    Case("weights-file-absolute", "write-outside", weights_file_absolute, ("graphs.decoder.weights_file",)),
    Case("weights-file-symlink-out", "write-outside", weights_file_symlink_out, ("shared.data", "outside")),
    Case("graph-file-parent", "write-outside", graph_file_parent, ("graphs.decoder.file",)),
    Case("graph-file-symlink-out", "write-outside", graph_file_symlink_out, ("decoder.onnx", "outside")),
    Case("external-data-parent", "write-outside", external_data_parent, ("external data", "outside")),
    Case("external-data-absolute", "write-outside", external_data_absolute, ("external data", "outside")),
    Case(
        "external-data-symlink-out", "write-outside", external_data_symlink_out, ("embed_tokens.onnx.data",)
    ),
    Case("verify-report-md-symlink", "write-outside", verify_report_md_symlink, ("report.md", "outside")),
    Case("verify-json-symlink", "write-outside", verify_json_symlink, ("verify.json", "outside")),
    Case("compile-into-own-input", "write-outside", compile_into_own_input, ("inside the input package",)),
    Case(
        "compile-around-own-input", "write-outside", compile_around_own_input, ("contains the input package",)
    ),
    Case(
        "optimize-onto-own-input", "write-outside", optimize_onto_own_input, ("contains the input package",)
    ),
    Case("force-through-symlink", "write-outside", force_through_symlink, ("symbolic link",)),
    Case("dangling-symlink-output", "write-outside", dangling_symlink_output, ("symbolic link",)),
    Case("export-dangling-symlink", "write-outside", export_dangling_symlink_output, ("symbolic link",)),
    Case("force-marker-is-a-symlink", "write-outside", force_marker_is_a_symlink, ("not a vlmc output",)),
    Case(
        "write-error-leaves-no-parents",
        "write-outside",
        write_error_leaves_no_parents,
        ("No space left on device",),
    ),
    # read outside
    Case("tokenizer-file-etc-passwd", "read-outside", tokenizer_file_etc_passwd, ("text.tokenizer_file",)),
    Case("tokenizer-file-parent", "read-outside", tokenizer_file_parent, ("text.tokenizer_file",)),
    Case("chat-template-parent", "read-outside", chat_template_parent, ("text.chat_template",)),
    Case(
        "chat-template-symlink-out",
        "read-outside",
        chat_template_symlink_out,
        ("chat_template.jinja", "outside"),
    ),
    Case("tokenizer-symlink-out", "read-outside", tokenizer_symlink_out, ("tokenizer.json", "outside")),
    Case("sample-symlink-out", "read-outside", sample_symlink_out, ("samples/extra.npz", "outside")),
    Case(
        "samples-dir-symlink-out", "read-outside", samples_dir_symlink_out, ("samples", "symlinked directory")
    ),
    Case("picture-symlink-out", "read-outside", picture_symlink_out, ("pruning.png", "outside")),
    Case("fifo-in-package", "read-outside", fifo_in_package, ("pipe.npz", "not a regular file")),
    Case("dangling-link-in-package", "read-outside", dangling_link_in_package, ("notes.txt",)),
    # unbounded work
    Case("calibration-count-huge", "unbounded", calibration_count_huge, ("calibration: count=", "maximum")),
    Case("eval-samples-huge", "unbounded", eval_samples_huge, ("eval_samples", "maximum")),
    Case("recipe-nan", "unbounded", recipe_nan, ("ratio", "finite")),
    Case("recipe-inf", "unbounded", recipe_inf, ("size_threshold_mb", "finite")),
    Case("target-batch-huge", "unbounded", target_batch_huge, ("batch_sizes", "maximum")),
    Case("target-too-many-gears", "unbounded", target_too_many_gears, ("sequence_buckets", "1000 items")),
    Case("split-ranges-huge", "unbounded", split_ranges_huge, ("decoder_ranges", "maximum")),
    Case(
        "preprocess-size-huge",
        "unbounded",
        set_key("vision.preprocess.crop_size", [100000, 100000]),
        ("crop_size",),
    ),
    Case(
        "preprocess-edge-huge",
        "unbounded",
        set_key("vision.preprocess.resize_shortest_edge", 100000),
        ("resize_shortest_edge",),
    ),
    Case(
        "image-size-huge", "unbounded", set_key("vision.image_size", [100000, 100000]), ("vision.image_size",)
    ),
    Case("template-nested-loops", "unbounded", chat_template_nested_loops, ("chat template", "steps")),
    Case("template-huge-output", "unbounded", chat_template_huge_output, ("chat template", "repetition")),
    Case("template-format-bomb", "unbounded", chat_template_format_bomb, ("chat template", "format width")),
    Case("image-bomb-30000", "unbounded", image_bomb_30000, ("bomb.png", "VLMC_MAX_IMAGE_PIXELS")),
    Case("image-past-bound", "unbounded", image_past_bound, ("81000000 pixels", "VLMC_MAX_IMAGE_PIXELS")),
    Case("plan-batch-huge", "unbounded", plan_batch_huge, ("--batch",)),
    Case("run-tokens-huge", "unbounded", run_tokens_huge, ("--max-new-tokens",)),
    Case("verify-threshold-nan", "unbounded", verify_threshold_nan, ("--max-logit-diff", "finite")),
    # internal errors for bad input
    Case("tokenizer-malformed", "internal-error", tokenizer_malformed, ("text.tokenizer_file",)),
    Case("tokenizer-not-utf8", "internal-error", tokenizer_not_utf8, ("tokenizer.json", "UTF-8")),
    Case(
        "tokenizer-ids-outside-vocab", "internal-error", tokenizer_ids_outside_vocab, ("100000", "vocab_size")
    ),
    Case("prompt-lone-surrogate", "internal-error", prompt_lone_surrogate, ("prompt #1", "surrogate")),
    Case(
        "safetensors-bad-header", "internal-error", safetensors_bad_header, ("not a valid safetensors file",)
    ),
    Case("config-negative-layers", "internal-error", config_negative_layers, ("num_hidden_layers=-1",)),
    Case(
        "kv-dtype-quaternion", "internal-error", set_key("kv.dtype", "quaternion"), ("kv.dtype", "quaternion")
    ),
    Case("manifest-deeply-nested", "internal-error", manifest_deeply_nested, ("vlmc.json", "nested")),
    Case("manifest-nan", "internal-error", manifest_nan, ("vlmc.json", "NaN")),
    Case("graph-entry-deleted", "internal-error", graph_entry_deleted, ("pipeline", "embed_tokens")),
    Case(
        "token-id-outside-vocab",
        "internal-error",
        set_key("vision.image_token_id", 100000),
        ("image_token_id",),
    ),
    Case("num-layers-negative", "internal-error", set_key("kv.layers", -1), ("kv.layers",)),
    Case("kv-head-dim-not-the-graphs", "internal-error", kv_head_dim_not_the_graphs, ("decoder", "manifest")),
    Case("vocab-size-zero", "internal-error", set_key("text.vocab_size", 0), ("text.vocab_size",)),
    Case("pass-keep-above-tokens", "internal-error", pass_keep_above_tokens, ("prune_visual_tokens", "1000")),
    Case("pass-unknown-graph", "internal-error", pass_unknown_graph, ("simplify", "no_such_graph")),
    # accepted silently before
    Case(
        "negative-image-token-id", "silent", set_key("vision.image_token_id", -5), ("vision.image_token_id",)
    ),
    Case("shape-as-string", "silent", set_key("graphs.decoder.inputs.0.shape", "batch"), ("shape",)),
    Case("std-zero", "silent", set_key("vision.preprocess.std", [0, 0, 0]), ("vision.preprocess.std[0]",)),
    Case("format-version-negative", "silent", set_key("format_version", -1), ("format_version",)),
    Case("eos-outside-vocab", "silent", set_key("text.eos_token_id", 10**6), ("text.eos_token_id",)),
    Case("tokens-per-image-zero", "silent", set_key("vision.tokens_per_image", 0), ("tokens_per_image",)),
    Case(
        "graph-role-unknown",
        "silent",
        set_key("graphs.decoder.precision", "fp3"),
        ("graphs.decoder.precision",),
    ),
    Case(
        "tokenizer-file-absolute",
        "silent",
        set_key("text.tokenizer_file", "/etc/passwd"),
        ("text.tokenizer_file",),
    ),
]


@pytest.fixture
def work(tiny_llava: Path, tmp_path: Path) -> tuple[Path, Path]:
    w = tmp_path / "work"
    w.mkdir()
    (w / "canary.txt").write_text(CANARY)
    (w / "victim.txt").write_text("the victim's own text")
    pkg = w / "pkg"
    shutil.copytree(tiny_llava, pkg)
    return w, pkg


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tampered_input_fails_cleanly(case: Case, work, monkeypatch):
    w, pkg = work
    monkeypatch.chdir(w)
    argv = case.setup(w, pkg)
    if case.id == "write-error-leaves-no-parents":
        disk_full(monkeypatch)
    before = tree(w)
    result = CliRunner().invoke(main, ["-q", *argv])  # -q: no progress notes before the error line
    assert result.exit_code == case.exit_code, (result.exit_code, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"want one line on stderr, got: {result.stderr!r}"
    assert lines[0].startswith("vlmc: error: "), lines[0]
    assert "internal error" not in lines[0]
    for fragment in case.expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert tree(w) == before, "files were written or an input changed"
    assert canary_leaks(w) == [] and CANARY not in result.stdout


def test_at_least_forty_cases_across_the_classes():
    assert len({c.id for c in CASES}) == len(CASES) >= 40
    classes = {c.cls for c in CASES}
    assert classes == {"write-outside", "read-outside", "unbounded", "internal-error", "silent"}


def test_symlink_inside_the_package_is_copied_as_a_regular_file(work):
    """The one allowed link: to a regular file inside the package; the output gets a real file."""
    w, pkg = work
    (pkg / "notes.txt").write_text("notes")
    link(pkg / "notes-link.txt", pkg / "notes.txt")
    before = tree(pkg)
    result = CliRunner().invoke(main, optimize(w, pkg))
    assert result.exit_code == 0, result.stderr
    out = w / "out"
    assert (out / "notes-link.txt").is_file() and not (out / "notes-link.txt").is_symlink()
    assert (out / "notes-link.txt").read_text() == "notes"
    assert tree(pkg) == before and canary_leaks(w) == []


def test_force_replaces_only_a_real_vlmc_output(work):
    """--force on a real previous output works, and leaves the victim package beside it untouched."""
    w, pkg = work
    v = victim_package(w, pkg)
    theirs = tree(v)
    out = w / "out"
    assert CliRunner().invoke(main, optimize(w, pkg)).exit_code == 0
    result = CliRunner().invoke(main, [*optimize(w, pkg), "--force"])
    assert result.exit_code == 0, result.stderr
    assert tree(v) == theirs and (out / "vlmc.json").is_file()


def test_verify_writes_reports_atomically_through_the_one_writer(tmp_path):
    from vlmc import outdir

    d = tmp_path / "pkg"
    d.mkdir()
    (tmp_path / "victim.txt").write_text("victim")
    (d / "report.md").symlink_to(tmp_path / "victim.txt")
    outdir.write_file(d, "report.md", "new report")
    assert (tmp_path / "victim.txt").read_text() == "victim"  # the link was replaced, not followed
    assert not (d / "report.md").is_symlink() and (d / "report.md").read_text() == "new report"
    assert sorted(p.name for p in d.iterdir()) == ["report.md"]  # no temporary file left


def test_confinement_rule_refuses_every_escape(tmp_path):
    from vlmc import paths
    from vlmc.errors import VlmcError

    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.txt").write_text("ok")
    (tmp_path / "secret").write_text(CANARY)
    (root / "out-link").symlink_to(tmp_path / "secret")
    (root / "in-link").symlink_to(root / "sub" / "ok.txt")
    assert paths.read_text(root, "in-link", "k") == "ok"
    assert paths.read_text(root, "sub/ok.txt", "k") == "ok"
    for rel in ["../secret", "/etc/passwd", "sub/../../secret", "out-link", "~/x", "a\\..\\b", "", "x\0y"]:
        with pytest.raises(VlmcError, match="k"):
            paths.read_text(root, rel, "k")


def test_schema_in_docs_is_current():
    from vlmc import manifest_schema

    doc = Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json"
    assert json.loads(doc.read_text()) == json.loads(json.dumps(manifest_schema.json_schema())), (
        "docs/manifest.schema.json is stale: run `make schema`"
    )


def test_security_doc_lists_every_bound():
    from vlmc import limits

    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    names = [n for n in dir(limits) if n.startswith("MAX_")]
    missing = [n for n in names if n not in text]
    assert missing == [], f"docs/security.md does not mention {missing}"


# ---- property: any mutation of a real package's values -> exit 0 or 2, never a write outside --------
_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.sampled_from([0, -1, 1, 2**31, 10**12, 100000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["../victim.txt", "/etc/passwd", "../../canary.txt", "quaternion", "NaN", "samples"]),
    st.lists(st.integers(-5, 100000), max_size=4),
)


def _leaves(node, prefix=()):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        if isinstance(v, (dict, list)) and v:
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


@pytest.fixture(scope="module")
def base_manifest(tiny_llava) -> dict:
    return json.loads((tiny_llava / "vlmc.json").read_text())


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_mutated_value_exits_0_or_2(base_manifest, tiny_llava, tmp_path_factory, data):
    m = copy.deepcopy(base_manifest)
    leaves = [p for p in _leaves(m) if p[0] != "history"]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(leaves))
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = data.draw(_value)
    w = tmp_path_factory.mktemp("mut")
    (w / "canary.txt").write_text(CANARY)
    pkg = w / "pkg"
    shutil.copytree(tiny_llava, pkg)
    (pkg / "vlmc.json").write_text(json.dumps(m))  # json.dumps writes NaN/Infinity for non-finite floats
    before = tree(w)
    command = data.draw(st.sampled_from(["inspect", "run"]))
    argv = inspect(pkg) if command == "inspect" else run(pkg)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr, path)
    assert "internal error" not in result.stderr and "Traceback" not in result.output
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert tree(w) == before
    assert canary_leaks(w) == [] and CANARY not in result.stdout


# ---- long loops react to signals ------------------------------------------------------------------
# As at a terminal: a test runner started in the background (`make test &`) hands its children SIGINT
# ignored (POSIX shells do that without job control), and vlmc, like Python, keeps an inherited SIG_IGN.
MARKED = """\
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from vlmc.runtime import pipeline
real = pipeline.Pipeline.prepare
def prepare(self, *args, **kwargs):
    open(os.environ["VLMC_TEST_MARKER"], "a").close()  # the calibration loop is running
    return real(self, *args, **kwargs)
pipeline.Pipeline.prepare = prepare
from vlmc.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_calibration_loop_stops_on_a_signal(tiny_llava, tmp_path, sig, code):
    """A 4096-sample calibration (the maximum) stops within a second of SIGINT/SIGTERM, writing nothing."""
    r = tmp_path / "r.yaml"
    r.write_text(
        "passes:\n  - quantize: {decoder: {weights: int8, activations: int8}, calibration: {count: 4096}}\n"
    )
    marker = tmp_path / "calibrating"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            MARKED,
            "-q",
            "optimize",
            str(tiny_llava),
            "-r",
            str(r),
            "-o",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, VLMC_TEST_MARKER=str(marker)),
    )
    deadline = time.monotonic() + 180
    while not marker.exists():  # the phase: the first calibration sample is being prepared
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "calibration never started"
        time.sleep(0.02)
    assert proc.poll() is None, "the calibration finished before the signal"
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == code, err.decode()
    assert "interrupted; nothing was written" in err.decode()
    assert not (tmp_path / "out").exists()
    # The signal is raised where it lands, and again before the next sample if it landed where it was
    # swallowed (vlmc.interrupts); the interpreter's teardown is skipped (vlmc.cli). 4096 samples take
    # minutes: the bound shows the loop stopped, with room for a machine with every core busy.
    assert elapsed < 5.0, f"took {elapsed:.2f}s to stop"
    print(f"stopped {elapsed:.2f}s after the signal")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrating", "r.yaml"]
