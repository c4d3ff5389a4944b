"""The disk-bound floor of a build: read a safetensors checkpoint once and write it once as FP32.

One tensor in memory at a time, no graph, no hashing, no transposition: what any export of that
checkpoint to an FP32 graph must at least cost on this machine. bench.py runs it beside the build
it measures (same run; bench.py drops the checkpoint from the page cache before each, so both
read it from the disk) and reports the build's time as a multiple of it.

    python scripts/disk_floor.py CHECKPOINT_DIR OUT_FILE [--max-file-gib N]

``--max-file-gib`` (for a disk without room for the whole FP32 copy): every N GiB the file is
flushed to disk (fsync) and written again from its start, so it never holds more than N GiB; the
bytes are still all written to the disk, one more sync per N GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def floor(checkpoint: Path, out: Path, max_file_bytes: int | None = None) -> dict:
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
                    if max_file_bytes is not None and f.tell() + t.numel() * 4 > max_file_bytes:
                        f.flush()
                        os.fsync(f.fileno())  # on the disk before its space is reused
                        f.seek(0)
                        f.truncate()
                    written += f.write(memoryview(t.numpy()).cast("B"))
                    del t
    return {
        "seconds": time.perf_counter() - t0,
        "read_bytes": read,
        "written_bytes": written,
        "max_file_bytes": max_file_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--max-file-gib", type=float, help="rewrite the file from its start every N GiB (fsync first)"
    )
    args = ap.parse_args()
    limit = int(args.max_file_gib * 2**30) if args.max_file_gib else None
    try:
        print(json.dumps(floor(args.checkpoint, args.out, limit)))
    finally:
        if args.out.exists():
            os.unlink(args.out)


if __name__ == "__main__":
    main()
