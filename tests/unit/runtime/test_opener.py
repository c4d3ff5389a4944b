"""vlmc/runtime/opener.py: a package already read runs as it is, and refuses what does not apply to it."""

from __future__ import annotations

import copy

import pytest

from vlmc import runtime
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime.pipeline import Pipeline

from .._compose_builders import package


@pytest.fixture()
def pkg(tmp_path):
    return package(tmp_path / "pkg", layers=1)


def test_a_package_already_read_is_run_as_that_object(pkg):
    runnable = runtime.open(pkg)
    try:
        assert isinstance(runnable, Pipeline)
        assert (
            runnable.pkg is pkg
        )  # not read again from its directory (verify runs packages changed in memory)
        assert runtime.target(pkg).path == pkg.root
    finally:
        runnable.close()


def test_an_executor_does_not_apply_to_a_package_object(pkg):
    with pytest.raises(VlmcError, match="--executor applies to a compile output"):
        runtime.target(pkg, executor="reference")


def test_a_tensor_parallel_package_in_memory_is_refused_in_one_line(pkg):
    manifest = copy.deepcopy(pkg.manifest)
    manifest["tensor_parallel"] = {"size": 2}
    with pytest.raises(VlmcError, match="runs as rank processes from its directory"):
        runtime.open(Package(manifest))


def test_prepare_opens_no_graph(tiny_llava):
    pkg = Package.load(tiny_llava)
    inputs = runtime.prepare(pkg, ["Describe <image>"], [["demo:0"]])
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    assert int((inputs.input_ids == image_id).sum()) == pkg.manifest["vision"]["tokens_per_image"]
    assert "pixel_values" in inputs.vision
    assert not any(pkg.is_loaded(name) for name in pkg.graph_names)
