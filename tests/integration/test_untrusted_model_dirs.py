"""Untrusted model directories (issue 29): tampered checkpoints, configs and tokenizer files through the real CLI.

Every case copies a real tiny model directory (LLaVA, sharded BF16 as the hub stores it, three decoder layers so
the export streams) under a work directory holding a canary and a victim file, runs `vlmc export DIR -o OUT`
(or `build`, `run`) as a subprocess with no stdin, and asserts: exit 2, exactly one line on stderr naming the
problem, nothing written or changed anywhere under the work directory, the canary in no output, no code ran.
The Hugging Face cache keeps working: a cache laid out as huggingface_hub lays it out (snapshot files linking
into ``../../blobs``) exports, by hub id and by snapshot path. A hypothesis property holds the safetensors
header check to what the safetensors library itself reads.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import _real_tokenizers
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vlmc import paths
from vlmc.errors import VlmcError
from vlmc.exporters import checkpoint

from .test_untrusted import CANARY, canary_leaks, link, tree

REV = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the cache names snapshots


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A LLaVA directory saved by save_pretrained: BF16, three shards and an index, processor files."""
    return _real_tokenizers.llava_dir(
        tmp_path_factory.mktemp("model-dirs") / "llava",
        text_layers=3,
        vision_layers=3,
        save_kwargs={"dtype": torch.bfloat16, "max_shard_size": "300KB"},
    )


