"""Every CLI command through click's CliRunner, help texts, exit codes, and the README commands as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmc import __version__
from vlmc.cli import main

REPO = Path(__file__).resolve().parents[2]


def invoke(*args, cwd: Path | None = None):
    runner = CliRunner()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return runner.invoke(main, list(args), catch_exceptions=False)
    finally:
        os.chdir(old)


def test_every_command_has_help_with_an_example():
    for name in main.commands:
        res = invoke(name, "--help")
        assert res.exit_code == 0, name
        assert "Example:" in res.output and f"vlmc {name}" in res.output, f"{name} --help lacks an example"


def test_version_and_python_dash_m():
    assert invoke("--version").output.strip() == f"vlmc, version {__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "vlmc", "--version"], capture_output=True, text=True, check=True
    )
    assert __version__ in out.stdout


def test_export_list_shows_builtins_and_families():
    res = invoke("export", "--list")
    assert res.exit_code == 0
    assert (
        "tiny-llava" in res.output and "llava" in res.output and "LlavaForConditionalGeneration" in res.output
    )


def test_passes_lists_registered_passes_and_schema():
    res = invoke("passes")
    assert res.exit_code == 0 and "simplify" in res.output and "fold_constants" in res.output
    schema = json.loads(invoke("passes", "--schema").output)
    assert schema["title"] == "vlmc recipe"


def test_inspect_json_and_markdown(tiny_llava):
    res = invoke("inspect", str(tiny_llava), "--json")
    data = json.loads(res.output)
    assert set(data["graphs"]) == {"vision_encoder", "embed_tokens", "decoder"}
    assert data["total_weight_bytes"] == sum(g["weight_bytes"] for g in data["graphs"].values())
    # small constants repeated across graphs are stored in each graph but counted once as unique
    assert 0.99 * data["total_weight_bytes"] <= data["unique_weight_bytes"] <= data["total_weight_bytes"]
    md = invoke("inspect", str(tiny_llava)).output
    assert "## Graphs" in md and "decoder" in md


def test_run_prints_generated_tokens(tiny_llava):
    res = invoke(
        "run",
        str(tiny_llava),
        "--image",
        "demo",
        "--prompt",
        "Describe the image.",
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["tokens"]) == 1 and 1 <= len(data["tokens"][0]) <= 4


def test_optimize_writes_history_and_leaves_input_untouched(tiny_llava, tmp_path):
    before = {p.name: p.read_bytes() for p in tiny_llava.iterdir() if p.is_file()}
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes: [fold_constants, simplify]\n")
    res = invoke("optimize", str(tiny_llava), "--recipe", str(recipe), "-o", str(tmp_path / "opt"), "--check")
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "opt" / "vlmc.json").read_text())
    assert [h["pass"] for h in m["history"]] == ["fold_constants", "simplify"]
    assert {p.name: p.read_bytes() for p in tiny_llava.iterdir() if p.is_file()} == before


def test_user_errors_are_one_line_exit_2(tiny_llava, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("passes: [no_such_pass]\n")
    res = invoke("optimize", str(tiny_llava), "--recipe", str(recipe), "-o", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert (
        res.stderr.count("\n") == 1
        and res.stderr.startswith("vlmc: error: ")
        and "valid passes:" in res.stderr
    )
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()
    res = invoke("inspect", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_existing_output_needs_force(tiny_llava, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    res = invoke("export", "tiny-llava", "-o", str(out))
    assert res.exit_code == 2 and "--force" in res.stderr
    res = invoke("export", "tiny-llava", "-o", str(out), "--force")
    assert res.exit_code == 2 and "not a vlmc output" in res.stderr
    assert (out / "keep.txt").read_text() == "user data"


def test_verify_passes_and_writes_verify_json(tiny_llava, tmp_path):
    import shutil

    pkg = tmp_path / "pkg"
    shutil.copytree(tiny_llava, pkg)
    res = invoke("verify", str(pkg), "--max-new-tokens", "5")
    assert res.exit_code == 0, res.output + res.stderr
    data = json.loads((pkg / "verify.json").read_text())
    assert data["passed"] and data["token_agreement"] == 1.0
    res = invoke("verify", str(pkg), "--max-new-tokens", "3", "--max-logit-diff", "0")
    assert res.exit_code == 1 and "verify failed" in res.stderr


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("vlmc ")
    ]


def test_readme_commands_run_as_written(tmp_path):
    """The Quickstart commands, exactly as the README shows them, from a copy of the recipes."""
    import shutil

    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    cmds = _readme_commands()
    assert len(cmds) >= 6
    for cmd in cmds:
        res = invoke(*shlex.split(cmd)[1:], cwd=tmp_path)
        assert res.exit_code == 0, f"{cmd}\n{res.output}\n{res.stderr}"
    assert (tmp_path / "out" / "demo" / "package" / "vlmc.json").is_file()


@pytest.mark.parametrize("flag", ["-v", "-q"])
def test_global_flags(tiny_llava, flag):
    res = invoke(flag, "inspect", str(tiny_llava), "--json")
    assert res.exit_code == 0


@pytest.mark.parametrize(
    "args, backend, soc",
    [
        ([], "ascend", None),
        (["-r", "{recipe}"], "ascend", "Ascend910B1"),
        (["--target=ort", "-r", "{recipe}"], "ort", None),
        (["--target", "ort", "--recipe", "{recipe}"], "ort", None),
        (["--soc", "Ascend910B4"], "ascend", "Ascend910B4"),
    ],
)
def test_compile_picks_backend_from_flags_then_recipe(tiny_llava, tmp_path, args, backend, soc):
    recipe = tmp_path / "asc.yaml"
    recipe.write_text("target: {backend: ascend, soc: Ascend910B1}\n")
    out = tmp_path / "build"
    res = invoke("compile", str(tiny_llava), "-o", str(out), *[a.format(recipe=recipe) for a in args])
    assert res.exit_code == 0, res.stderr
    summary = json.loads((out / "compile.json").read_text())
    assert summary["backend"] == backend
    if soc:
        assert summary["soc_version"] == soc


def test_compile_rejects_ascend_flags_for_ort(tiny_llava, tmp_path):
    res = invoke(
        "compile", str(tiny_llava), "-o", str(tmp_path / "b"), "--target", "ort", "--soc", "Ascend910B1"
    )
    assert res.exit_code == 2 and "apply to --target ascend only" in res.stderr
    assert not (tmp_path / "b").exists()
