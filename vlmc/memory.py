"""Peak resident memory of this process over a step (Linux /proc; elsewhere the numbers are None).

The kernel's high-water mark (VmHWM) is exact but cumulative, and resetting it (clear_refs) would
also lower what the process reports as its overall peak (ru_maxrss) to whoever measures it from
outside, such as `make bench`. So a step's peak is VmHWM at its end when the step raised it (then
it is exact), and otherwise the highest RSS a background thread sampled during the step (a thread
cannot sample while C code holds the GIL, which is why the high-water mark comes first).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_INTERVAL = 0.01  # seconds between samples


def high_water() -> int | None:
    """The process's peak resident set size so far (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available() -> int:
    """Bytes this machine can still give a process (MemAvailable), or all physical memory where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * _PAGE
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def release_free() -> None:
    """Give the memory the C allocator holds freed back to the system (glibc ``malloc_trim``).

    onnxruntime and numpy free their buffers through glibc, which keeps freed blocks of its heaps for
    reuse: after the static INT8 calibration of the 512 M real-width vision encoder, 250 MB of the
    process's RSS was such free memory, still counted at the fidelity runs that followed. Nothing
    live is touched. Unreachable reference cycles are collected first: what they hold is garbage too,
    but only the cycle collector frees it, and its next full pass can come after the peak it inflates
    (a cycle once kept two decoders' prefill logits alive through a 512 M build's fidelity runs).
    A no-op for the trim where glibc is not the C library.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def rss() -> int | None:
    """Current resident set size in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class Peak:
    """The highest RSS seen while the ``with`` block ran (``bytes``; None where /proc is missing)."""

    def __init__(self) -> None:
        self.bytes: int | None = rss()
        self._hwm = high_water()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="vlmc-rss", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(_INTERVAL):
            now = rss()
            if now is not None and (self.bytes is None or now > self.bytes):
                self.bytes = now

    def __enter__(self) -> Peak:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Peak:
        if self.bytes is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        now = rss()
        if now is not None and (self.bytes is None or now > self.bytes):
            self.bytes = now
        hwm = high_water()
        if hwm is not None and self._hwm is not None and hwm > self._hwm:
            self.bytes = max(self.bytes or 0, hwm)  # this step set a new high-water mark: exact


@contextlib.contextmanager
def peak():
    """``with memory.peak() as p: ...`` then ``p.bytes``."""
    with Peak() as p:
        yield p