@pytest.fixture
def work(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    w = tmp_path / "work"
    w.mkdir()
    (w / "canary.txt").write_text(CANARY)
    (w / "victim.txt").write_text("the victim's own text")
    (w / "outside").mkdir()
    model = w / "model"
    shutil.copytree(source, model)
    return w, model


def vlmc(*argv: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real CLI in a child process, with no stdin (a prompt would end it) and no network."""
    return subprocess.run(
        [sys.executable, "-m", "vlmc", "-q", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


# ---- helpers ------------------------------------------------------------------------------------
def index(model: Path) -> dict:
    return json.loads((model / checkpoint.INDEX).read_text())


def set_index(model: Path, data: dict) -> None:
    (model / checkpoint.INDEX).write_text(json.dumps(data, indent=2))


def shard_of(model: Path, key: str) -> Path:
    return model / index(model)["weight_map"][key]


def first_shard(model: Path) -> Path:
    return model / sorted(set(index(model)["weight_map"].values()))[0]


def edit_config(model: Path, fn: Callable[[dict], None]) -> None:
    cfg = json.loads((model / "config.json").read_text())
    fn(cfg)
    (model / "config.json").write_text(json.dumps(cfg, indent=2))


def set_config(dotted: str, value) -> Callable[[Path, Path], list[str]]:
    def setup(work, model):
        def fn(cfg):
            *parents, last = dotted.split(".")
            node = cfg
            for k in parents:
                node = node[k]
            node[last] = value

        edit_config(model, fn)
        return export(work, model)

    return setup


def export(work: Path, model: Path) -> list[str]:
    return ["export", str(model), "-o", str(work / "out")]


def retype(model: Path, key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Rewrite one checkpoint tensor in its shard (the shard stays a valid safetensors file)."""
    shard = shard_of(model, key)
    tensors = load_file(str(shard))
    tensors[key] = fn(tensors[key])
    save_file(tensors, str(shard), metadata={"format": "pt"})


def header_of(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def with_header(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def edit_header(fn: Callable[[dict], None]) -> Callable[[Path, Path], list[str]]:
    def setup(work, model):
        shard = first_shard(model)
        _, header, data = header_of(shard)
        fn(header)
        with_header(shard, header, data)
        return export(work, model)

    return setup


def first_tensor(header: dict) -> dict:
    return header[min(k for k in header if k != "__metadata__")]


# ---- the index names weights outside ------------------------------------------------------------
def _shard_outside(work: Path, model: Path) -> tuple[str, Path]:
    """The index's first shard, copied outside the model (so a read of it would succeed) and removed inside."""
    data = index(model)
    shard = sorted(set(data["weight_map"].values()))[0]
    outside = work / "outside" / shard
    shutil.copy(model / shard, outside)
    (model / shard).unlink()
    return shard, outside


def index_names_parent(work, model):
    shard, _ = _shard_outside(work, model)
    data = index(model)
    data["weight_map"] = {
        k: f"../outside/{shard}" if v == shard else v for k, v in data["weight_map"].items()
    }
    set_index(model, data)
    return export(work, model)


def index_names_absolute(work, model):
    shard, outside = _shard_outside(work, model)
    data = index(model)
    data["weight_map"] = {k: str(outside) if v == shard else v for k, v in data["weight_map"].items()}
    set_index(model, data)
    return export(work, model)


def shard_symlink_out(work, model):
    shard, outside = _shard_outside(work, model)
    link(model / shard, outside)
    return export(work, model)


def index_not_a_mapping(work, model):
    set_index(model, {"weight_map": ["model-00001-of-00003.safetensors"]})
    return export(work, model)


def index_names_a_missing_tensor(work, model):
    data = index(model)
    data["weight_map"]["model.no_such.weight"] = sorted(set(data["weight_map"].values()))[0]
    set_index(model, data)
    return export(work, model)


# ---- tokenizer, processor and config files that are not regular files inside -------------------
def file_symlink_out(name: str) -> Callable[[Path, Path], list[str]]:
    def setup(work, model):
        target = work / "outside" / name
        shutil.copy(model / name, target)  # the real content: only the link's direction is wrong
        link(model / name, target)
        return export(work, model)

    return setup


def tokenizer_symlink_to_canary(work, model):
    link(model / "chat_template.jinja", work / "canary.txt")
    return export(work, model)


def tokenizer_is_a_device(work, model):
    link(model / "tokenizer.json", Path("/dev/zero"))
    return export(work, model)


def processor_config_fifo(work, model):
    (model / "processor_config.json").unlink()
    os.mkfifo(model / "processor_config.json")
    return export(work, model)


def tokenizer_config_is_a_directory(work, model):
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").mkdir()
    return export(work, model)


def tokenizer_too_large(work, model):
    with open(model / "tokenizer.json", "r+b") as f:
        f.truncate(paths.MAX_TEXT_BYTES + 1)  # sparse: no disk, but the size a reader would load
    return export(work, model)


def chat_templates_dir_symlink_out(work, model):
    (work / "outside" / "templates").mkdir()
    (work / "outside" / "templates" / "tool.jinja").write_text("{{ messages }}")
    (model / "additional_chat_templates").symlink_to(work / "outside" / "templates")
    return export(work, model)


def config_not_json(work, model):
    (model / "config.json").write_text("{" * 100000)
    return export(work, model)


# ---- weights that are not what the config says -----------------------------------------------------
def config_deeper_than_checkpoint(work, model):
    edit_config(model, lambda c: c["text_config"].update(num_hidden_layers=4))
    return export(work, model)


def vision_deeper_than_checkpoint(work, model):
    edit_config(model, lambda c: c["vision_config"].update(num_hidden_layers=4))
    return export(work, model)


def weight_missing_from_checkpoint(work, model):
    key = "multi_modal_projector.linear_1.weight"  # the legacy names save_pretrained writes
    shard = shard_of(model, key)
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    data = index(model)
    del data["weight_map"][key]
    set_index(model, data)
    return export(work, model)


def stitched_weight_is_int16(work, model):
    key = "language_model.model.layers.2.mlp.up_proj.weight"  # a layer the streaming export stitches
    retype(model, key, lambda t: t.view(torch.int16))
    return export(work, model)


def traced_weight_is_int16(work, model):
    key = "language_model.model.embed_tokens.weight"
    retype(model, key, lambda t: t.view(torch.int16))
    return export(work, model)


def weight_shape_not_the_configs(work, model):
    key = "language_model.model.layers.2.mlp.down_proj.weight"
    retype(model, key, lambda t: t[:, :-1].contiguous())
    return export(work, model)


# ---- damaged safetensors headers ----------------------------------------------------------------
def header_longer_than_file(work, model):
    shard = first_shard(model)
    _, header, data = header_of(shard)
    with_header(shard, header, data, length=len(json.dumps(header).encode()) + len(data) + 1)
    return export(work, model)


def header_length_huge(work, model):
    (first_shard(model)).write_bytes(struct.pack("<Q", 10**12) + b"{not json")
    return export(work, model)


def header_not_json(work, model):
    shard = first_shard(model)
    n, _, data = header_of(shard)
    shard.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + data)
    return export(work, model)


def shard_truncated(work, model):
    shard = first_shard(model)
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 100])
    return export(work, model)


def shard_empty(work, model):
    first_shard(model).write_bytes(b"")
    return export(work, model)


def _offsets_past_end(h):
    first_tensor(h)["data_offsets"][1] += 10**9


def _shape_not_offsets(h):
    first_tensor(h)["shape"][0] += 1


def _unknown_dtype(h):
    first_tensor(h)["dtype"] = "Q7"


def _overlap(h):
    t = first_tensor(h)
    t["data_offsets"] = [t["data_offsets"][0] + 2, t["data_offsets"][1] + 2]


# ---- configs the exporters would trip over ------------------------------------------------------
def tokenizer_declares_custom_code(work, model):
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model / "tokenization_my.py").write_text(f"open({str(work / 'PWNED')!r}, 'w').close()\n")
    return export(work, model)


