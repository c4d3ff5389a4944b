"""Untrusted build directories, compile.json, bounded parsers and the output writer (issue 29).

Every build case copies a real compile output (a paged tiny-llava build, or a tensor-parallel one),
breaks one thing, and runs ``vlmc run BUILD_DIR`` through the real CLI in a child process with a time
bound: it must exit 2 with exactly one ``vlmc: error:`` line naming the problem, no traceback, within
the bound (a FIFO or /dev/zero must not hang or exhaust memory), change nothing under the work
directory, and never show the contents of a file outside the build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmc import compile_schema, manager, outdir, recipe
from vlmc.backends import ascend
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime.executors import build as runner

from .test_untrusted import tree

REPO = Path(__file__).resolve().parents[2]
VLMC = [sys.executable, "-m", "vlmc"]
TARGET = {"soc": "Ascend910B2", "sequence_buckets": [64]}
OUTSIDE = "OUTSIDE-3b1f-not-part-of-the-build"
BOUND_S = 60  # seconds a refusal may take on a loaded 2-core machine (each is ~1 s alone)


# ---- fixtures: one paged build and one tensor-parallel build, copied per case -------------------------
@pytest.fixture(scope="module")
def builds(tiny_llava, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("untrusted-builds")
    paged = root / "paged-pkg"
    manager.run(
        Package.load(tiny_llava), recipe.from_dict({"passes": [{"paged_kv": {"block_size": 16}}]}).steps
    ).save(paged)
    ascend.compile(Package.load(paged), root / "paged", dict(TARGET))
    tp = root / "tp-pkg"
    manager.run(
        Package.load(tiny_llava), recipe.from_dict({"passes": [{"tensor_parallel": {"size": 2}}]}).steps
    ).save(tp)
    ascend.compile(Package.load(tp), root / "tp", dict(TARGET))
    return {"paged": root / "paged", "tp": root / "tp"}


def cli(*args: str, timeout: float = BOUND_S, env: dict | None = None) -> tuple[int, str, str, float]:
    start = time.monotonic()
    proc = subprocess.run([*VLMC, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def assert_one_line(rc: int, err: str, expect: tuple[str, ...], took: float, code: int = 2) -> str:
    lines = err.splitlines()
    assert rc == code, (rc, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("vlmc: error: "), err[-2000:]
    assert "Traceback" not in err
    for fragment in expect:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert took < BOUND_S
    return lines[0]


# ---- edits -------------------------------------------------------------------------------------------
def summary_of(build: Path) -> dict:
    return json.loads((build / "compile.json").read_text())


def edit(fn: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    """A case that rewrites compile.json."""

    def setup(work: Path, build: Path) -> None:
        s = summary_of(build)
        fn(s)
        (build / "compile.json").write_text(json.dumps(s))

    return setup


def edit_runtime(fn: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        m = json.loads((build / "runtime" / "vlmc.json").read_text())
        fn(m)
        (build / "runtime" / "vlmc.json").write_text(json.dumps(m))

    return setup


def raw(text: str, name: str = "compile.json") -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        (build / name).write_text(text)

    return setup


def build_named(s: dict, name: str) -> dict:
    return next(b for b in s["builds"] if b["name"] == name)


def symlink_out(rel: str) -> Callable[[Path, Path], None]:
    """``rel`` becomes a symlink to a copy of itself outside the build (a valid file, marked)."""

    def setup(work: Path, build: Path) -> None:
        src = build / rel
        outside = work / "outside" / rel
        outside.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.move(src, outside)
        elif rel.endswith(".json"):  # a valid file, marked: its contents must never be shown
            outside.write_text(json.dumps({**json.loads(src.read_text()), "x_outside": OUTSIDE}))
            src.unlink()
        else:
            shutil.move(src, outside)
        src.symlink_to(outside)

    return setup


def fifo(rel: str) -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        (build / rel).unlink()
        os.mkfifo(build / rel)

    return setup


def dev_zero(rel: str) -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        (build / rel).unlink()
        (build / rel).symlink_to("/dev/zero")

    return setup


def directory(rel: str) -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        (build / rel).unlink()
        (build / rel).mkdir()

    return setup


def sparse(rel: str, size: int) -> Callable[[Path, Path], None]:
    def setup(work: Path, build: Path) -> None:
        with open(build / rel, "r+b") as f:
            f.truncate(size)

    return setup


def nested(depth: int) -> str:
    return '{"builds": ' + "[" * depth + "]" * depth + "}"


def _tp_segment(s: dict, index: int = 0) -> dict:
    return [p for p in s["tensor_parallel"]["plan"] if p["step"] == "segment"][index]


def _tp_reduce(s: dict) -> dict:
    return next(p for p in s["tensor_parallel"]["plan"] if p["step"] == "all_reduce")


def _huge_gear(s: dict) -> None:
    """A gear inside the schema's per-dim bound whose feeds need far more memory than any machine has."""
    b = build_named(s, "embed_tokens")
    b["inputs"][0]["shape"] = [-1, -1]
    b["gear_symbols"] = ["batch", "sequence"]
    b["gears"] = [[1, 1], [(1 << 31) - 1, (1 << 31) - 1]]


