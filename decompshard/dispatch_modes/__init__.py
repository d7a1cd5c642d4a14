"""Dispatch modes: the tracing mode that turns an op's decomposition into a PrimGraph; the
recorders of outermost aten calls (record.py: the OpInfo capture's, check --model's) and
the collective counter (comm_bytes.py: the model zoo's bytes), imported from their modules."""

from decompshard.dispatch_modes.graph import PrimGraph, PrimNode, ValueInfo
from decompshard.dispatch_modes.tracing import find_decomposition, has_decomposition, trace

__all__ = ["PrimGraph", "PrimNode", "ValueInfo", "find_decomposition", "has_decomposition", "trace"]
