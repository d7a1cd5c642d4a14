"""Which of an op's samples to keep: a few good ones that differ from each other.

An op's rules show only on samples that can separate them: a 0-d or all-size-1 tensor makes
many wrong shardings look right and many right ones untestable, and one value of a
non-tensor argument (`p`, `right`, `reduce`, ...) shows only that value's rules (pdist's
p = 2 has no partial-sum rule, p = 1 has one). OpInfo sample generators list their cheap,
degenerate cases first, so "the first k distinct samples" can be all degenerate
(searchsorted's first ones all have 0-d values). Both the capture (`opinfo_samples`, which
keeps a few samples per overload) and the sweep (`sweep.pick_samples`, which derives on
the best of those) choose with `pick_diverse`:

1. a sample that passes tensors, all of rank >= 1 and one with a dim > 1, beats any that
   does not (a 0-d or all-size-1 sample shows no sharding);
2. then a cheap one beats any other: at most `MAX_TENSORS` tensors holding at most
   `BUDGET_BYTES` (storage included: a view keeps its base). Bigger shows no more rules,
   only costs the capture's disk file and the sweep's time (grid_sampler_3d's largest
   OpInfo sample is 20 MB; _chunk_cat's 5-tensor one takes the sweep's 60 s to derive);
3. then one that adds something no chosen sample has: a non-tensor argument value (by
   schema name, defaults filled in: `dim`, `p`, `reduce` change what the op computes) or
   a tuple of tensor ranks (batched and unbatched calls take different paths);
4. then the larger: more dims of size > 1 over its tensors, then more elements (a new
   value on a 1-d tensor shows less than the same on a 3-d one);
5. ties keep the given order (deterministic).

Greedy (each pick sees the ones before it), so the first pick is the best sample outright
and each later one the best that adds something new. No per-op cases.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch

from decompshard._compat import keystr, tree_flatten, tree_flatten_with_path

__all__ = ["BUDGET_BYTES", "MAX_TENSORS", "features", "pick_diverse", "sample_bytes", "sample_score"]

T = TypeVar("T")
BUDGET_BYTES = 1 << 18  # 256 KiB: OpInfo's usual samples (sizes S, M, L) fit; the few huge ones do not
MAX_TENSORS = 4  # ops with more inputs (index lists) still get theirs, after any smaller sample
ArgsOf = Callable[[Any], tuple[tuple, dict]]


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def sample_score(args: tuple, kwargs: dict) -> tuple[bool, bool, int, int]:
    """Bigger is better: has a tensor input, every tensor has rank >= 1 and some dim is > 1,
    most dims of size > 1 (summed over the tensors), most elements. Large non-degenerate
    samples separate more candidate rules."""
    ts = _tensors(args, kwargs)
    big_dims = sum(1 for t in ts for d in t.shape if d > 1)
    return (bool(ts), bool(ts) and all(t.ndim >= 1 for t in ts) and big_dims > 0, big_dims, sum(t.numel() for t in ts))


def _by_name(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in: the dispatcher drops an
    argument left at its default (torch.pdist(x) and torch.pdist(x, 2.0) both reach
    `_pdist_forward(x)`), so by position an omitted p = 2 would not count as a value."""
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def sample_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes a sample carries: each distinct storage its tensors use, whole (a view's
    base is cloned and kept with it)."""
    storages: dict[int, int] = {}
    for t in _tensors(args, kwargs):
        try:
            st = t.untyped_storage()
            storages[st.data_ptr() or id(st)] = st.nbytes()
        except Exception:  # noqa: BLE001 - no plain storage: count its elements
            storages[id(t)] = t.numel() * t.element_size()
    return sum(storages.values())


def features(args: tuple, kwargs: dict, op: Any = None) -> tuple[tuple[int, ...], frozenset[tuple[str, str]]]:
    """(tensor ranks, {(argument, repr of value)} of the non-tensor arguments): what makes
    two samples of one op show different rules. With the op, arguments are named by its
    schema with defaults filled in; without it (or when binding fails), by position."""
    tree: Any = (tuple(args), dict(kwargs))
    if op is not None and hasattr(op, "_schema"):
        try:
            tree = _by_name(op, tuple(args), dict(kwargs))
        except Exception:  # noqa: BLE001 - an odd schema: positions still tell values apart
            pass
    leaves = tree_flatten_with_path(tree)[0]
    ranks = tuple(x.ndim for _, x in leaves if isinstance(x, torch.Tensor))
    values = frozenset((keystr(path), repr(x)) for path, x in leaves if not isinstance(x, torch.Tensor))
    return ranks, values


def pick_diverse(samples: Sequence[T], k: int | None, args_of: ArgsOf | None = None) -> list[T]:
    """The k samples chosen greedily by the module's criterion, in pick order (best first).

    `args_of(sample) -> (args, kwargs)`; by default the sample's `.args`/`.kwargs`
    (an `AtenSample`, whose `.op` names the arguments). k None or >= len(samples): all of
    them, best first."""
    get = args_of or (lambda s: (s.args, s.kwargs))
    rows = []
    for s in samples:
        a, kw = get(s)
        cheap = len(_tensors(a, kw)) <= MAX_TENSORS and sample_bytes(a, kw) <= BUDGET_BYTES
        rows.append((sample_score(a, kw), cheap, *features(a, kw, getattr(s, "op", None))))
    left = list(range(len(samples)))
    ranks_seen: set[tuple[int, ...]] = set()
    values_seen: set[tuple[str, str]] = set()
    picked: list[int] = []
    n = len(samples) if k is None else min(k, len(samples))
    while len(picked) < n:
        def key(i: int) -> tuple:
            score, cheap, ranks, values = rows[i]
            new = not values <= values_seen or ranks not in ranks_seen
            return (score[:2], cheap, new, score[2:], -i)

        best = max(left, key=key)
        left.remove(best)
        picked.append(best)
        ranks_seen.add(rows[best][2])
        values_seen |= rows[best][3]
    return [samples[i] for i in picked]
