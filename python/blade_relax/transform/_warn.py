"""The one warning a pass gives when it falls back: part of the module left as it was."""

from __future__ import annotations

import warnings

__all__ = ["PassFallbackWarning", "warn_fallback"]


class PassFallbackWarning(UserWarning):
    """A pass could not read part of a module and left it unchanged (or to a simpler method).

    The result is still correct; it is only less optimized. Filter it like any warning, e.g.
    ``warnings.simplefilter("error", PassFallbackWarning)`` to make fallbacks fail a test.
    """


def warn_fallback(
    pass_name: str,
    what: str,
    function: str,
    err: BaseException,
    *,
    note: str = "",
    stacklevel: int = 2,
) -> None:
    """Warn ``"<pass_name>: <what> left unchanged for <function> (<note>): <ErrType>: <err>"``.

    The one way a pass, or a builder of IR outside the passes, says it fell back: part of the
    module left as it was (or to a simpler method) because an analysis could not read it.

    Parameters
    ----------
    pass_name
        The pass (or builder) that fell back.
    what
        What it left unchanged (``"function"``, ``"allocations"``, ...).
    function
        Where: the function (or the IR object) it could not read.
    err
        Why: the error the analysis raised.
    note
        Optional detail, shown next to ``function``.
    stacklevel
        Counted from the caller, as for :func:`warnings.warn` called there.
    """
    where = f"{function} ({note})" if note else function
    warnings.warn(
        f"{pass_name}: {what} left unchanged for {where}: {type(err).__name__}: {err}",
        PassFallbackWarning,
        stacklevel=stacklevel + 1,
    )
