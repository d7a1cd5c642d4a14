"""Dispatch modes: the tracing mode that turns an op's decomposition into a PrimGraph."""

from decompshard.dispatch_modes.graph import PrimGraph, PrimNode, ValueInfo
from decompshard.dispatch_modes.tracing import find_decomposition, has_decomposition, trace

__all__ = ["PrimGraph", "PrimNode", "ValueInfo", "find_decomposition", "has_decomposition", "trace"]
