"""Property tests: any recipe, manifest or command line gives a valid result or a clean one-line error."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmc import manifest, pass_api, recipe
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- recipes -------------------------------------------------------------------------------------
_WORDS = (
    list(recipe.TOP_KEYS)
    + list(recipe.EXPORT_KEYS)
    + list(pass_api.registry())
    + [o.name for cls in pass_api.registry().values() for o in cls.options]
    + ["backend", "ort", "ascend", "soc"]
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(_WORDS),
)
_values = st.recursive(
    _scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(_WORDS), st.text(max_size=6)), kids, max_size=4),
    ),
    max_leaves=20,
)
_recipes = st.fixed_dictionaries(
    {},
    optional={
        "model": _scalars,
        "export": st.dictionaries(st.sampled_from(recipe.EXPORT_KEYS + ("other",)), _scalars, max_size=3),
        "passes": st.one_of(
            _values,
            st.lists(
                st.one_of(
                    st.sampled_from(list(pass_api.registry())),
                    st.dictionaries(
                        st.sampled_from(list(pass_api.registry()) + ["nope"]),
                        st.one_of(st.none(), _values),
                        max_size=2,
                    ),
                ),
                max_size=4,
            ),
        ),
        "target": _values,
    },
)


def _check_recipe(r: recipe.Recipe) -> None:
    assert r.model is None or isinstance(r.model, str)
    for i, step in enumerate(r.steps, 1):
        assert step.index == i and step.name in pass_api.registry()
        step.instantiate()  # validated options always construct the pass
    assert recipe.from_dict(r.to_dict()).to_dict() == r.to_dict()  # a validated recipe round-trips


@FAST
@given(_recipes)
def test_recipe_from_any_mapping(data):
    try:
        r = recipe.from_dict(data)
    except VlmcError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _check_recipe(r)


@FAST
@given(
    st.one_of(
        st.text(max_size=200),
        _recipes.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
        _values.map(yaml.safe_dump),
    )
)
def test_recipe_from_any_text(text):
    try:
        r = recipe.parse(text)
    except VlmcError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    _check_recipe(r)


@FAST
@given(st.binary(max_size=200))
def test_recipe_file_with_any_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("recipe") / "r.yaml"
    p.write_bytes(data)
    try:
        recipe.load(p)
    except VlmcError as exc:
        assert "\n" not in str(exc)


# ---- manifests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_manifest(tiny_llava) -> dict:
    return json.loads((tiny_llava / manifest.MANIFEST_NAME).read_text())


def _paths(node, prefix=()):
    """Every (container path, key) in a JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=False),
        st.text(max_size=8),
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def mutated_manifests(draw, base: dict):
    """A real manifest with a few values replaced or deleted anywhere in the tree."""
    m = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(m))
        shallow = [
            p for p in paths if len(p) <= 3
        ]  # sections, their fields and one level down: most checks live there
        if not paths:
            break
        path = draw(st.sampled_from(shallow if shallow and draw(st.booleans()) else paths))
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        if draw(st.booleans()):
            parent[path[-1]] = draw(_json)
        elif isinstance(parent, dict):
            del parent[path[-1]]
    return m


def test_the_unmutated_manifest_is_valid(real_manifest):
    assert manifest.validate(copy.deepcopy(real_manifest)) == real_manifest


@pytest.mark.parametrize("value", [[{}], {"a": 1}, [[1]], 3, ["decoder", None]])
def test_pipeline_entries_that_are_not_names(real_manifest, value):
    """Found by the property test below: unhashable graph names used to escape as a TypeError."""
    m = copy.deepcopy(real_manifest)
    m["pipeline"]["decoder"] = value
    if value == ["decoder", None]:
        assert manifest.validate(m)["pipeline"]["decoder"] == value
        return
    with pytest.raises(VlmcError, match="pipeline.decoder"):
        manifest.validate(m)


@FAST
@given(data=st.data())
def test_manifest_validate_any_mutation(real_manifest, data):
    m = data.draw(mutated_manifests(real_manifest))
    try:
        manifest.validate(m)
    except VlmcError as exc:
        assert "\n" not in str(exc)


@FAST
@given(st.one_of(st.text(max_size=100), _json.map(json.dumps)))
def test_manifest_loads_any_text(text):
    try:
        manifest.loads(text)
    except VlmcError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_package_load_with_any_mutated_manifest(real_manifest, tiny_llava, tmp_path_factory, data):
    """Package.load on real graph files: a damaged manifest loads (if still consistent) or fails in one line."""
    m = data.draw(mutated_manifests(real_manifest))
    d = tmp_path_factory.mktemp("pkg")
    for f in tiny_llava.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / manifest.MANIFEST_NAME).write_text(json.dumps(m))
    try:
        pkg = Package.load(d)
    except VlmcError as exc:
        assert "\n" not in str(exc)
        return
    for name, info in pkg.manifest["graphs"].items():
        assert (d / info["file"]).is_file(), name


# ---- the command line ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    (root / "r.yaml").write_text("passes: [simplify]\n")
    (root / "bad.yaml").write_text("passes: [nope]\n")
    (root / "text.png").write_text("not an image")
    (root / "plain").mkdir()
    return {
        "recipe": str(root / "r.yaml"),
        "bad_recipe": str(root / "bad.yaml"),
        "not_image": str(root / "text.png"),
        "dir": str(root / "plain"),
        "missing": str(root / "missing"),
        "out": str(root / "out" / "x"),
    }


_COMMANDS = sorted(main.commands)
_OPTIONS = [
    "-o",
    "--output",
    "-r",
    "--recipe",
    "--force",
    "--check",
    "--image",
    "--prompt",
    "--max-new-tokens",
    "--json",
    "--schema",
    "--list",
    "--allow-pickle",
    "--trust-remote-code",
    "--target",
    "--soc",
    "--device-memory",
    "--config",
    "-v",
    "-q",
    "--help",
    "--bogus",
]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cli_any_arguments(cli_files, data):
    """Random command lines never show a traceback; exit codes are 0 (ok), 1 (check failed) or 2 (bad input)."""
    values = st.one_of(
        st.sampled_from(sorted(cli_files.values())),
        st.sampled_from(["demo", "0", "-1", "99999", "x"]),
        st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=10),
    )
    argv = data.draw(
        st.lists(st.one_of(st.sampled_from(_COMMANDS), st.sampled_from(_OPTIONS), values), max_size=7)
    )
    if argv and argv[0] not in ("-v", "-q", "--help") and data.draw(st.booleans()):
        argv.insert(0, data.draw(st.sampled_from(_COMMANDS)))
    if "export" in argv or "build" in argv:
        # a real export takes seconds; the built-in names are left out, so these only reach the checks
        argv = [a for a in argv if not a.startswith("tiny-")]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code in (0, 1, 2), (argv, result.exit_code, result.output)
    assert "Traceback" not in result.output, argv
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        argv,
        repr(result.exception),
    )
    assert "internal error" not in result.stderr, (argv, result.stderr)
    assert not Path(cli_files["out"]).exists() or result.exit_code == 0, argv