def _huge_pool(work: Path, build: Path) -> None:
    """A paged pool of 16 M blocks, in the runtime manifest and every build's pool inputs alike."""
    m = json.loads((build / "runtime" / "vlmc.json").read_text())
    m["kv"]["num_blocks"] = 1 << 24
    (build / "runtime" / "vlmc.json").write_text(json.dumps(m))
    s = summary_of(build)
    for b in s["builds"]:
        for i in b["inputs"]:
            if i["name"].startswith(("key_cache.", "value_cache.")):
                i["shape"][0] = 1 << 24
    (build / "compile.json").write_text(json.dumps(s))


def _external_data_out(work: Path, build: Path) -> None:
    import onnx

    path = build / "graphs" / "embed_tokens.onnx"
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    for e in tensor.external_data:
        if e.key == "location":
            e.value = "../../outside.data"
    (work / "outside.data").write_bytes(b"\0" * (1 << 20))
    path.write_bytes(model.SerializeToString())


@dataclass
class Case:
    id: str
    build: str  # "paged" or "tp"
    setup: Callable[[Path, Path], None]
    expect: tuple[str, ...]


CASES = [
    # compile.json's shape (the schema)
    Case("not-an-object", "paged", raw("[1, 2]"), ("compile.json", "must be an object")),
    Case("not-json", "paged", raw("{builds: ["), ("compile.json: not valid JSON",)),
    Case("builds-not-a-list", "paged", edit(lambda s: s.update(builds={"a": 1})), ("builds must be a list",)),
    Case("builds-empty", "paged", edit(lambda s: s.update(builds=[])), ("builds must have 1 to",)),
    Case(
        "build-a-string",
        "paged",
        edit(lambda s: s["builds"].__setitem__(0, "decoder")),
        ("builds[0] must be an object",),
    ),
    Case(
        "build-without-name",
        "paged",
        edit(lambda s: s["builds"][0].pop("name")),
        ("builds[0].name is missing",),
    ),
    Case(
        "build-name-int",
        "paged",
        edit(lambda s: s["builds"][0].update(name=7)),
        ("builds[0].name must be a string",),
    ),
    Case(
        "inputs-a-dict",
        "paged",
        edit(lambda s: s["builds"][0].update(inputs={"x": 1})),
        ("builds[0].inputs must be a list",),
    ),
    Case(
        "input-without-dtype",
        "paged",
        edit(lambda s: s["builds"][0]["inputs"][0].pop("dtype")),
        ("builds[0].inputs[0].dtype is missing",),
    ),
    Case(
        "input-dtype-unknown",
        "paged",
        edit(lambda s: s["builds"][0]["inputs"][0].update(dtype="bfloat16")),
        ("builds[0].inputs[0].dtype='bfloat16' is not one of",),
    ),
    Case(
        "shape-entry-a-string",
        "paged",
        edit(lambda s: s["builds"][0]["inputs"][0]["shape"].__setitem__(0, "1")),
        ("builds[0].inputs[0].shape[0] must be an integer",),
    ),
    Case(
        "dims-shorter-than-shape",
        "paged",
        edit(lambda s: s["builds"][0]["inputs"][0]["dims"].pop()),
        ("shape entries and", "dims"),
    ),
    Case(
        "gears-not-nested",
        "paged",
        edit(lambda s: build_named(s, "embed_tokens").update(gears=[1, 64])),
        ("gears[0] must be a list",),
    ),
    Case(
        "gear-wrong-arity",
        "paged",
        edit(lambda s: build_named(s, "embed_tokens").update(gears=[[1, 2]])),
        ("gears[0] has 2 values for 1 -1 entries",),
    ),
    Case(
        "gear-1e12",
        "paged",
        edit(lambda s: build_named(s, "embed_tokens").update(gears=[[10**12]])),
        ("gears[0][0]=1000000000000 is above the maximum",),
    ),
    Case("gear-needs-more-memory-than-here", "paged", edit(_huge_gear), ("embed_tokens", "GiB", "available")),
    Case("pool-of-16M-blocks", "paged", _huge_pool, ("paged pools", "GiB", "available")),
    Case(
        "gear-symbols-missing",
        "paged",
        edit(lambda s: s["builds"][0].pop("gear_symbols")),
        ("builds[0].gear_symbols is missing",),
    ),
    Case(
        "bindings-a-list",
        "paged",
        edit(lambda s: s["builds"][0].update(bindings=[1])),
        ("bindings must be an object",),
    ),
    Case(
        "duplicate-build-name",
        "paged",
        edit(lambda s: s["builds"][1].update(name=s["builds"][0]["name"])),
        ("the name is used by another build",),
    ),
    Case(
        "unknown-graph",
        "paged",
        edit(lambda s: s["builds"][0].update(graph="no_such_graph")),
        ("graph 'no_such_graph' is not a graph of the runtime package",),
    ),
    Case(
        "file-absolute",
        "paged",
        edit(lambda s: s["builds"][0].update(file="/etc/passwd")),
        ("builds[0].file",),
    ),
    Case(
        "file-climbs-out",
        "paged",
        edit(lambda s: s["builds"][0].update(file="../x.onnx")),
        ("builds[0].file",),
    ),
    Case(
        "file-missing",
        "paged",
        edit(lambda s: s["builds"][0].update(file="graphs/nope.onnx")),
        ("is missing",),
    ),
    Case(
        "file-a-directory",
        "paged",
        edit(lambda s: s["builds"][0].update(file="graphs")),
        ("is not a regular file",),
    ),
    Case(
        "runtime-package-climbs-out",
        "paged",
        edit(lambda s: s["runner"].update(runtime_package="../elsewhere")),
        ("runner.runtime_package",),
    ),
    Case("runner-missing", "paged", edit(lambda s: s.pop("runner")), ("older vlmc", "re-run `vlmc compile`")),
    # bounded parsing
    Case("nested-100000-deep", "paged", raw(nested(100_000)), ("not valid JSON", "nested too deeply")),
    Case(
        "5000-digit-integer",
        "paged",
        raw('{"builds": ' + "9" * 5000 + "}"),
        ("not valid JSON", "5000 digits"),
    ),
    Case("nan", "paged", raw('{"builds": NaN}'), ("not valid JSON", "NaN")),
    Case("compile-json-too-large", "paged", sparse("compile.json", 200 << 20), ("larger than the", "limit")),
    # files of the build: regular, inside, bounded
    Case("compile-json-symlink-out", "paged", symlink_out("compile.json"), ("compile.json", "outside")),
    Case("compile-json-fifo", "paged", fifo("compile.json"), ("compile.json", "not a regular file")),
    Case("compile-json-dev-zero", "paged", dev_zero("compile.json"), ("compile.json", "outside")),
    Case(
        "compile-json-a-directory", "paged", directory("compile.json"), ("compile.json", "not a regular file")
    ),
    Case("marker-symlink-out", "paged", symlink_out("vlmc-build.json"), ("vlmc-build.json", "outside")),
    Case("marker-fifo", "paged", fifo("vlmc-build.json"), ("vlmc-build.json", "not a regular file")),
    Case("runtime-manifest-symlink-out", "paged", symlink_out("runtime/vlmc.json"), ("runtime", "outside")),
    Case("runtime-manifest-fifo", "paged", fifo("runtime/vlmc.json"), ("vlmc.json", "not a regular file")),
    Case("runtime-manifest-dev-zero", "paged", dev_zero("runtime/vlmc.json"), ("vlmc.json", "outside")),
    Case("runtime-dir-symlink-out", "paged", symlink_out("runtime"), ("runtime", "outside")),
    Case(
        "graph-symlink-out",
        "paged",
        symlink_out("graphs/embed_tokens.onnx"),
        ("embed_tokens.onnx", "outside"),
    ),
    Case(
        "graph-fifo", "paged", fifo("graphs/embed_tokens.onnx"), ("embed_tokens.onnx", "not a regular file")
    ),
    Case("graph-external-data-out", "paged", _external_data_out, ("external data", "outside")),
    # the tensor-parallel host plan and the runtime manifest's split
    Case("tp-size-3", "tp", edit(lambda s: s["tensor_parallel"].update(size=3)), ("tensor_parallel",)),
    Case(
        "tp-size-a-string",
        "tp",
        edit(lambda s: s["tensor_parallel"].update(size="2")),
        ("tensor_parallel.size must be an integer",),
    ),
    Case(
        "tp-plan-a-dict",
        "tp",
        edit(lambda s: s["tensor_parallel"].update(plan={})),
        ("tensor_parallel.plan must be a list",),
    ),
    Case(
        "tp-plan-step-a-string",
        "tp",
        edit(lambda s: s["tensor_parallel"]["plan"].__setitem__(0, "segment")),
        ("tensor_parallel.plan[0]",),
    ),
    Case(
        "tp-plan-unknown-graph",
        "tp",
        edit(lambda s: _tp_segment(s)["graphs"].__setitem__(0, "no_such_graph")),
        ("tensor_parallel.plan[0]", "no_such_graph"),
    ),
    Case(
        "tp-plan-missing-build",
        "tp",
        edit(lambda s: _tp_segment(s, 1)["builds"][0].update(full="no_such_build")),
        ("no_such_build", "is not a build of"),
    ),
    Case(
        "tp-plan-other-ranks-build",
        "tp",
        edit(lambda s: _tp_segment(s, 1)["builds"].reverse()),
        ("is not a build of",),
    ),
    Case(
        "tp-reduce-missing-tensor",
        "tp",
        edit(lambda s: _tp_reduce(s).update(input="no_such_tensor")),
        ("no_such_tensor", "is not an output of the segment before it"),
    ),
    Case(
        "tp-reduce-output-unused",
        "tp",
        edit(lambda s: _tp_reduce(s).update(output="no_such_tensor")),
        ("no_such_tensor", "is not an input of the segment after it"),
    ),
    Case(
        "tp-ranks-wrong-build",
        "tp",
        edit(lambda s: s["tensor_parallel"]["ranks"]["0"].append("decoder.rank1.1")),
        ("tensor_parallel.ranks.0", "decoder.rank1.1"),
    ),
    Case(
        "tp-build-rank-out-of-range",
        "tp",
        edit(lambda s: next(b for b in s["builds"] if "rank" in b).update(rank=5)),
        ("rank 5", "2 ranks"),
    ),
    Case(
        "tp-manifest-size-1",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"].update(size=1)),
        ("tensor_parallel.size=1 is below the minimum 2",),
    ),
    Case(
        "tp-manifest-size-1.5",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"].update(size=1.5)),
        ("tensor_parallel.size must be an integer",),
    ),
    Case(
        "tp-manifest-size-true",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"].update(size=True)),
        ("tensor_parallel.size must be an integer",),
    ),
    Case(
        "tp-manifest-size-3",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"].update(size=3)),
        ("tensor_parallel.size 3 does not divide the 4 attention heads",),
    ),
    Case(
        "tp-manifest-size-64",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"].update(size=64)),
        ("tensor_parallel.size 64 does not divide the 4 attention heads",),
    ),
    Case(
        "tp-manifest-plan-unknown-graph",
        "tp",
        edit_runtime(lambda m: m["tensor_parallel"]["plan"][0]["graphs"].__setitem__(1, "no_such_graph")),
        ("tensor_parallel.plan[0].graphs[1]", "no_such_graph"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tampered_build_fails_in_one_line(builds, tmp_path, case):
    work = tmp_path / "work"
    build = work / "build"
    shutil.copytree(builds[case.build], build, symlinks=True)
    case.setup(work, build)
    before = tree(work)
    rc, out, err, took = cli(
        "run", str(build), "--executor", "reference", "--prompt", "hi", "--max-new-tokens", "1"
    )
    assert_one_line(rc, err, case.expect, took)
    assert tree(work) == before, "a refused run changed files"
    assert OUTSIDE not in out + err


def test_the_untampered_builds_run(builds):
    """The fixtures themselves pass every check (so each case above fails for its one edit)."""
    for name in ("paged", "tp"):
        summary, pkg = runner.read_build(builds[name])
        assert compile_schema.check_memory(summary, pkg.manifest, "x") > 0
    rc, out, err, _ = cli(
        "run", str(builds["paged"]), "--executor", "reference", "--prompt", "hi", "--max-new-tokens", "2"
    )
    assert rc == 0, err


@pytest.mark.parametrize("kind", ["symlink-out", "fifo", "dev-zero", "huge", "not-a-table"])
def test_rank_table_is_a_bounded_regular_file_inside(builds, tmp_path, kind):
    """The rank table is read only for acl runs (no NPU here), so through rank_devices: one line, quickly."""
    build = tmp_path / "build"
    shutil.copytree(builds["tp"], build, symlinks=True)
    table = build / "rank_table.json"
    if kind == "symlink-out":
        shutil.copy(table, tmp_path / "table.json")
        table.unlink()
        table.symlink_to(tmp_path / "table.json")
    elif kind == "fifo":
        table.unlink()
        os.mkfifo(table)
    elif kind == "dev-zero":
        table.unlink()
        os.symlink("/dev/zero", table)
    elif kind == "huge":
        with open(table, "r+b") as f:
            f.truncate(200 << 20)
    else:
        table.write_text('{"server_list": [{"device": [{"rank_id": "' + "9" * 5000 + '"}]}]}')
    start = time.monotonic()
    with pytest.raises(VlmcError) as info:
        runner.rank_devices(build, 2)
    assert time.monotonic() - start < 10
    assert "rank" in str(info.value) and "\n" not in str(info.value)


# ---- compile.json fuzz -------------------------------------------------------------------------------
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@pytest.fixture(scope="module")
def fuzz_build(builds, tmp_path_factory) -> tuple[Path, dict, list]:
    root = tmp_path_factory.mktemp("fuzz") / "build"
    shutil.copytree(builds["tp"], root, symlinks=True)
    summary = summary_of(root)
    # Skip the bulky free-text facts (lowering reports, ATC commands): the runner reads the rest.
    where = [p for p in _paths(summary) if p[:1] not in (("graphs",), ("warnings",)) and "argv" not in p]
    return root, summary, where


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_compile_json_is_refused_in_one_line_or_runs(fuzz_build, data):
    """Any edit of compile.json (a value replaced, a key dropped): read_build and open_build accept it or
    raise one VlmcError line, never another exception."""
    import copy

    root, summary, where = fuzz_build
    s = copy.deepcopy(summary)
    path = data.draw(st.sampled_from(where[1:]))
    parent = s
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_JSON)
    (root / "compile.json").write_text(json.dumps(s))
    try:
        for rank in (None, 0):
            if rank is None:
                runner.read_build(root)
            else:
                runner.open_build(root, "reference", rank=rank)[1].close()
    except VlmcError as exc:
        assert "\n" not in str(exc)
    finally:
        (root / "compile.json").write_text(json.dumps(summary))


def test_compile_schema_doc_is_current():
    doc = REPO / "docs" / "compile.schema.json"
    assert json.loads(doc.read_text()) == json.loads(json.dumps(compile_schema.json_schema())), (
        "docs/compile.schema.json is stale: run `make schema`"
    )


# ---- bounded parsers through the CLI: recipes ------------------------------------------------------
def _bomb(levels: int = 9) -> str:
    lines = [
        "passes:",
        "  - fold_constants",
        "target:",
        "  backend: ort",
        "x0: &x0 [1, 2, 3, 4, 5, 6, 7, 8, 9]",
    ]
    for i in range(1, levels):
        lines.append(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _options_bomb(levels: int = 9) -> str:
    lines = ["passes:", "  - quantize:", "      x0: &x0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    for i in range(1, levels):
        lines.append(f"      x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


RECIPES = [
    ("alias-bomb", _bomb(), ("YAML refused", "alias bomb")),
    ("alias-bomb-in-options", _options_bomb(), ("YAML refused", "alias bomb")),
    ("recursive-alias", "passes: &p [*p]\n", ("YAML refused", "recursive alias")),
    ("nested-deep", "passes: " + "[" * 5000 + "]" * 5000 + "\n", ("YAML refused", "nested deeper than")),
    (
        "5000-digit-int",
        "passes:\n  - paged_kv: {block_size: " + "1" * 5000 + "}\n",
        ("YAML refused", "integer"),
    ),
    (
        "binary-int",
        "passes:\n  - paged_kv: {block_size: 0b" + "1" * 5000 + "}\n",
        ("YAML refused", "integer"),
    ),
    (
        "100k-pass-name",
        "passes:\n  - " + "p" * 100_000 + "\n",
        ("unknown pass", "characters cut", "valid passes"),
    ),
    ("100k-key", "? " + "p" * 100_000 + "\n: 1\n", ("unknown key", "characters cut", "valid keys")),
]


@pytest.mark.parametrize("name,text,expect", RECIPES, ids=[r[0] for r in RECIPES])
def test_hostile_recipe_fails_in_one_short_line(tiny_llava, tmp_path, name, text, expect):
    r = tmp_path / "recipe.yaml"
    r.write_text(text)
    rc, _, err, took = cli("optimize", str(tiny_llava), "--recipe", str(r), "-o", str(tmp_path / "out"))
    line = assert_one_line(rc, err, expect, took)
    assert len(line) < 1200
    assert took < 30, f"{name}: {took:.1f} s"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_recipe_file_is_a_bounded_regular_file(tiny_llava, tmp_path, kind):
    r = tmp_path / "recipe.yaml"
    if kind == "fifo":
        os.mkfifo(r)
        expect = ("not a regular file",)
    elif kind == "dev-zero":
        r.symlink_to("/dev/zero")
        expect = ("not a regular file",)
    else:
        r.write_text("passes: []\n")
        with open(r, "r+b") as f:
            f.truncate(100 << 20)
        expect = ("bytes, above the", "VLMC_MAX_RECIPE_BYTES")
    rc, _, err, took = cli("optimize", str(tiny_llava), "--recipe", str(r), "-o", str(tmp_path / "out"))
    assert_one_line(rc, err, expect, took)


# ---- the output writer: a concurrent writer loses cleanly --------------------------------------------
def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("appeared", ["empty-directory", "directory-with-files", "file", "symlink"])
def test_writer_never_replaces_what_appeared_at_the_target(tmp_path, appeared):
    """Deterministic: the target appears inside the body, i.e. after the check and before the swap."""
    out = tmp_path / "X"
    with pytest.raises(VlmcError, match="appeared while vlmc was writing it"):
        with outdir.atomic(out) as tmp:
            (tmp / "vlmc.json").write_text("{}")
            if appeared == "file":
                out.write_text("theirs")
            elif appeared == "symlink":
                out.symlink_to(tmp_path)
            else:
                out.mkdir()
                if appeared == "directory-with-files":
                    (out / "theirs.txt").write_text("theirs")
    if appeared == "file":
        assert out.read_text() == "theirs"
    elif appeared == "symlink":
        assert out.is_symlink()
    else:
        assert [p.name for p in out.iterdir()] == (
            ["theirs.txt"] if appeared == "directory-with-files" else []
        )
    assert _leftovers(tmp_path, "X") == []


@pytest.mark.parametrize("force", [False, True])
def test_two_concurrent_writers_one_wins_one_loses(tmp_path, force):
    out = tmp_path / "X"
    if force:  # both replace an earlier vlmc output
        out.mkdir()
        (out / "vlmc.json").write_text('{"writer": "earlier"}')
    with pytest.raises(VlmcError, match="while vlmc was writing it"):
        with outdir.atomic(out, force=force) as first:
            (first / "vlmc.json").write_text('{"writer": "first"}')
            with outdir.atomic(out, force=force) as second:
                (second / "vlmc.json").write_text('{"writer": "second"}')
    assert json.loads((out / "vlmc.json").read_text()) == {"writer": "second"}
    assert _leftovers(tmp_path, "X") == []


def test_force_never_replaces_a_directory_swapped_in_meanwhile(tmp_path):
    out = tmp_path / "X"
    out.mkdir()
    (out / "vlmc.json").write_text('{"writer": "earlier"}')
    with pytest.raises(VlmcError, match="changed while vlmc was writing it"):
        with outdir.atomic(out, force=True) as tmp:
            (tmp / "vlmc.json").write_text('{"writer": "us"}')
            theirs = tmp_path / "theirs"  # another writer replaces X the way writers do: a rename
            theirs.mkdir()
            (theirs / "vlmc.json").write_text('{"writer": "someone else"}')
            shutil.rmtree(out)
            os.rename(theirs, out)
    assert json.loads((out / "vlmc.json").read_text()) == {"writer": "someone else"}
    assert _leftovers(tmp_path, "X") == []


def test_directory_created_during_export_is_kept_and_the_export_exits_2(tmp_path):
    """Through the CLI: stop `vlmc export` while its temporary output exists (the phase, not a sleep),
    create the target, let it go on: it must exit 2 in one line, keep the directory and remove its temp."""
    out = tmp_path / "X"
    proc = subprocess.Popen(
        [*VLMC, "-q", "export", "tiny-llava", "-o", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _leftovers(tmp_path, "X") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGSTOP)
        if not _leftovers(tmp_path, "X") or out.exists():
            os.kill(proc.pid, signal.SIGCONT)
            pytest.fail("the export finished before its temporary directory was seen; cannot stage the race")
        out.mkdir()
        (out / "theirs.txt").write_text("keep me")
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=BOUND_S * 3)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    lines = err.splitlines()
    assert proc.returncode == 2, err[-2000:]
    assert len(lines) == 1 and "appeared while vlmc was writing it" in lines[0], err[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert _leftovers(tmp_path, "X") == []


def test_two_concurrent_exports_one_exits_0_and_the_other_2(tmp_path):
    """Whichever order the two land in, exactly one writes X; the other refuses in one line (at the
    check if X already exists, at the swap if it appeared meanwhile) and leaves no temporary behind."""
    out = tmp_path / "X"
    argv = [*VLMC, "-q", "export", "tiny-llava", "-o", str(out)]
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=BOUND_S * 5), p.communicate()[1]) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = next(e for rc, e in results if rc == 2).splitlines()
    assert len(err) == 1 and ("appeared while vlmc was writing it" in err[0] or "already exists" in err[0]), (
        err
    )
    assert Package.load(out).manifest["model"]["family"] == "llava"
    assert _leftovers(tmp_path, "X") == []


@pytest.mark.parametrize("key", ["\n", "a\rb", "x\u2028y", "\x85"])
def test_a_line_break_in_a_tampered_key_stays_escaped_in_the_one_line_error(fuzz_build, key):
    """The key path of a schema error holds compile.json's own keys (the fuzz above found a newline key)."""
    root, summary, _ = fuzz_build
    s = json.loads(json.dumps(summary))
    s["builds"][0]["precision_mode_v2"] = {key: 2**63 + 1}
    (root / "compile.json").write_text(json.dumps(s))
    try:
        with pytest.raises(VlmcError) as exc:
            runner.read_build(root)
        assert len(str(exc.value).splitlines()) == 1
        assert repr(key)[1:-1] in str(exc.value)
    finally:
        (root / "compile.json").write_text(json.dumps(summary))
