"""Ctrl-C and SIGTERM, honoured between any two blocks of work, in the main thread and in worker threads.

Python raises KeyboardInterrupt in the main thread at whatever bytecode it is running when the signal
comes. Where that is a finalizer (``__del__``, a weakref callback) or a C++ callback, the exception is
printed as "Exception ignored" or turned into another error and the work goes on: on a busy machine a
Ctrl-C was lost that way (issue #29). So the CLI's handlers (vlmc/cli.py) also record the signal here,
and long loops call :func:`check` between blocks of work (a calibration sample, a block of an exported
weight, a pass), in whatever thread runs them: a recorded signal is raised again there, and from a
worker thread reaches the main thread through the future it fails.
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)

_received: int | None = None  # the signal number recorded by the CLI's handler, until it is handled


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every atomic write removes its temporary directory."""


def record(signum: int) -> None:
    """Called by the CLI's signal handler: from now on :func:`check` raises."""
    global _received
    _received = signum


def clear() -> None:
    """Forget a recorded signal (the CLI, once it has handled it, or on a new command)."""
    global _received
    _received = None


def check() -> None:
    """Raise KeyboardInterrupt (Terminated for SIGTERM) if a signal was recorded; a no-op otherwise."""
    if _received is not None:
        raise Terminated() if _received == signal.SIGTERM else KeyboardInterrupt()
