"""Peak resident memory of this process, per step (Linux /proc; elsewhere the numbers are None)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def reset_peak() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak() -> int | None:
    """Peak resident set size in bytes since the last :func:`reset_peak` (or process start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
