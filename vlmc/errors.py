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


class PassRefused(PassFailed):
    """A pass refused the package or a recipe value (a VlmcError from its check or run): bad input, exit 2.

    The message names the pass, its recipe position and the value; it is still a PassFailed, so
    callers that catch pass failures see it too.
    """

    exit_code = 2
