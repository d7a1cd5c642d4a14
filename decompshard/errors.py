"""Errors a user can act on. Each message is one line that names the op and the cause."""


class DecompShardError(Exception):
    """Base class for decompshard's own errors."""


class UnsupportedOp(DecompShardError):
    """The op cannot be derived; `reason` is the short form shown in tables."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class DataDependent(UnsupportedOp):
    """The decomposition reads tensor values to decide what to do next."""


class Indeterminate(DecompShardError):
    """A check gave no answer that follows from the op and its shapes alone (a kernel run
    that timed out). Tools report it as a refusal; under `enable()` it stops the program,
    because a rank that decided alone could choose differently from the others, and ranks
    that choose differently run mismatched collectives (a hang, an abort, wrong numbers)."""


class UsageError(DecompShardError):
    """Bad input to a command (a flag, a file, a module to import): printed as one line,
    exit code 2."""


def one_line(e: BaseException, limit: int | None = None, *, with_type: bool = True) -> str:
    """An exception as one line for tables, reasons and verdicts: `Type: first line of
    its message`, the first line cut to `limit` characters, or just `Type` when the
    message is empty. Torch's messages run to many lines (stack hints, suggestions);
    their first line is the one that says what went wrong, and a table cell or a JSON
    reason must stay on one line. `with_type=False` gives the message alone (the type
    name when it is empty), for reasons that already say what kind of failure it was.
    """
    lines = str(e).strip().splitlines()
    first = lines[0][:limit] if lines else ""
    if not with_type:
        return first or type(e).__name__
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
