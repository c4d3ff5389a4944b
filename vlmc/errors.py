"""Exception types whose messages are shown to users as one line."""

from __future__ import annotations

from vlmc import limits


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


def one_line(message: object, limit: int | None = None) -> str:
    """A user-facing message as one readable line: line breaks escaped, the middle of a long one cut.

    Values inside messages come from untrusted inputs (a pass name, a key, a path 100 kB long); both
    ends are kept, since the start says what failed and the end often says what to do.
    """
    limit = limits.MAX_ERROR_CHARS if limit is None else limit
    text = str(message).replace("\r", "\\r").replace("\n", "\\n")
    if len(text) <= limit:
        return text
    keep = (limit - 30) // 2
    return f"{text[:keep]} ...[{len(text) - 2 * keep} characters cut]... {text[-keep:]}"
