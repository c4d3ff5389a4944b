"""Recipe validation happens before any work, with errors that name the key and list valid names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmc import recipe
from vlmc.errors import VlmcError

REPO = Path(__file__).resolve().parents[2]


def test_valid_recipe_fills_defaults():
    r = recipe.parse("model: tiny-llava\npasses:\n  - simplify\n  - fold_constants: {size_threshold_mb: 8}\n")
    assert r.model == "tiny-llava"
    assert [(s.name, s.index) for s in r.steps] == [("simplify", 1), ("fold_constants", 2)]
    assert r.steps[1].options == {"graphs": None, "size_threshold_mb": 8.0, "weight_limit_mb": 1.0}


@pytest.mark.parametrize(
    "text, message",
    [
        ("modle: x", "unknown key 'modle'; valid keys: model, export, passes, target"),
        ("passes: [simplfy]", "pass #1: unknown pass 'simplfy'; valid passes: "),
        (
            "passes: [{simplify: {fast: true}}]",
            "unknown option 'fast'; valid options: graphs, skip_fuse_bn, weight_limit_mb",
        ),
        ("passes: [{simplify: {skip_fuse_bn: 3}}]", "skip_fuse_bn must be true or false, got integer 3"),
        (
            "passes: [{fold_constants: {size_threshold_mb: -1}}]",
            "size_threshold_mb=-1.0 is below the minimum 0",
        ),
        ("passes: [{simplify: {graphs: [1]}}]", "graphs[0] must be a string, got integer 1"),
        ("passes: simplify", "passes must be a list"),
        ("passes: [{simplify: {}, fold_constants: {}}]", "each pass is a name or a one-key mapping"),
        ("model: [1]", "model must be a string"),
        ("export: {trust_remote_code: yes please}", "export.trust_remote_code must be true or false"),
        ("target: {backend: tpu}", "backend must be one of"),
        ("passes: [simplify\n  - x: [", "YAML error at line"),
        ("- just\n- a list", "a recipe must be a mapping"),
    ],
)
def test_recipe_errors(text, message):
    with pytest.raises(VlmcError) as err:
        recipe.parse(text, source="r.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("r.yaml")
    assert "\n" not in str(err.value)


def test_yaml_is_loaded_safely():
    with pytest.raises(VlmcError):
        recipe.parse("model: !!python/object/apply:os.system ['echo pwned']")


def test_schema_file_is_current():
    """docs/recipe.schema.json must be regenerated (make schema) when passes change."""
    on_disk = json.loads((REPO / "docs" / "recipe.schema.json").read_text())
    assert on_disk == json.loads(json.dumps(recipe.json_schema())), "run `make schema`"


def test_schema_validates_shipped_recipes():
    import jsonschema
    import yaml

    schema = recipe.json_schema()
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        jsonschema.validate(data, schema)
        recipe.load(path)  # and our own validator agrees


def test_schema_rejects_unknown_option():
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"passes": [{"simplify": {"fast": True}}]}, recipe.json_schema())
