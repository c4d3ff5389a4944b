"""How close a run stays to a reference: logits distances and greedy-token agreement (verify, pruning, quantize)."""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(ref_logits: np.ndarray, got_logits: np.ndarray) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(got)), in nats (never below 0: rounding can dip under)."""
    lp, lq = log_softmax(ref_logits), log_softmax(got_logits)
    return max(float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1))), 0.0)


def cosine(a: np.ndarray, b: np.ndarray, axis: int | None = None) -> float:
    """Cosine similarity of two arrays: of the flattened arrays, or the mean over rows along ``axis``.

    Where a norm is zero the cosine is undefined; it counts as 1 if both sides are equal, else 0.
    Computed in float64. Flattened, the sums go block by block (:func:`_sum_float64`), so a large
    output (a 512 M decoder's prefill logits: 77 MB of float32) needs no float64 copies of itself.
    """
    if axis is None and a.size == b.size:
        a, b = a.reshape(-1), b.reshape(-1)
        dot = _sum_float64(lambda i, j: _f64(a[i:j]) * _f64(b[i:j]), a.size)
        norms = np.sqrt(_sum_float64(lambda i, j: _square(a[i:j]), a.size)) * np.sqrt(
            _sum_float64(lambda i, j: _square(b[i:j]), b.size)
        )
        equal = all(np.all(a[i : i + _BLOCK] == b[i : i + _BLOCK]) for i in range(0, a.size, _BLOCK))
        return float(dot / norms) if norms > 0 else float(equal)
    a, b = a.astype(np.float64), b.astype(np.float64)
    if axis is None:
        a, b, axis = a.ravel(), b.ravel(), -1
    dot = np.sum(a * b, axis)
    norms = np.linalg.norm(a, axis=axis) * np.linalg.norm(b, axis=axis)
    equal = np.all(a == b, axis)
    return float(np.mean(np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), equal)))


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over all elements, in float64, block by block (no float64 copy of either array)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if not a.size:
        raise ValueError("max_abs_diff of empty arrays")
    blocks = [
        np.max(np.abs(_f64(a[i : i + _BLOCK]) - _f64(b[i : i + _BLOCK]))) for i in range(0, a.size, _BLOCK)
    ]
    return float(np.max(blocks))  # np.max, not max(): a NaN anywhere is the answer, as before


# Elements per block of the float64 sums: 8 MiB of float64 per temporary.
_BLOCK = 1 << 20


def _f64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def _square(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x * x


def _sum_float64(block, n: int) -> np.float64:
    """``np.sum`` of a float64 vector of ``n`` elements, bit for bit, made ``block(i, j)`` at a time.

    numpy sums a contiguous float64 vector pairwise: 0 + s(0, n), where s(lo, n) halves ``n`` (the
    first half rounded down to a multiple of 8) until a block of at most 128 elements is summed with
    eight accumulators (numpy/_core/src/umath/loops_utils.h.src, ``pairwise_sum``). Splitting at the
    same points (:func:`_pairwise`) and letting numpy sum each leaf (``initial=-0.0`` adds exactly
    nothing, so a leaf is s(lo, n) itself) gives the same float64 as summing the whole vector at
    once; checked against ``np.sum`` in tests/unit/test_metrics_blocks.py.
    """
    return np.float64(0.0) + _pairwise(block, 0, n)


def _pairwise(block, lo: int, m: int) -> np.float64:
    # A module function, not a closure over itself: a recursive closure is a reference cycle, which
    # kept ``block``'s arrays (two decoders' prefill logits, 316 MB at 512 M) alive until the next
    # full garbage collection, at the build's peak.
    if m <= _BLOCK:
        return np.add.reduce(block(lo, lo + m), initial=-0.0)
    half = m // 2
    half -= half % 8
    return _pairwise(block, lo, half) + _pairwise(block, lo + half, m - half)


def top_k_agreement(ref_logits: np.ndarray, got_logits: np.ndarray, k: int) -> float:
    """Mean share of each row's k best tokens under ``ref`` that are also among the k best under ``got``."""
    k = min(k, ref_logits.shape[-1])
    if k == 1:
        return float(np.mean(ref_logits.argmax(-1) == got_logits.argmax(-1)))
    ta = np.argsort(-ref_logits, -1)[..., :k].reshape(-1, k)
    tb = np.argsort(-got_logits, -1)[..., :k].reshape(-1, k)
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta.tolist(), tb.tolist())]))


def logits_agreement(ref: np.ndarray, got: np.ndarray) -> dict:
    """First-token logits fidelity of ``got`` against ``ref`` ([batch, vocab] each).

    Returns:
        ``kl`` (mean KL(ref || got), nats), ``cosine`` (mean over rows), ``top1`` (argmax agreement),
        ``top5`` (share of ref's 5 best tokens also among got's 5 best) and ``max_abs_diff``.
    """
    a, b = ref.astype(np.float64), got.astype(np.float64)
    return {
        "kl": kl(a, b),
        "cosine": cosine(a, b, axis=-1),
        "top1": top_k_agreement(a, b, 1),
        "top5": top_k_agreement(a, b, 5),
        "max_abs_diff": float(np.max(np.abs(a - b))),
    }


def common_prefix(ref: list[list[int]], got: list[list[int]]) -> list[int]:
    """Length of the shared greedy prefix per sequence."""
    out = []
    for r, g in zip(ref, got):
        n = 0
        while n < min(len(r), len(g)) and r[n] == g[n]:
            n += 1
        out.append(n)
    return out


def token_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of position-wise equal tokens, over the longer of each pair of sequences."""
    total = sum(max(len(r), len(g)) for r, g in zip(ref, got))
    agree = sum(1 for r, g in zip(ref, got) for x, y in zip(r, g) if x == y)
    return agree / max(total, 1)


def generation_agreement(
    ref_logits: np.ndarray, ref_tokens: list[list[int]], got_logits: np.ndarray, got_tokens: list[list[int]]
) -> dict:
    """:func:`logits_agreement` of the first-token logits plus ``token_agreement`` and ``common_prefix``."""
    out = logits_agreement(ref_logits, got_logits)
    out.update(
        token_agreement=token_agreement(ref_tokens, got_tokens),
        common_prefix=common_prefix(ref_tokens, got_tokens),
    )
    return out
