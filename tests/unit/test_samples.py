"""samples.store_streamed writes the same .npz as samples.store; samples.shapes reads shapes from headers."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import onnx_ir as ir

from vlmc import manifest as manifest_module
from vlmc import samples
from vlmc.package import Package


def _savable(manifest: dict) -> dict:
    """The facts a manifest needs before a package can be saved (validate's required keys)."""
    manifest["vision"].update(
        image_size=[8, 8],
        tokens_per_image=4,
        image_token_id=1,
        preprocess={
            "crop_size": [8, 8],
            "kind": "clip",
            "mean": [0.5, 0.5, 0.5],
            "resample": "bicubic",
            "rescale_factor": 1 / 255,
            "resize_shortest_edge": 8,
            "std": [0.5, 0.5, 0.5],
        },
    )
    manifest["text"].update(vocab_size=64, eos_token_id=0)
    manifest["kv"].setdefault("layout", "contiguous")
    return manifest


def _package() -> Package:
    """A package with one tiny graph whose inputs are b, a, c (in that order)."""
    pkg = Package(_savable(manifest_module.new("unit", "LlamaForCausalLM", "unit", "none")))
    pkg.manifest["kv"].update(layers=1, kv_heads=1, head_dim=1)
    inputs = [ir.val(n, ir.DataType.FLOAT, [1]) for n in ("b", "a", "c")]
    node = ir.node("Sum", inputs, name="sum")
    node.outputs[0].name = "y"
    node.outputs[0].dtype, node.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([1])
    graph = ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 17}, name="g")
    pkg.set_graph("g", ir.Model(graph, ir_version=9), role="decoder")
    return pkg


def _arrays() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        ("b", rng.standard_normal((3, 4)).astype(np.float32)),
        ("a", np.arange(6, dtype=np.int64).reshape(2, 3)),
        ("c", np.broadcast_to(np.arange(3, dtype=np.int32), (2, 3))),  # not contiguous
    ]


def _entries(blob: bytes) -> list[tuple[str, int, int, bytes]]:
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return [(i.filename, i.compress_type, i.file_size, z.read(i)) for i in z.infolist()]


def test_streamed_samples_are_the_stored_ones(tmp_path):
    stored, streamed = _package(), _package()
    samples.store(stored, "g", dict(_arrays()))
    samples.store_streamed(streamed, "g", iter(_arrays()))
    path = streamed.files[samples.sample_path("g")]
    # the same zip entries (names, directory order, storage, bytes); only their timestamps and places differ
    assert _entries(path.read_bytes()) == _entries(stored.files[samples.sample_path("g")])
    assert [n for n, *_ in _entries(path.read_bytes())] == ["a.npy", "b.npy", "c.npy"]
    for got, want in (
        (samples.load(streamed, "g"), dict(_arrays())),
        (samples.load(stored, "g"), dict(_arrays())),
    ):
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    # saved with the package: moved out of the scratch directory, and read from there afterwards
    pkg_dir = streamed.save(tmp_path / "pkg")
    assert not path.exists() and (pkg_dir / "samples" / "g.npz").is_file()
    assert streamed.files[samples.sample_path("g")] == pkg_dir / "samples" / "g.npz"
    np.testing.assert_array_equal(samples.load(streamed, "g")["b"], dict(_arrays())["b"])


def test_shapes_come_from_the_headers():
    pkg = _package()
    samples.store(pkg, "g", dict(_arrays()))
    assert samples.shapes(pkg, "g") == {"a": (2, 3), "b": (3, 4), "c": (2, 3)}
    streamed = _package()
    samples.store_streamed(streamed, "g", iter(_arrays()))
    assert samples.shapes(streamed, "g") == {"a": (2, 3), "b": (3, 4), "c": (2, 3)}
    # samples that do not match the graph's inputs are not its samples (as load() says)
    samples.store(pkg, "g", {"a": np.zeros(1)})
    assert samples.shapes(pkg, "g") is None and samples.load(pkg, "g") is None
    assert samples.shapes(_package(), "g") is None
