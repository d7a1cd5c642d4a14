"""Support: valid programs DTensor refuses (raises on), run anyway.

    uneven_views     view-family ops on uneven shards, redistributed instead of refused
    data_dependent   ops whose output size depends on values (nonzero, unique), run replicated
    inplace          in-place ops with no native strategy: the out-of-place result written back
    as_strided       `as_strided_` and friends where they move no element
    inplace_views    in-place view ops (`transpose_`, `unsqueeze_`) as their twin's view
    partial_fill     `masked_fill_` on a Partial self where the fill keeps it (label-smoothed
                     cross-entropy on class-sharded logits), on each rank's part
    symbolic_slices  slices to the end of a sharded dim keep the shard under symbolic sizes
                     (DTensor cannot prove `end > size` for a symbolic size and gathers)
    symbolic_strides a static shape with a symbolic stride (`x[:, :1]` of a symbolic length)
                     runs: DTensor's dispatch cache hashed its stride and raised
    symbol_proxies   AOT autograd's trace keeps a symbol's first proxy (torch writes the
                     latest over it, and a size DTensor kept resolved to itself, recursing)
    clip_norms       gradient-norm clipping (`clip_grad_norm_`, `get_total_norm`) over tensors
                     on several meshes or mixed with plain ones: one norm per mesh, combined
    kwarg_routing    keyword tensors (SDPA's `attn_mask`) moved to the placements a derived
                     strategy names (DTensor moves only positional ones); installed last

Each module declares the table entries its ops need (`entries(warn)`); `SUPPORT` lists
them in the order `enable()` installs them.
"""

from __future__ import annotations

from decompshard.runtime.records import Support
from decompshard.runtime.support import (as_strided, clip_norms, data_dependent, inplace, inplace_views, partial_fill,
                                         symbol_proxies, symbolic_slices, symbolic_strides,
                                         uneven_views)

__all__ = ["SUPPORT"]

SUPPORT: tuple[Support, ...] = (
    Support("uneven_views", "view-family ops on uneven shards redistribute instead of raising", uneven_views.entries),
    Support("data_dependent", "ops whose output size depends on values run replicated", data_dependent.entries),
    Support("inplace", "in-place ops without a native strategy write an out-of-place result back into self",
            inplace.entries),
    Support("as_strided", "as_strided_ runs where it moves no element", as_strided.entries),
    Support("inplace_views", "in-place view ops follow their out-of-place twin's native strategy",
            inplace_views.entries),
    Support("partial_fill", "masked_fill_ on a Partial self runs on the parts where the fill keeps the Partial",
            partial_fill.entries),
    Support("symbolic_slices", "a slice to the end of a sharded dim keeps the shard under symbolic sizes, as under "
            "static ones", symbolic_slices.entries),
    Support("symbolic_strides", "a DTensor of static shape and symbolic stride runs under torch.compile where "
            "DTensor's dispatch cache raised hashing its stride", symbolic_strides.entries),
    Support("symbol_proxies", "AOT autograd's trace resolves a size DTensor kept from an earlier trace to the "
            "input it came from, where torch's recursed without end", symbol_proxies.entries),
    Support("clip_norms", "gradient-norm clipping over several meshes or mixed with plain tensors: one norm per "
            "mesh, reduced once, combined as one device", clip_norms.entries),
)
