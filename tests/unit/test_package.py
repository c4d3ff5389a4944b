"""vlmc/package.py's change tracking: state tokens, path_of, and one fingerprint per graph inside unedited()."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import graphs, interop
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


def test_a_memo_carries_hashes_between_blocks_and_set_graph_drops_the_replaced_ones(pkg, monkeypatch):
    pkg.model("embed_tokens")
    pkg.model("decoder")
    calls = _count_fingerprints(monkeypatch)
    memo: dict[str, str] = {}
    with pkg.unedited(memo):
        after = pkg.state()
    with pkg.unedited(memo):  # nothing edited in between (the manager's after-pass / before-next-pass)
        assert pkg.state() == after
    assert len(calls) == 2  # the two loaded graphs, once each
    replaced = pkg.model("embed_tokens").clone()
    _scale_first_weight(replaced)
    with pkg.unedited(memo):
        pkg.set_graph("embed_tokens", replaced)  # the memo's hash was the old graph's: dropped
        now = pkg.state()
    assert now["embed_tokens"] == interop.fingerprint(replaced) != after["embed_tokens"]
    assert now["decoder"] == after["decoder"]


def test_source_is_the_file_while_unchanged_and_the_ir_once_edited(pkg):
    path, info = pkg.source("decoder")
    assert path == pkg.path_of("decoder") and info == pkg.info("decoder")
    model = pkg.model("decoder")
    assert pkg.source("decoder")[0] == path  # read but unchanged: still its file
    _scale_first_weight(model)
    assert pkg.source("decoder")[0] is model


def test_saving_reads_no_graph_file_to_know_which_files_own_their_data(pkg, tmp_path, monkeypatch):
    opened: list[str] = []

    def counting(module, name):
        real = getattr(module, name)

        def counted(path):
            opened.append(str(path))
            return real(path)

        monkeypatch.setattr(module, name, counted)

    counting(interop, "open_checked")  # how the package reads a graph file
    counting(graphs, "load_ir")  # and any other way to read one as IR

    def read_from(root) -> list[str]:  # report.md's summary reads the files just written: not these
        return [p for p in opened if p.startswith(f"{root}/")]

    source = str(pkg.root)
    saved = pkg.save(tmp_path / "copy", adopt=False)  # every graph unchanged: copied with its data file
    assert read_from(source) == []
    opened.clear()
    again = type(pkg).load(saved)  # the copy opens (and checks) every graph once
    assert sorted(opened) == sorted(str(saved / again.info(n)["file"]) for n in again.graph_names)
    opened.clear()
    again.save(tmp_path / "copy2")
    assert read_from(saved) == []
    for name in again.graph_names:  # and what was copied is the package's content
        assert (tmp_path / "copy2" / again.info(name)["file"]).read_bytes() == (
            saved / again.info(name)["file"]
        ).read_bytes()
