"""Dispatch modes: the tracing mode that turns an op's decomposition into a PrimGraph."""

from .graph import PrimGraph, PrimNode, ValueInfo
from .tracing import find_decomposition, has_decomposition, trace

__all__ = ["PrimGraph", "PrimNode", "ValueInfo", "find_decomposition", "has_decomposition", "trace"]
