"""metrics.cosine / max_abs_diff of large outputs: the same float64 as the whole-array formula, in bounded memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from vlmc import metrics


def _whole(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The formula as written before: float64 copies of both arrays, numpy's sums over all of them."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    dot = np.sum(a64 * b64, -1)
    norms = np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1)
    equal = np.all(a64 == b64, -1)
    cos = float(np.mean(np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), equal)))
    return cos, float(np.max(np.abs(a64 - b64)))


@pytest.mark.parametrize(
    "shape",
    [(7,), (3, 129), (1, 1001), (2, (1 << 20) + 8), (1, 3 * (1 << 20) + 5), (5, 600, 701)],
)
def test_blockwise_sums_are_bit_identical_to_whole_array_sums(shape):
    rng = np.random.default_rng(sum(shape))
    # magnitudes over six decades, so summation order shows in the last bits
    a = (rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, shape)).astype(np.float32)
    b = (a + rng.standard_normal(shape).astype(np.float32) * 0.05).astype(np.float32)
    cos, diff = _whole(a, b)
    assert metrics.cosine(a, b) == cos  # exact, not approx: reports must not move
    assert metrics.max_abs_diff(a, b) == diff
    assert metrics.cosine(a, a) == _whole(a, a)[0]
    t = np.ascontiguousarray(a.T)  # a non-contiguous view is read in C order, like ravel
    assert metrics.cosine(a.T, b.T) == _whole(a.T, b.T)[0] and metrics.cosine(t, b.T) == _whole(t, b.T)[0]


def test_blockwise_edge_cases_match():
    zero = np.zeros(3 << 20, np.float32)
    one = np.ones_like(zero)
    assert metrics.cosine(zero, zero) == 1.0 and metrics.cosine(zero, one) == 0.0
    nan = one.copy()
    nan[-1] = np.nan
    assert metrics.cosine(nan, one) == _whole(nan, one)[0] == 0.0
    assert np.isnan(metrics.max_abs_diff(nan, one)) and np.isnan(_whole(nan, one)[1])
    half = one.astype(np.float16)
    assert metrics.cosine(half, one) == _whole(half, one)[0]
    assert metrics.max_abs_diff(half, one * 2) == 1.0
    with pytest.raises(ValueError):
        metrics.max_abs_diff(zero[:0], zero[:0])


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from vlmc import metrics

    def status(key):
        with open("/proc/self/status") as f:
            return int(f.read().split(key + ":")[1].split()[0]) * 1024

    n = int(sys.argv[1])
    a = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    b = a + np.float32(0.01)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    metrics.cosine(a, b)
    metrics.max_abs_diff(a, b)
    print(status("VmHWM") - before)
    """
)


def test_cosine_and_max_abs_diff_hold_no_float64_copy():
    # A 512 M real-width decoder's prefill logits are [1, 600, 32064] float32 (77 MB); the float64
    # copies and products of the whole-array formula raised the build's peak RSS by 300-450 MB there.
    n = 16 << 20  # 64 MiB of float32 per array
    done = subprocess.run([sys.executable, "-c", _CHILD, str(n)], capture_output=True, text=True, check=True)
    grown = int(done.stdout)
    assert grown < 0.5 * n * 4, grown  # whole-array: >= 4 float32 sizes (two float64 copies)


def test_cosine_keeps_no_reference_to_its_arrays():
    # Arrays compared are freed when the caller drops them, without waiting for a garbage
    # collection: a recursive closure in the block sums once made a reference cycle that kept two
    # decoders' prefill logits (316 MB at 512 M) alive at a build's memory peak.
    import gc
    import weakref

    a = np.ones(3 * (1 << 20) + 5, np.float32)
    b = a * 2
    alive = weakref.ref(a), weakref.ref(b)
    gc.disable()
    try:
        metrics.cosine(a, b)
        metrics.max_abs_diff(a, b)
        del a, b
        assert [r() is None for r in alive] == [True, True]
    finally:
        gc.enable()
