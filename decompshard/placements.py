"""The alphabet of single-mesh-dim placements, and the rule type everything else speaks.

decompshard reasons about one mesh dimension at a time. On one mesh dim a tensor is
Replicate (`R`), sharded on tensor dim d (`S(d)`, a placeholder for *any* sharding type:
Shard, _StridedShard, ...), or a pending reduction (`P(sum)`, `P(avg)`, `P(max)`,
`P(min)`). These are our own small frozen types rather than torch's classes because the
solver hashes and compares millions of them, and because `S(d)` deliberately means "any
sharding kind" where torch's `Shard(d)` means one specific kind.

The string form is a contract (tools and tests parse it)::

    "R, S(0), R -> S(0)"            tensor inputs in schema order -> tensor outputs
    "S(0), S(0) -> P(avg) [even]"   holds only when every sharded dim splits evenly
    "S(0) -> S(0), None"            an output that is not a tensor, or is masked off

It is one grammar (see "the grammar" below) for rule strings and for the placements the
commands take (`check --placements`, `explain --placements`, `explain --mesh-placements`),
with one formatter per form whose output its parser reads back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence, Union

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True, order=True)
class ShardPlaceholder:
    """Sharded on tensor dim `dim`, by whatever sharding kind the runtime input has."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Partial:
    """Each rank holds a part; the true value is `reduce_op` over the ranks."""

    reduce_op: str

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"unknown Partial reduce op {self.reduce_op!r}; expected one of {REDUCE_OPS}"
            )

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    __repr__ = __str__


@dataclass(frozen=True, slots=True, order=True)
class StridedShard:
    """Sharded on a factor of dim `dim`, the way a view that flattens a sharded dim with
    its neighbours leaves it (DTensor's `_StridedShard(dim, sf)` when `inner` is 1).

    The dim's N elements are `sf` blocks of `a * inner` (N = sf * a * inner); in every
    block the `a` units of `inner` contiguous elements are chunked over the ranks
    torch.chunk-style, and a rank holds its chunk of every block, blocks in order. So a
    rank's local size on the dim is sf * chunk(a) * inner, for uneven a too. Example:
    [B, H, L, E] sharded on H (S(1)) viewed as [B*H, L, E] is StridedShard(0, sf=B);
    sharded on B (S(0)) it is StridedShard(0, sf=1, inner=H). Only values inside a traced
    decomposition take these: a view back (or the op's own rule) turns them into S(d).
    """

    dim: int
    sf: int
    inner: int = 1

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.sf})" if self.inner == 1 else f"_S({self.dim}, {self.sf}, {self.inner})"

    __repr__ = __str__

    def units(self, size: int) -> int:
        """`a`: how many chunkable units the dim of `size` elements has per block."""
        return size // (self.sf * self.inner)


def sharded_on(dim: int, sf: int = 1, inner: int = 1) -> "ShardPlaceholder | StridedShard":
    """S(dim) for the plain layout (sf = inner = 1), else the strided one."""
    return ShardPlaceholder(dim) if sf == 1 and inner == 1 else StridedShard(dim, sf, inner)


Placement = Union[Replicate, ShardPlaceholder, StridedShard, Partial]
# `None` stands for "not a tensor" (non-tensor outputs, masked-off outputs).
MaybePlacement = Union[Placement, None]

R = Replicate()
S = ShardPlaceholder
P = Partial
PARTIALS: tuple[Partial, ...] = tuple(Partial(op) for op in REDUCE_OPS)


def alphabet(ndim: int, *, partials: bool = True) -> tuple[Placement, ...]:
    """Every single-dim placement a tensor of rank `ndim` can take, Replicate first."""
    shards = tuple(ShardPlaceholder(d) for d in range(ndim))
    return (R, *shards, *(PARTIALS if partials else ()))


def is_shard(p: MaybePlacement) -> bool:
    """Any sharding kind: S(d), or a strided shard inside a traced graph."""
    return isinstance(p, (ShardPlaceholder, StridedShard))


def is_strided(p: MaybePlacement) -> bool:
    return isinstance(p, StridedShard)


def is_partial(p: MaybePlacement) -> bool:
    return isinstance(p, Partial)


