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
