"""User-facing errors.

A :class:`PosbenchError` is a mistake the user can fix (bad config value, missing data path,
corrupt cache...). The CLI prints its message on one line and exits non-zero without a
traceback; ``POSBENCH_DEBUG=1`` (or ``posbench <cmd> debug=true``) shows the traceback. Every
message should name the fix, e.g. "... ; set data.path=<dir with .txt files>".
"""


class PosbenchError(Exception):
    """An error caused by user input, reported as one line naming the fix."""


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``, for logs and status files."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
