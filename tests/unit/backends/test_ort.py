"""The ort backend: the compiled package runs here with the reference runtime."""

from __future__ import annotations

import json

import pytest

from vlmc import backends
from vlmc.backends import ort as ort_backend
from vlmc.errors import VlmcError
from vlmc.package import Package


def test_ort_compile_writes_a_runnable_package(tiny_llava, tmp_path):
    from vlmc.runtime import Pipeline

    pkg = Package.load(tiny_llava)
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort"})
    assert pkg.root == tiny_llava  # the caller's package still points at its own directory
    assert json.loads((out / "compile.json").read_text()) == summary
    assert (out / "vlmc-build.json").is_file() and set(summary["graphs"]) == set(pkg.graph_names)
    compiled = Package.load(out / "package")
    expected = Pipeline(pkg).generate(["Describe the image."], [["demo"]], max_new_tokens=4).tokens
    got = Pipeline(compiled).generate(["Describe the image."], [["demo"]], max_new_tokens=4).tokens
    assert got == expected and len(got[0]) > 0


def test_ort_target_has_no_options():
    # Targets are validated (recipe load, `vlmc compile`) before any backend's compile sees them.
    assert ort_backend.TARGET_OPTIONS == ()
    with pytest.raises(VlmcError, match=r"unknown option 'soc'; valid options: \(none\)"):
        backends.validate_target({"backend": "ort", "soc": "Ascend910B3"})
    assert backends.validate_target({"backend": "ort"}) == {"backend": "ort"}