def is_replicate(p: MaybePlacement) -> bool:
    return isinstance(p, Replicate)


def placement_class(p: MaybePlacement) -> str:
    """Coarse class used in recall reports: 'R', 'S', 'P(sum)', 'P(avg)', ..."""
    if isinstance(p, Partial):
        return str(p)
    if isinstance(p, (ShardPlaceholder, StridedShard)):
        return "S"
    if isinstance(p, Replicate):
        return "R"
    return "None"


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class SingleDimRule:
    """One way an op can run on one mesh dim with no redistribution.

    `inputs` follow the op's tensor inputs in schema order (lists flattened), `outputs`
    its tensor outputs. `even_only` marks a rule that is right only when every sharded
    dim splits evenly across the mesh (e.g. a mean over a sharded dim giving P(avg)).
    `source` says where the rule came from; it is not part of the rule's identity.
    """

    inputs: tuple[MaybePlacement, ...]
    outputs: tuple[MaybePlacement, ...]
    even_only: bool = False
    source: str = field(default="", compare=False, hash=False)

    def is_trivial(self) -> bool:
        """All-Replicate in and out: implied for every op, never listed."""
        return all(p is None or isinstance(p, Replicate) for p in self.inputs) and all(
            p is None or isinstance(p, Replicate) for p in self.outputs
        )

    def key(self) -> tuple[tuple[MaybePlacement, ...], tuple[MaybePlacement, ...]]:
        """Identity without the [even] condition, for comparing rule sets."""
        return (self.inputs, self.outputs)

    def __str__(self) -> str:
        return format_rule(self)


# ------------------------------------------------------------------ the grammar
#
# One grammar for every placement a user or a tool writes: rule strings, `check
# --placements`, `explain --placements` and `explain --mesh-placements`. A placement is
#
#     R | S(d) | P(sum|avg|max|min) | None | _S(d, sf) | _S(d, sf, inner)
#
# `_S(d, sf)` is torch's own spelling of `_StridedShard(d, split_factor=sf)` (its str()),
# and the one this project writes; `SS(d, k)`, what `check --placements` took before, is
# read as `_S(d, k)` so that old command lines keep working. Spaces inside and around a
# placement do not matter. A list separates placements with `,`; a per-tensor N-D list
# (one row per tensor input, one placement per mesh dim) separates rows with `;`:
# "S(0),P(sum);_S(1,3),R". Every formatter below writes text its parser reads back.


def format_placement(p: MaybePlacement) -> str:
    """One placement as the grammar writes it: R, S(0), P(sum), _S(0, 4), None."""
    return "None" if p is None else str(p)


def format_placements(placements: Iterable[MaybePlacement], sep: str = ", ") -> str:
    """A list of placements: "R, S(1), S(0)" (the left or right side of a rule)."""
    return sep.join(format_placement(p) for p in placements)


def format_placement_rows(rows: Iterable[Iterable[MaybePlacement]]) -> str:
    """Per tensor input, one placement per mesh dim, in the compact form the command
    lines take: "S(0),P(sum);_S(1,3),R" (no spaces, so it stays one shell word)."""
    return ";".join(",".join(format_placement(p).replace(" ", "") for p in row) for row in rows)


def format_rule(rule: SingleDimRule) -> str:
    return f"{format_placements(rule.inputs)} -> {format_placements(rule.outputs)}" + (
        " [even]" if rule.even_only else "")


_TOKEN_RE = re.compile(
    r"^(?:(?P<r>R)|(?P<none>None)|S\(\s*(?P<s>-?\d+)\s*\)|P\(\s*(?P<p>\w+)\s*\)"
    r"|_S\(\s*(?P<sd>\d+)\s*,\s*(?P<sf>\d+)\s*(?:,\s*(?P<inner>\d+)\s*)?\)"
    r"|SS\(\s*(?P<ssd>\d+)\s*,\s*(?P<ssk>\d+)\s*\))$"
)


