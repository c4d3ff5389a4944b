"""Peak resident memory of this process over a step (Linux /proc; elsewhere the numbers are None).

A step's peak is sampled by a background thread rather than read from VmHWM after resetting it:
resetting the kernel's high-water mark (clear_refs) would also lower what the process reports as
its overall peak (ru_maxrss) to whoever measures it from outside, such as `make bench`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_INTERVAL = 0.01  # seconds between samples


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


@contextlib.contextmanager
def peak():
    """``with memory.peak() as p: ...`` then ``p.bytes``."""
    with Peak() as p:
        yield p
