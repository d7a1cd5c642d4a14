"""A symbolic size DTensor kept from an earlier trace resolves to its value, not to itself.

make_fx (AOT autograd's trace of a compiled forward and backward) finds the proxy of a
SymInt it never saw made through a table of bare symbols: DTensor keeps sizes in its
specs from dynamo's trace, outside make_fx's, and every such `s3` is looked up there.
torch (2.13 to 2.15) writes each new SymInt whose expression is a bare symbol into that
table over the entry before it. One of DTensor's own, `sym_max(s3, 1)` (a stride), is
`s3` again once `s3 >= 2` is known: its entry then computes itself from an `s3` that is
looked up in the table, which now answers with that entry. AOT autograd's trace recursed
without end (`_compute_proxy` -> `force` -> `_compute_proxy`): the data- and
tensor-parallel Llama compiled with `mark_dynamic` or a second sequence length raised
RecursionError, with or without decompshard.

The table's first entry for a symbol (the input size it was made from) is kept: every
later SymInt of that expression has the same value, so reading the first one is exact.

A size with no entry is rebuilt from its expression's pieces. On 2.13 and 2.14 the
builder hands an n-ary product (`4*s0*s1`, a batch-sharded DTensor's rows flattened) to
`operator.mul` as one node of three arguments, and the graph computes `4*s0`: the
data-parallel Llama compiled with `dynamic=True` raised "shape '[2, 32]' is invalid for
input of size 384" at a view (an error there; a wrong size where nothing checks it).
Such an expression is built as a chain of two-argument nodes, as 2.15 does itself. A Max or
Min is rebuilt as `torch.sym_max`/`sym_min` (torch's own n-ary wrappers, the nodes' targets,
are functions inductor cannot lower: the tensor-parallel Llama under `dynamic=True` failed to
compile with inductor, torch alone too).
Tests: tests/test_symbolic_sizes.py.
"""

from __future__ import annotations

from typing import Iterator

from decompshard._compat import (binary_sym_exprs, first_symbol_proxy_kept, sym_expr_builder_slot, sym_max_min_entries,
                                 symbol_proxy_slot)
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries"]


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """proxy_tensor's `set_proxy_slot`, keeping each bare symbol's first proxy; its
    expression builder, making two-argument nodes; Max and Min rebuilt as sym_max/sym_min."""
    module, name, set_proxy_slot = symbol_proxy_slot()
    yield module, name, first_symbol_proxy_kept(set_proxy_slot)
    binary_ops = sym_max_min_entries()
    yield from binary_ops
    module, name, build = sym_expr_builder_slot()
    yield module, name, binary_sym_exprs(build, folded=tuple({key for _, key, _ in binary_ops}))
