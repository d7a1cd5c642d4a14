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
