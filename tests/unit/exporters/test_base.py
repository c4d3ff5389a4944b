"""The export's weight writer (vlmc/exporters/base.py): bytes and hashes exactly torch's conversion.

The writer transposes into a reused scratch buffer, converts into a few reused block buffers and
writes/hashes them on two threads; these tests shrink the block and scratch limits so every path
(one block, many blocks, buffer reuse, the strided gather of a view too large for the scratch,
a row larger than a block) runs on small tensors, and compare each tensor's bytes in the file and
the hash the writer records with ``tensor.to(dtype).contiguous()`` and :func:`interop.tensor_hash`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from vlmc import interop
from vlmc.exporters import base


def _tensors() -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    g = torch.Generator().manual_seed(0)
    w16 = torch.randn(48, 40, generator=g).to(torch.bfloat16)  # a bf16 checkpoint Linear weight
    w32 = torch.randn(40, 36, generator=g)
    wide = torch.randn(3, 700, generator=g)
    return {
        "bf16_transposed_to_fp32": (w16.t(), torch.float32),
        "bf16_contiguous_to_fp32": (w16, torch.float32),
        "fp32_transposed": (w32.t(), torch.float32),
        "fp32_contiguous": (w32, torch.float32),
        "fp32_wide_transposed": (wide.t(), torch.float32),
        "fp32_row_over_a_block": (torch.randn(700, 3, generator=g).t(), torch.float32),
        "bf16_transposed_kept": (w16.t(), torch.bfloat16),
    }


def _expected_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    t = tensor.to(dtype).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("block", "whole"),
    [(base._CHUNK_BYTES, base._WHOLE_TRANSPOSE_BYTES), (512, 4096), (2048, 1 << 20)],
    ids=["default-limits", "tiny-blocks-and-scratch", "tiny-blocks"],
)
def test_written_bytes_and_hashes_are_torchs_conversion(tmp_path, monkeypatch, block, whole):
    monkeypatch.setattr(base, "_CHUNK_BYTES", block)
    monkeypatch.setattr(base, "_WHOLE_TRANSPOSE_BYTES", whole)
    tensors = _tensors()
    data = tmp_path / "g.data"
    placed = []
    with open(data, "wb") as f, base._DataWriter(f) as out:
        for name, (tensor, dtype) in tensors.items():
            dims = list(tensor.shape)
            offset, n, digest = out.put(onnx.TensorProto.FLOAT, dims, base._chunks(tensor, dtype, out))
            placed.append((name, offset, n, digest))
        assert out._buffers <= base._CHUNK_BUFFERS  # blocks are reused, not made per tensor
    raw = data.read_bytes()
    for name, offset, n, digest in placed:
        tensor, dtype = tensors[name]
        want = _expected_bytes(tensor, dtype)
        assert offset % 64 == 0, name
        assert raw[offset : offset + n] == want, name
        h = interop.digest_start(onnx.TensorProto.FLOAT, list(tensor.shape))
        h.update(want)
        assert digest.result() == h.hexdigest(), name


def test_the_recorded_hashes_are_what_fingerprints_compute(tmp_path, monkeypatch):
    """The hashes _write_with_weights records are interop.tensor_hash of the tensors read back."""
    monkeypatch.setattr(base, "_CHUNK_BYTES", 256)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 16, generator=g)  # used as a transposed view, like a traced Linear weight
    b = torch.randn(24, generator=g)
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Gemm", ["x", "w", "b"], ["y"])],
            "g",
            [
                onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16]),
                onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [16, 24]),
                onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [24]),
            ],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 24])],
        )
    )
    base._write_with_weights(model, {"w": w.t(), "b": b}, tmp_path / "g.onnx")
    loaded = ir.load(str(tmp_path / "g.onnx"))
    weights = {v.name: v.const_value for v in loaded.graph.initializers.values()}
    np.testing.assert_array_equal(weights["w"].numpy(), w.t().numpy())
    recorded = weights["w"]

    def unread(t):
        raise AssertionError("the writer's hash was not recorded: the weight was read again")

    monkeypatch.setattr(interop, "_external_digest", unread)
    key_hash = interop.tensor_hash(recorded)
    with open(tmp_path / "g.onnx.data", "rb") as f:
        f.seek(recorded.offset)
        body = f.read(recorded.length)
    fresh = hashlib.sha256(f"{onnx.TensorProto.FLOAT}|[16, 24]|".encode())
    fresh.update(body)
    assert key_hash == fresh.hexdigest()
