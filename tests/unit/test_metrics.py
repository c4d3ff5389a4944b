"""vlmc.metrics (used by verify, prune_visual_tokens and quantize) against torch's own definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlmc import metrics


@pytest.fixture
def logits():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 50)).astype(np.float32)
    got = (ref + rng.normal(scale=0.3, size=ref.shape)).astype(np.float32)
    return ref, got


def test_kl_matches_torch(logits):
    ref, got = logits
    lp, lq = (F.log_softmax(torch.from_numpy(x).double(), -1) for x in (ref, got))
    expected = F.kl_div(lq, lp, log_target=True, reduction="batchmean").item()
    assert metrics.kl(ref, got) == pytest.approx(expected, rel=1e-12)
    assert metrics.kl(ref, ref) == 0.0
    np.testing.assert_allclose(metrics.log_softmax(ref), lp.numpy(), rtol=1e-12, atol=1e-12)


def test_cosine_rows_and_flattened_match_torch(logits):
    ref, got = logits
    a, b = torch.from_numpy(ref).double(), torch.from_numpy(got).double()
    assert metrics.cosine(ref, got, axis=-1) == pytest.approx(
        F.cosine_similarity(a, b, dim=-1).mean().item(), rel=1e-12
    )
    assert metrics.cosine(ref, got) == pytest.approx(
        F.cosine_similarity(a.ravel(), b.ravel(), dim=0).item(), rel=1e-12
    )


def test_cosine_of_zero_arrays_is_one_only_when_equal():
    zero = np.zeros((2, 3), np.float32)
    assert metrics.cosine(zero, zero) == 1.0
    assert metrics.cosine(zero, np.ones_like(zero)) == 0.0
    rows = np.array([[0.0, 0.0], [1.0, 2.0]])
    assert metrics.cosine(rows, rows, axis=-1) == pytest.approx(1.0)
    assert metrics.cosine(rows, np.array([[1.0, 0.0], [1.0, 2.0]]), axis=-1) == pytest.approx(0.5)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_agreement_matches_torch_topk(logits, k):
    ref, got = logits
    ta = torch.topk(torch.from_numpy(ref), k, -1).indices.tolist()
    tb = torch.topk(torch.from_numpy(got), k, -1).indices.tolist()
    expected = np.mean([len(set(x) & set(y)) / k for x, y in zip(ta, tb)])
    assert metrics.top_k_agreement(ref, got, k) == pytest.approx(expected)
    assert metrics.top_k_agreement(ref, ref, k) == 1.0
    assert metrics.top_k_agreement(ref, -ref, k) == 0.0


def test_logits_agreement_collects_every_metric(logits):
    ref, got = logits
    out = metrics.logits_agreement(ref, got)
    assert out == {
        "kl": metrics.kl(ref, got),
        "cosine": metrics.cosine(ref, got, axis=-1),
        "top1": metrics.top_k_agreement(ref, got, 1),
        "top5": metrics.top_k_agreement(ref, got, 5),
        "max_abs_diff": float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64)))),
    }
    assert metrics.logits_agreement(ref, ref) == {
        "kl": 0.0,
        "cosine": pytest.approx(1.0),
        "top1": 1.0,
        "top5": 1.0,
        "max_abs_diff": 0.0,
    }


def test_token_metrics():
    ref = [[5, 6, 7, 2], [9, 9], []]
    got = [[5, 6, 8, 2], [9, 9, 4], [1]]
    assert metrics.common_prefix(ref, got) == [2, 2, 0]
    # equal positions: 3 + 2 + 0, over the longer sequence of each pair: 4 + 3 + 1
    assert metrics.token_agreement(ref, got) == pytest.approx(5 / 8)
    assert metrics.token_agreement([], []) == 0.0
    out = metrics.generation_agreement(np.eye(3), ref, np.eye(3), got)
    assert (
        out["common_prefix"] == [2, 2, 0]
        and out["token_agreement"] == pytest.approx(5 / 8)
        and out["top1"] == 1.0
    )