def parse_placement(text: str, *, strided: bool = False) -> MaybePlacement:
    """Parse one placement of the grammar above; ValueError otherwise. Strided shards
    (`_S(d, sf)`, `_S(d, sf, inner)`, `SS(d, k)`) only with `strided`: an op's own
    inputs and outputs in a single-dim rule are never strided shards (they exist inside
    a traced decomposition, and as the N-D placements of a real DTensor)."""
    m = _TOKEN_RE.match(text.strip())
    if not m:
        raise ValueError(
            f"malformed placement {text!r}: expected R, S(<dim>), P(sum|avg|max|min), None "
            "or a strided shard _S(<dim>, <split factor>)"
        )
    g = m.groupdict()
    if g["sd"] is not None or g["ssd"] is not None:
        return _strided(text, g, strided)
    if g["r"]:
        return R
    if g["s"] is not None:
        if int(g["s"]) < 0:
            raise ValueError(f"malformed placement {text!r}: shard dim must be >= 0")
        return ShardPlaceholder(int(g["s"]))
    if g["p"] is not None:
        try:
            return Partial(g["p"])
        except ValueError as e:  # an unknown reduce op
            raise ValueError(f"malformed placement {text!r}: {e}") from None
    return None


def _strided(text: str, g: dict, allowed: bool) -> StridedShard:
    if not allowed:
        raise ValueError(
            f"placement {text!r} is a strided shard, which exists only inside a traced "
            "decomposition: an op's inputs and outputs are R, S(<dim>) or P(sum|avg|max|min)"
        )
    if g["sd"] is not None:
        dim, sf, inner = int(g["sd"]), int(g["sf"]), int(g["inner"] or 1)
    else:
        dim, sf, inner = int(g["ssd"]), int(g["ssk"]), 1
    if sf < 1 or inner < 1:
        raise ValueError(f"malformed placement {text!r}: split factors must be >= 1")
    return StridedShard(dim, sf, inner)


def parse_placements(text: str, sep: str = ",", *, strided: bool = False) -> tuple[MaybePlacement, ...]:
    """Parse a separated list of placements, e.g. "R, S(1), S(0)" (blank text: none)."""
    if not text.strip():
        return ()
    return tuple(parse_placement(part, strided=strided) for part in split_top_level(text, sep))


def parse_placement_rows(text: str, *, strided: bool = True) -> tuple[tuple[MaybePlacement, ...], ...]:
    """Inverse of `format_placement_rows`: "S(0),P(sum);_S(1,3),R" -> per tensor input
    (';'-separated), one placement per mesh dim (','-separated). Grammar only:
    `check_placement_rows` checks the rows against the tensors and the mesh."""
    return tuple(parse_placements(row, ",", strided=strided) for row in text.split(";"))


def check_placement_rows(
    rows: Sequence[Sequence[MaybePlacement]], shapes: Sequence[Sequence[int]], ndim: int,
    names: Sequence[str] | None = None,
) -> None:
    """ValueError unless `rows` can lay out tensors of `shapes` on an `ndim`-D mesh: one
    row per tensor, one placement per mesh dim, no None, shard dims in range, one Partial
    reduce op per tensor (a mix has no single meaning), and strided shards DTensor can
    hold (`_S(d, k)`, k >= 2). `names` (one per tensor) go into the messages."""
    if len(rows) != len(shapes):
        listed = f" ({', '.join(names)})" if names else ""
        raise ValueError(f"expected mesh placements for {len(shapes)} tensor inputs{listed}, got {len(rows)}")
    for i, (row, shape) in enumerate(zip(rows, shapes)):
        who = f"input {i} ({names[i]})" if names else f"input {i}"
        if len(row) != ndim:
            raise ValueError(f"{who}: expected {ndim} placements (one per mesh dim), got {len(row)}")
        for p in row:
            if p is None:
                raise ValueError(f"{who}: a tensor placement cannot be None")
            if is_shard(p) and p.dim >= len(shape):
                raise ValueError(f"{who} has {len(shape)} dims: {p} is out of range")
            if isinstance(p, StridedShard) and (p.sf < 2 or p.inner != 1):
                raise ValueError(f"{who}: {p}: a strided shard on a mesh is _S(<dim>, <split factor>), "
                                 "split factor >= 2 (DTensor's _StridedShard)")
        if len({p.reduce_op for p in row if isinstance(p, Partial)}) > 1:
            raise ValueError(f"{who}: one Partial reduce op per tensor (mixed reductions have no single meaning)")


