"""The disk-bound floor of a build: read a safetensors checkpoint once and write it once as FP32.

One tensor in memory at a time, no graph, no hashing, no transposition: what any export of that
checkpoint to an FP32 graph must at least cost on this machine. bench.py runs it beside the build
it measures (same run, same page-cache state) and reports the build's time as a multiple of it.

    python scripts/disk_floor.py CHECKPOINT_DIR OUT_FILE
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def floor(checkpoint: Path, out: Path) -> dict:
    import torch
    from safetensors import safe_open

    t0 = time.perf_counter()
    read = written = 0
    with open(out, "wb") as f:
        for shard in sorted(checkpoint.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as st:
                for key in st.keys():
                    t = st.get_tensor(key)
                    read += t.numel() * t.element_size()
                    t = t.to(torch.float32)
                    written += f.write(memoryview(t.numpy()).cast("B"))
                    del t
    return {"seconds": time.perf_counter() - t0, "read_bytes": read, "written_bytes": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    try:
        print(json.dumps(floor(args.checkpoint, args.out)))
    finally:
        if args.out.exists():
            os.unlink(args.out)


if __name__ == "__main__":
    main()