def recipe_turns_on_remote_code(work, model):
    edit_config(model, lambda c: c.update(auto_map={"AutoConfig": "configuration_my.MyConfig"}))
    (model / "configuration_my.py").write_text(f"open({str(work / 'PWNED')!r}, 'w').close()\n")
    recipe = work / "recipe.yaml"
    recipe.write_text(f"model: {model}\nexport: {{trust_remote_code: true}}\n")
    return ["build", "-r", str(recipe), "-o", str(work / "out")]


class _Pwn:
    """A pickle whose loading writes a file: what an unpickled .bin from elsewhere can do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def recipe_turns_on_pickle(work, model):
    import pickle

    for weights in model.glob("*.safetensors*"):
        weights.unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Pwn(work / "PWNED")))
    recipe = work / "recipe.yaml"
    recipe.write_text(f"model: {model}\nexport: {{allow_pickle: true}}\n")
    return ["build", "-r", str(recipe), "-o", str(work / "out")]


@dataclass
class Case:
    id: str
    setup: Callable[[Path, Path], list[str]]  # (work, model copy) -> argv
    expect: tuple[str, ...]


CASES = [
    # item 1: nothing outside the model directory is read or copied
    Case("index-names-parent", index_names_parent, ("weight_map[", "climbs out with '..'")),
    Case("index-names-absolute", index_names_absolute, ("weight_map[", "is absolute")),
    Case("shard-symlink-out", shard_symlink_out, ("model-00001-of-", "resolves outside")),
    Case("index-not-a-mapping", index_not_a_mapping, ("weight_map must be a non-empty mapping",)),
    Case("index-names-a-missing-tensor", index_names_a_missing_tensor, ("model.no_such.weight",)),
    Case(
        "tokenizer-symlink-out", file_symlink_out("tokenizer.json"), ("'tokenizer.json'", "resolves outside")
    ),
    Case(
        "tokenizer-config-symlink-out",
        file_symlink_out("tokenizer_config.json"),
        ("'tokenizer_config.json'", "resolves outside"),
    ),
    Case(
        "processor-config-symlink-out",
        file_symlink_out("processor_config.json"),
        ("'processor_config.json'", "resolves outside"),
    ),
    Case("config-symlink-out", file_symlink_out("config.json"), ("'config.json'", "resolves outside")),
    Case(
        "generation-config-symlink-out",
        file_symlink_out("generation_config.json"),
        ("'generation_config.json'", "resolves outside"),
    ),
    Case("chat-template-symlink-to-canary", tokenizer_symlink_to_canary, ("chat_template.jinja", "outside")),
    Case("tokenizer-is-a-device", tokenizer_is_a_device, ("'tokenizer.json'", "resolves outside")),
    Case("processor-config-fifo", processor_config_fifo, ("processor_config.json", "not a regular file")),
    Case("tokenizer-config-directory", tokenizer_config_is_a_directory, ("tokenizer_config.json", "regular")),
    Case("tokenizer-too-large", tokenizer_too_large, ("tokenizer.json", "byte limit")),
    Case("chat-templates-dir-symlink-out", chat_templates_dir_symlink_out, ("additional_chat_templates",)),
    Case("config-not-json", config_not_json, ("config.json", "not valid JSON")),
    # item 2: weights are what the config says
    Case("config-deeper-than-checkpoint", config_deeper_than_checkpoint, ("language_model.layers.3.",)),
    Case("vision-deeper-than-checkpoint", vision_deeper_than_checkpoint, ("vision_tower", "layers.3.")),
    Case("weight-missing", weight_missing_from_checkpoint, ("multi_modal_projector.linear_1.weight",)),
    Case("stitched-weight-int16", stitched_weight_is_int16, ("layers.2.mlp.up_proj.weight", "is I16")),
    Case("traced-weight-int16", traced_weight_is_int16, ("embed_tokens.weight", "is I16")),
    Case("weight-shape-not-the-configs", weight_shape_not_the_configs, ("down_proj.weight", "has shape")),
    # item 6: safetensors headers checked before the library reads them
    Case("header-longer-than-file", header_longer_than_file, ("model-00001-of-", "past the end")),
    Case("header-length-huge", header_length_huge, ("model-00001-of-", "limit")),
    Case("header-not-json", header_not_json, ("model-00001-of-", "not JSON")),
    Case("header-offsets-past-eof", edit_header(_offsets_past_end), ("model-00001-of-", "past")),
    Case("header-shape-not-offsets", edit_header(_shape_not_offsets), ("model-00001-of-", "span")),
    Case("header-unknown-dtype", edit_header(_unknown_dtype), ("model-00001-of-", "'Q7'")),
    Case("header-overlap", edit_header(_overlap), ("model-00001-of-", "gap or overlap")),
    Case("shard-truncated", shard_truncated, ("model-00001-of-", "past the")),
    Case("shard-empty", shard_empty, ("model-00001-of-", "empty")),
    # configs: one line, not ZeroDivisionError / IndexError / validation tracebacks
    Case("config-zero-heads", set_config("text_config.num_attention_heads", 0), ("num_attention_heads=0",)),
    Case("config-zero-vision-heads", set_config("vision_config.num_attention_heads", 0), ("vision_config.",)),
    Case(
        "config-kv-heads-not-dividing",
        set_config("text_config.num_key_value_heads", 3),
        ("key_value_heads=3",),
    ),
    Case(
        "config-feature-layer-past-depth",
        set_config("vision_feature_layer", -40),
        ("vision_feature_layer=-40",),
    ),
    Case(
        "config-feature-layer-list-past",
        set_config("vision_feature_layer", [-1, 9]),
        ("vision_feature_layer=9",),
    ),
    Case("config-layer-types-unknown", set_config("text_config.layer_types", ["nope"] * 3), ("'nope'",)),
    Case(
        "config-layer-types-short",
        set_config("text_config.layer_types", ["full_attention"]),
        ("layer_types",),
    ),
    Case("config-layer-count-a-string", set_config("text_config.num_hidden_layers", "3"), ("'3'",)),
    Case("config-select-strategy", set_config("vision_feature_select_strategy", "x"), ("select_strategy",)),
    Case("config-hidden-not-dividing", set_config("text_config.hidden_size", 63), ("hidden size (63)",)),
    Case(
        "config-rope-type-unknown", set_config("text_config.rope_parameters", {"rope_type": "no"}), ("'no'",)
    ),
    # item 5: remote code only with --trust-remote-code on the command line
    Case(
        "tokenizer-declares-custom-code", tokenizer_declares_custom_code, ("auto_map", "--trust-remote-code")
    ),
    Case(
        "recipe-turns-on-remote-code",
        recipe_turns_on_remote_code,
        ("trust_remote_code", "--trust-remote-code"),
    ),
    # unpickling runs code too: only the command line's --allow-pickle turns it on
    Case("recipe-turns-on-pickle", recipe_turns_on_pickle, ("allow_pickle", "--allow-pickle")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tampered_model_directory_fails_cleanly(case: Case, work):
    w, model = work
    argv = case.setup(w, model)
    before = tree(w)
    result = vlmc(*argv, cwd=w)
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1, f"want one line on stderr, got: {result.stderr[-3000:]!r}"
    assert lines[0].startswith("vlmc: error: ") and "internal error" not in lines[0], lines[0]
    for fragment in case.expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert tree(w) == before, "files were written or an input changed"
    assert not (w / "out").exists()
    assert canary_leaks(w) == [] and CANARY not in result.stdout
    assert not (w / "PWNED").exists(), "the model directory's code ran"


def test_the_untouched_model_directory_exports(work):
    """The copy every case tampers with exports cleanly as it is (so each case fails for its own reason)."""
    w, model = work
    result = vlmc(*export(w, model))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (w / "out" / "source" / "tokenizer.json").is_file()


# ---- the Hugging Face cache keeps working ------------------------------------------------------------
def hub_cache(cache: Path, model: Path, repo: str = "org/tiny") -> Path:
    """``model`` laid out as huggingface_hub stores a download (https://huggingface.co/docs/huggingface_hub/
    guides/manage-cache): blobs named by content hash, refs/main naming the commit, and the snapshot's
    files as relative links ``../../blobs/<sha256>``. Returns the snapshot directory."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(REV)
    snapshot = folder / "snapshots" / REV
    snapshot.mkdir(parents=True)
    for f in sorted(model.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, folder / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_a_hub_cache_snapshot_exports_by_id_and_by_path(work):
    w, model = work
    cache = w / "hub"
    snapshot = hub_cache(cache, model)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    by_id = vlmc("export", "org/tiny", "-o", str(w / "by-id"), env={"HF_HUB_CACHE": str(cache)})
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    by_path = vlmc("export", str(snapshot), "-o", str(w / "by-path"))
    assert by_path.returncode == 0, by_path.stderr[-3000:]
    for out in (w / "by-id", w / "by-path"):
        copied = out / "source" / "tokenizer_config.json"
        assert copied.is_file() and not copied.is_symlink()
        assert copied.read_bytes() == (model / "tokenizer_config.json").read_bytes()
    assert json.loads((w / "by-id" / "vlmc.json").read_text())["model"]["source"] == "org/tiny"


def test_a_hub_snapshot_link_into_another_repo_is_refused(work):
    """The fence is the repo's cache folder: a link out of it (into another cached repo) is refused."""
    w, model = work
    cache = w / "hub"
    snapshot = hub_cache(cache, model)
    other = hub_cache(cache, model, "other/secret")
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(os.path.relpath((other / "tokenizer.json").resolve(), snapshot))
    before = tree(w)
    result = vlmc("export", "org/tiny", "-o", str(w / "out"), env={"HF_HUB_CACHE": str(cache)})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "'tokenizer.json'" in lines[0] and "models--org--tiny" in lines[0], lines
    assert tree(w) == before


# ---- a package's source/ tokenizer never prompts, never runs code ---------------------------------------
def test_a_package_source_tokenizer_with_custom_code_is_refused_without_a_prompt(tiny_llava, tmp_path):
    """An older package tokenizing with transformers from source/: a tokenizer declaring custom code is
    refused in one line (no `[y/N]` prompt, no stdin needed), and its code does not run."""
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_llava, pkg)
    manifest = json.loads((pkg / "vlmc.json").read_text())
    manifest["text"]["tokenizer"] = "source"
    manifest["text"].pop("tokenizer_file", None)
    (pkg / "vlmc.json").write_text(json.dumps(manifest, indent=2))
    (pkg / "source").mkdir(exist_ok=True)
    (pkg / "source" / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}})
    )
    (pkg / "source" / "tokenization_my.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').close()\n")
    before = tree(pkg)
    result = vlmc("run", str(pkg), "--prompt", "hi", "--max-new-tokens", "1")
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "remote code" in lines[0] and "auto_map" in lines[0], lines
    assert "[y/N]" not in result.stdout + result.stderr
    assert not (tmp_path / "PWNED").exists()
    assert tree(pkg) == before


