"""paged_kv's memory does not grow with depth: its sample pools are written one at a time (subprocess RSS probe).

At LLaVA-1.5-7B widths each layer's two sample pools are 21 MB; holding them all (and their .npz
bytes) grew the pass by ~50 MB per decoder layer, 1.8 GiB at 32 layers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vlmc import interop
from vlmc.package import Package
from vlmc.passes import paged_kv

from .test_paged_kv import _decoder

_LAYERS, _HEADS, _HEAD_DIM, _BLOCK = 16, 4, 128, 512
_POOL = 5 * _BLOCK * _HEADS * _HEAD_DIM * 4  # 5 blocks (sample_feeds' pool for 2 sequences), float32: 5 MiB

_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from vlmc import manifest, samples
    from vlmc.package import Package
    from vlmc.passes import paged_kv

    def status(key):
        with open("/proc/self/status") as f:
            return int(f.read().split(key + ":")[1].split()[0]) * 1024

    sys.path.insert(0, sys.argv[3])
    from tests.unit.test_samples import _savable

    pkg = Package(_savable(manifest.new("unit", "LlamaForCausalLM", "unit", "none")))
    pkg.manifest["kv"] = {{"layers": {layers}, "kv_heads": {heads}, "head_dim": {head_dim}, "layout": "contiguous"}}
    pkg.set_graph_file("decoder", Path(sys.argv[1]), role="decoder")
    pkg.model("decoder")  # opened (and fingerprinted) before the probe
    step = paged_kv.PagedKV(block_size={block})
    plan = step.check_package(pkg)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    step.run(pkg, plan)
    grew = status("VmHWM") - before
    pkg.save(sys.argv[2])
    print(grew)
    """
)


def _decoder_file(tmp_path: Path) -> Path:
    path = tmp_path / "decoder.onnx"
    interop.save(_decoder(layers=_LAYERS, heads=_HEADS, head_dim=_HEAD_DIM, vocab=64), path)
    return path


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_paged_kv_holds_one_sample_pool_at_a_time(tmp_path):
    path = _decoder_file(tmp_path)
    out = tmp_path / "paged"
    code = _CHILD.format(layers=_LAYERS, heads=_HEADS, head_dim=_HEAD_DIM, block=_BLOCK)
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(out), str(Path(__file__).parents[3])],
        capture_output=True,
        text=True,
        check=True,
    )
    grew = int(done.stdout.split()[-1])
    pools = 2 * _LAYERS * _POOL  # 160 MiB of sample pools
    # Before: every pool, then the .npz bytes of all of them, were in memory at once (> 2x pools).
    # Now one pool (and its float64 draw) is: a bound that does not depend on the layer count.
    assert grew < 6 * _POOL < pools / 5, (grew / 2**20, pools / 2**20)
    # The samples written are exactly sample_feeds' arrays, in np.savez's sorted order.
    saved = Package.load(out)
    want = paged_kv.sample_feeds(saved, "decoder", _BLOCK)
    with np.load(out / "samples" / "decoder.npz") as z:
        assert z.files == sorted(want)
        for name in z.files:
            np.testing.assert_array_equal(z[name], want[name], err_msg=name)