def parse_rule(text: str, *, strided: bool = False) -> SingleDimRule:
    """Inverse of `format_rule`: "S(1), S(0) -> P(sum) [even]" (with `strided`, also a
    primitive's rule inside a graph: "_S(0, 4), R -> _S(0, 4)")."""
    s = text.strip()
    even = False
    if s.endswith("[even]"):
        even, s = True, s[: -len("[even]")].rstrip()
    if s.count("->") != 1:
        raise ValueError(f"malformed rule {text!r}: expected exactly one '->'")
    lhs, rhs = s.split("->")
    return SingleDimRule(parse_placements(lhs, strided=strided), parse_placements(rhs, strided=strided), even_only=even)


def split_top_level(text: str, sep: str) -> list[str]:
    """Split on `sep` outside parentheses ("S(0), _S(1, 2)" -> ["S(0)", " _S(1, 2)"])."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


MESH_FORMS = "expected one size per mesh dim, joined by x, e.g. 6, 2x3 or 2x2x2"


def parse_mesh_shape(mesh: Sequence[int] | str) -> tuple[int, ...]:
    """'2x4' (or a sequence of ints) -> the mesh shape; ValueError otherwise."""
    if isinstance(mesh, str):
        parts = [p.strip() for p in mesh.lower().replace("×", "x").split("x")]
        try:
            sizes = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"malformed mesh {mesh!r}: {MESH_FORMS}") from None
    else:
        sizes = tuple(int(s) for s in mesh)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"malformed mesh {mesh!r}: sizes must be positive integers; {MESH_FORMS}")
    return sizes


# ------------------------------------------------------------------ shard geometry


def shard_size(size: int, world_size: int, rank: int) -> int:
    """Local size of a dim of global `size` split torch.chunk-style, as DTensor does.

    ceil(size / W) per rank, the last non-empty rank takes the rest, later ranks get 0.
    """
    return shard_size_and_offset(size, world_size, rank)[0]


def shard_size_and_offset(size: int, world_size: int, rank: int) -> tuple[int, int]:
    chunk = -(-size // world_size) if size else 0
    offset = min(chunk * rank, size)
    return max(0, min(chunk, size - offset)), offset


def local_shape(
    shape: Sequence[int], placements: Sequence[MaybePlacement], mesh: Sequence[int], coord: Sequence[int]
) -> tuple[int, ...]:
    """The shape the rank at `coord` of a mesh of shape `mesh` holds of a tensor of global
    `shape` laid out by `placements` (one per mesh dim); a 1-D mesh of W ranks is
    `local_shape(shape, (p,), (W,), (rank,))`.

    Mesh dims apply left to right, each splitting what the earlier ones left (DTensor's
    default shard order), torch.chunk-style (`shard_size`). A strided shard `_S(d, sf,
    inner)` splits its dim into sf blocks (torch.chunk-style when sf does not divide the
    dim, as torch's _StridedShard does) and each block's units of `inner` elements over
    the ranks. This is the arithmetic of torch's `_compute_local_shape_and_global_offset`
    (test_placements checks the two agree over every placement kind and uneven sizes),
    done here without building index tensors: the solver's local-shape check calls it
    for every candidate, rank and value. torch's placements go through
    `mesh.lift.local_shape_nd`, which converts them.
    """
    out = list(shape)
    for p, n, c in zip(placements, mesh, coord):
        if isinstance(p, ShardPlaceholder):
            out[p.dim] = shard_size(out[p.dim], n, c)
        elif isinstance(p, StridedShard):
            out[p.dim] = _strided_size(out[p.dim], p, n, c)
    return tuple(out)


def _strided_size(size: int, p: StridedShard, world_size: int, rank: int) -> int:
    if p.inner != 1 or size % p.sf == 0:  # sf blocks of `a` units of `inner`
        return p.sf * shard_size(p.units(size), world_size, rank) * p.inner
    block = -(-size // p.sf)  # torch's _StridedShard on a dim its split factor leaves uneven
    return sum(shard_size(max(0, min(block, size - b * block)), world_size, rank) for b in range(p.sf))

