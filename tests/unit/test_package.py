"""vlmc/package.py's change tracking: state tokens, path_of, and one fingerprint per graph inside unedited()."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import interop
from vlmc.errors import VlmcError

from ._compose_builders import package


@pytest.fixture()
def pkg(tmp_path):
    return package(tmp_path / "pkg", layers=1)


def _count_fingerprints(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = interop.fingerprint

    def counted(model):
        calls.append(1)
        return real(model)

    monkeypatch.setattr(interop, "fingerprint", counted)
    return calls


def _scale_first_weight(model: ir.Model) -> None:
    weight = next(iter(model.graph.initializers.values()))
    weight.const_value = ir.tensor(weight.const_value.numpy() * np.float32(2), name=weight.name)


def test_unread_and_unchanged_graphs_are_their_files_and_an_edit_is_seen(pkg):
    files = {name: pkg.path_of(name) for name in pkg.graph_names}
    assert pkg.state() == {name: f"file:{path}" for name, path in files.items()}
    _scale_first_weight(pkg.model("embed_tokens"))  # read, then edited in place
    assert pkg.path_of("embed_tokens") is None
    state = pkg.state()
    assert state["embed_tokens"] == pkg.fingerprint("embed_tokens") != f"file:{files['embed_tokens']}"
    assert state["decoder"] == f"file:{files['decoder']}"


def test_inside_unedited_each_graph_is_hashed_once_and_after_it_again(pkg, monkeypatch):
    model = pkg.model("embed_tokens")
    _scale_first_weight(model)
    calls = _count_fingerprints(monkeypatch)
    with pkg.unedited():
        first = pkg.state()
        assert pkg.path_of("embed_tokens") is None
        assert pkg.fingerprint("embed_tokens") == first["embed_tokens"]
        assert pkg.state() == first
    assert len(calls) == 1  # only embed_tokens is loaded
    _scale_first_weight(model)  # outside the block the next question hashes again and sees the edit
    assert pkg.state()["embed_tokens"] != first["embed_tokens"]
    assert len(calls) == 2


def test_fingerprint_of_a_graph_not_loaded_is_an_error(pkg):
    with pytest.raises(VlmcError, match="'decoder' is not loaded"):
        pkg.fingerprint("decoder")