def test_every_from_pretrained_in_vlmc_states_trust_remote_code():
    """No transformers loader in the product decides remote code by itself (its default asks on a terminal)."""
    calls = []
    for path in sorted((Path(__file__).resolve().parents[2] / "vlmc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                calls.append(
                    (path.name, node.lineno, any(k.arg == "trust_remote_code" for k in node.keywords))
                )
    assert len(calls) >= 5 and all(ok for *_, ok in calls), calls


# ---- safetensors headers: the check holds to what the library reads ------------------------------------
_DTYPES = sorted(checkpoint.DTYPE_BYTES)


@st.composite
def _shards(draw):
    """A safetensors file: a consistent one, or one with its length prefix, JSON, dtype, shape, offsets or
    data size perturbed."""
    specs = []
    at = 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = checkpoint.DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        specs.append([f"t{i}", {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}])
        at += n
    data = bytearray(draw(st.binary(min_size=at, max_size=at)))
    clean = True
    if specs and draw(st.booleans()):
        clean = False
        name, entry = draw(st.sampled_from(specs))
        what = draw(st.sampled_from(["dtype", "shape", "begin", "end", "drop", "type"]))
        if what == "dtype":
            entry["dtype"] = draw(st.one_of(st.sampled_from(_DTYPES), st.text(max_size=4)))
        elif what == "shape":
            entry["shape"] = draw(
                st.one_of(st.lists(st.integers(-2, 5), max_size=3), st.integers(), st.none())
            )
        elif what in ("begin", "end"):
            entry["data_offsets"][what == "end"] += draw(st.integers(-3, 3))
        elif what == "drop":
            entry.pop(draw(st.sampled_from(sorted(entry))))
        else:
            entry["data_offsets"] = draw(
                st.one_of(st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=3))
            )
    header = dict(specs)
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.sampled_from([{"format": "pt"}, {"a": 1}, []]))
        clean = clean and header["__metadata__"] == {"format": "pt"}
    text = json.dumps(header).encode() + b" " * draw(st.integers(0, 8))
    if draw(st.integers(0, 9)) == 0:  # a damaged header: a byte changed or cut
        clean = False
        i = draw(st.integers(0, len(text) - 1))
        text = text[:i] + draw(st.binary(min_size=0, max_size=2)) + text[i + 1 :]
    length = len(text) + (draw(st.integers(-4, 4)) if draw(st.integers(0, 5)) == 0 else 0)
    extra = draw(st.sampled_from([0, 0, 0, -1, 1]))
    data = bytes(data[: len(data) + extra] if extra < 0 else data + b"\0" * extra)
    prefix = struct.pack("<Q", max(0, length))[: draw(st.sampled_from([8, 8, 8, 8, 3]))]
    clean = clean and length == len(text) and extra == 0 and len(prefix) == 8
    return prefix + text + data, clean


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shard=_shards())
def test_the_header_check_accepts_exactly_what_safetensors_reads(shard, tmp_path):
    """Whatever read_header accepts, safetensors opens and reads tensor for tensor as described; whatever
    safetensors refuses, read_header refused first, in one line naming the file; a well-formed file is
    accepted."""
    raw, clean = shard
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw)
    try:
        described = checkpoint.read_header(path)
    except VlmcError as exc:
        assert not clean, f"a well-formed file was refused: {exc}"
        assert len(str(exc).splitlines()) == 1 and str(path) in str(exc)
        return
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(described)
        for name, (dtype, shape) in described.items():
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == shape
            assert tensor.element_size() == checkpoint.DTYPE_BYTES[dtype]


def test_every_real_shard_passes_the_header_check(source):
    """The check refuses nothing save_pretrained writes (sharded BF16 here; FP32 and others in the property)."""
    held = checkpoint.tensors(source)
    assert len({t.shard for t in held.values()}) >= 2
    assert {t.dtype for t in held.values()} == {"BF16"}
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(checkpoint.read_header(shard))
