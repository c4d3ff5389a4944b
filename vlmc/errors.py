"""Exception types whose messages are shown to users as one line."""

from __future__ import annotations


class VlmcError(Exception):
    """A user-facing error (bad input, unsupported model, bad recipe): one line, exit code 2."""

    exit_code = 2


class CheckFailed(VlmcError):
    """A check ran and failed (verify thresholds, numerics check, precheck): exit code 1."""

    exit_code = 1


class PassFailed(VlmcError):
    """A pass raised or broke its contract; the message names the pass and its recipe position."""

    exit_code = 1
