"""Simulate one mesh dim with plain per-rank tensors: the engine under `verify.py`.

A single-dim rule is a claim about what each rank computes when it runs the ORIGINAL op
on its local inputs. We check that claim directly: build each rank's local inputs from
real data, run the op W times, and combine the local outputs as the output placements
say. No DTensor, no process group: ordinary tensors are simpler to trust and ~100x
faster, which matters because ground truth runs the op thousands of times.

Everything here is about *not* being fooled (a wrong rule reported valid is the worst
bug this package can have):

* floating inputs are promoted to float64 (complex to complex128) for the reference and
  for every rank, so a tight tolerance separates rounding from real mismatches;
* Partial parts are random with per-element random magnitudes spanning three decades
  (linear-looking ops that clamp or saturate get pushed past their kinks), several
  independent draws are used, and one extra draw negates the noise of the first
  (P(sum)/P(avg)) or moves every element's "holder" rank and puts exact zeros in the
  other ranks' parts wherever zero is below (P(max)) or above (P(min)) the value;
* P(max)/P(min) parts are strictly smaller/larger than the value on every rank but the
  randomly chosen holder, so index-returning ops (argmax) disagree across ranks;
* besides the caller's data, every rule must also hold on derived samples (ties,
  negated, NaN/inf/0, a lone zero, all zeros: see VARIANTS; integer and bool inputs
  resampled: see `resample_values`) that defeat data on which a wrong rule looks right;
* an input the op changes in place must still match its placement afterwards;
* a derived sample on which the op's kernel disagrees with itself (the same values in
  another memory layout give another result: vectorised vs scalar loops on NaN/inf)
  is dropped with the reason: it cannot tell a right rule from a wrong one.

Safety: local shapes of sharded inputs are first shown to the op's meta kernel, because
a few CPU kernels trust sizes blindly and corrupt the heap (see `OpCase.shape_error`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch

from decompshard._compat import tree_flatten, tree_unflatten

from decompshard.errors import one_line
from decompshard.placements import PARTIALS, MaybePlacement, Partial, R, Replicate, ShardPlaceholder, local_shape, shard_size_and_offset

Draw = tuple[int, bool]  # (random seed, flipped): flipped reuses seed's draw, mirrored
Outputs = list[list[Any]]  # per rank: the flattened leaves of the op's result

_HIGH_DTYPES = {torch.float64, torch.complex128}


def draw_schedule(inputs: Sequence[MaybePlacement], draws: int, seed: int,
                  numels: Sequence[int] = ()) -> tuple[Draw, ...]:
    """Draws to run for these input placements (`numels`: element count per input).

    Replicate/Shard inputs are deterministic, so one draw says everything. With any
    Partial input: `draws - 1` (at least 2) independent draws plus the mirror of the
    first. A Partial input with few elements gives each draw few chances to expose a
    wrong rule (a 0-d remainder(R, P(max)) passed 3 draws by luck), so small ones get
    up to 12 independent draws: about 12 element-draws at least.
    """
    sizes = [n for p, n in zip(inputs, numels) if isinstance(p, Partial)]
    if not any(isinstance(p, Partial) for p in inputs):
        return ((seed, False),)
    n_random = max(int(draws) - 1, 2, min(12, -(-12 // max(1, min(sizes, default=12)))))
    return tuple((seed + k, False) for k in range(n_random)) + ((seed, True),)


def promote(t: torch.Tensor) -> torch.Tensor:
    """float* -> float64, complex* -> complex128; other dtypes unchanged (and detached)."""
    t = t.detach()
    if t.is_complex():
        return t.to(torch.complex128)
    if t.dtype.is_floating_point:
        return t.to(torch.float64)
    return t


def input_alphabet(t: torch.Tensor) -> tuple[MaybePlacement, ...]:
    """Candidate placements of an input: Partial only for float (max/min not complex)."""
    shards = tuple(ShardPlaceholder(d) for d in range(t.dim()))
    if t.is_complex():
        return (R, *shards, Partial("sum"), Partial("avg"))
    if t.dtype.is_floating_point:
        return (R, *shards, *PARTIALS)
    return (R, *shards)


def output_partials(dtype: torch.dtype) -> tuple[str, ...]:
    """Reduce ops an output of `dtype` can be pending: none for bool, no avg for ints
    (DTensor has no integer average), no max/min for complex (not ordered)."""
    if dtype == torch.bool:
        return ()
    if dtype.is_complex:
        return ("sum", "avg")
    if dtype.is_floating_point:
        return ("sum", "avg", "max", "min")
    return ("sum", "max", "min")


def output_alphabet(ref: Any) -> tuple[MaybePlacement, ...]:
    if not isinstance(ref, torch.Tensor):
        return (None,)
    shards = tuple(ShardPlaceholder(d) for d in range(ref.dim()))
    return (R, *shards, *(Partial(op) for op in output_partials(ref.dtype)))


# ------------------------------------------------------------------ local inputs


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0, neginf=0.0)


_GRID_BITS = 18  # log2 of (largest |part| / |value| + 1) * ranks the exact grid leaves room for


def _grid(mag: torch.Tensor) -> torch.Tensor:
    """Per element, the power of two every part of a P(sum)/P(avg) value is a multiple
    of: coarse enough that the parts (at most 1000x the value, up to 64 ranks) and every
    partial sum of them fit float64's 53 bits, so any reduction order is exact."""
    return torch.exp2(torch.ceil(torch.log2(mag * 2.0**_GRID_BITS)) - 52)


def on_exact_grid(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded onto the grid `make_parts` splits P(sum)/P(avg) values on (finite
    floats; complex per component; other dtypes unchanged). Why: a check that builds a
    Partial input from `x` compares with one device run on `x`; with `x` on the grid the
    ranks' reduction gives `x` bit for bit, so an op whose output depends on every bit
    (hash_tensor) is judged on its rule, not on the last bit of a reduction."""
    if x.is_complex():
        return torch.complex(on_exact_grid(x.real), on_exact_grid(x.imag))
    if not x.dtype.is_floating_point or x.dtype != torch.float64:
        return x
    q = _grid(_finite_abs(x) + 1.0)
    # + 0.0 turns -0.0 into 0.0: parts summing to zero give +0.0, and a hash tells them apart
    return torch.where(torch.isfinite(x), torch.round(x / q) * q + 0.0, x)


def _noise(shape: tuple, mag: torch.Tensor, g: torch.Generator, complex_: bool) -> torch.Tensor:
    """Random parts of per-element magnitude 0.1x to 100x `mag`, on `_grid(mag)`."""
    decades = 10.0 ** torch.empty(shape, dtype=torch.float64).uniform_(-1, 2, generator=g)
    noise = torch.randn(shape, dtype=torch.float64, generator=g) * decades
    if complex_:
        noise = torch.complex(noise, torch.randn(noise.shape, dtype=torch.float64, generator=g) * decades)
        return torch.complex(_on(noise.real, mag), _on(noise.imag, mag))
    return _on(noise, mag)


def _on(noise: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    q = _grid(mag)
    return torch.round(noise.clamp(-1000, 1000) * mag / q) * q


def make_parts(x: torch.Tensor, p: Partial, world_size: int, draw: Draw, salt: int) -> list[torch.Tensor]:
    """Per-rank parts whose `p.reduce_op` over ranks is `x`: exactly, in any order, for
    values `on_exact_grid` (max/min always), else up to rounding. Each part has its own
    storage laid out like `x`, as a rank's tensor would: an op that reads storage
    positions (as_strided_copy) sees what it would see on one device."""
    seed, flipped = draw
    g = torch.Generator().manual_seed((seed * 1_000_003 + salt * 7_919 + world_size) % 2**62)
    W, op, shape = world_size, p.reduce_op, x.shape
    is_int = not (x.dtype.is_floating_point or x.is_complex())
    if is_int:
        if x.dtype == torch.bool:
            raise ValueError("Partial is not defined for bool tensors")
        xi = x.to(torch.int64)
        m = int(xi.abs().max()) + 2 if x.numel() else 2
    else:
        xi = x
        mag = _finite_abs(x) + 1.0
    if op in ("sum", "avg"):
        target = xi * W if op == "avg" else xi
        if is_int:
            noise = torch.randint(-m, m + 1, (W - 1, *shape), generator=g)
        else:
            noise = _noise((W - 1, *shape), mag, g, x.is_complex())
        if flipped:
            noise = -noise
        parts = [target - noise.sum(0), *noise.unbind(0)]
    else:
        holder = torch.randint(0, W, shape, generator=g)
        if flipped:
            holder = (holder + 1) % W
        if is_int:
            off = torch.randint(1, m + 1, (W, *shape), generator=g)
        else:
            finite = x[torch.isfinite(x)]
            spread = float(finite.max() - finite.min()) if finite.numel() else 0.0
            decades = 10.0 ** torch.empty((W, *shape), dtype=torch.float64).uniform_(-2, 1, generator=g)
            off = (mag + spread) * decades
        sign = -1 if op == "max" else 1
        others = xi + sign * off
        if flipped:  # where zero lies on the far side of the value, the others hold 0:
            # count_nonzero(P(max)) -> P(min) looks valid as long as no part is zero
            others = torch.where(sign * xi < 0, torch.zeros_like(others), others)
        parts = [torch.where(holder == r, xi, others[r]) for r in range(W)]
    return [torch.empty_like(x).copy_(q) for q in parts]


def make_local(x: torch.Tensor, p: MaybePlacement, world_size: int, draw: Draw, salt: int) -> list[torch.Tensor]:
    """What each rank holds of `x` under placement `p` (torch.chunk layout for S(d))."""
    if isinstance(p, Replicate):
        return [x] * world_size
    if isinstance(p, ShardPlaceholder):
        out = []
        for r in range(world_size):
            size, off = shard_size_and_offset(x.shape[p.dim], world_size, r)
            out.append(x.narrow(p.dim, off, size).clone(memory_format=torch.contiguous_format))
        return out
    if isinstance(p, Partial):
        return make_parts(x, p, world_size, draw, salt)
    raise ValueError(f"input placement {p!r} is not R, S(d) or P(op)")


# ------------------------------------------------------------------ comparisons


def _tolerances(dtype: torch.dtype) -> tuple[float, float, float]:
    """(rtol, atol per unit of |reference|, atol per unit of |local values|).

    float64 compares tightly; an op that forces a lower-precision output dtype (a
    `dtype=` argument) gets a few ulps of that dtype: rounding W parts costs about
    W/2 ulps of the largest part, hence the |local| term.
    """
    if dtype in _HIGH_DTYPES:
        return 1e-6, 1e-8, 1e-12
    eps = torch.finfo(dtype).eps
    return 8 * eps, 8 * eps, 16 * eps


def _max_abs(ts: Sequence[torch.Tensor]) -> float:
    m = 0.0
    for t in ts:
        if t.numel():
            m = max(m, float(_finite_abs(t.to(torch.complex128 if t.is_complex() else torch.float64)).max()))
    return m


def close(actual: torch.Tensor, expected: torch.Tensor, locals_: Sequence[torch.Tensor],
          dtype: torch.dtype | None = None) -> bool:
    """Exact for integer/bool; tolerance for float/complex (by the op's output `dtype`,
    default `expected.dtype`); NaN must match NaN."""
    if actual.shape != expected.shape:
        return False
    if not (expected.dtype.is_floating_point or expected.is_complex()):
        return torch.equal(actual, expected)
    rtol, tol_ref, tol_loc = _tolerances(dtype or expected.dtype)
    atol = tol_ref * (_max_abs([expected]) + 1.0)
    if locals_:  # only for sums of parts: never let huge parts loosen max/min or R/S checks
        atol += tol_loc * _max_abs(locals_)
    hi = torch.complex128 if expected.is_complex() else torch.float64
    return torch.allclose(actual.to(hi), expected.to(hi), rtol=rtol, atol=atol, equal_nan=True)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def leaves_equal(a: list[Any], b: list[Any]) -> bool:
    """Exact (NaN-aware) equality of two flattened results; used for reproducibility."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.dtype.is_floating_point or x.is_complex():
                if not torch.allclose(x, y, rtol=0, atol=0, equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
        elif not _same_value(x, y):
            return False
    return True


def _reduce(stack: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.sum(0) / stack.shape[0]
    if stack.dtype in (torch.uint16, torch.uint32, torch.uint64):
        # no amax/amin kernel for these (hash_tensor's uint64 output): reduce in int64,
        # uint64 with its top bit flipped so that signed order is unsigned order
        flip = torch.iinfo(torch.int64).min
        wide = stack.view(torch.int64) ^ flip if stack.dtype == torch.uint64 else stack.to(torch.int64)
        out = wide.amax(0) if op == "max" else wide.amin(0)
        return (out ^ flip).view(torch.uint64) if stack.dtype == torch.uint64 else out.to(stack.dtype)
    return stack.amax(0) if op == "max" else stack.amin(0)


def check_output(ref: Any, locs: Sequence[Any], q: MaybePlacement, world_size: int,
                 partial_where_finite: bool = False) -> str | None:
    """Why the per-rank values `locs` do NOT combine under `q` into `ref`; None if they do.

    `partial_where_finite`: judge a Partial output only where `ref` is finite (on data
    with inf, IEEE arithmetic does not distribute: inf - inf is NaN even for sums).
    """
    if not isinstance(ref, torch.Tensor):
        if q is not None:
            return f"is not a tensor ({type(ref).__name__}), so its placement must be None"
        for r, v in enumerate(locs):
            if not _same_value(v, ref):
                return f"rank {r} returned {v!r}, single-device result is {ref!r}"
        return None
    if q is None:
        return "is a tensor, placement None claims it is not"
    for r, v in enumerate(locs):
        if not isinstance(v, torch.Tensor):
            return f"rank {r} returned {type(v).__name__}, expected a tensor"
        if v.dtype != ref.dtype:
            return f"rank {r} returned dtype {v.dtype}, single-device result has {ref.dtype}"
    if isinstance(q, Replicate):
        for r, v in enumerate(locs):
            if v.shape != ref.shape:
                return f"R: rank {r} has shape {tuple(v.shape)}, expected {tuple(ref.shape)}"
            if not close(v, ref, ()):
                return f"R: rank {r}'s values differ from the single-device result"
        return None
    if isinstance(q, ShardPlaceholder):
        if q.dim >= ref.dim():
            return f"S({q.dim}) is out of range for a {ref.dim()}-d output"
        for r, v in enumerate(locs):
            size, off = shard_size_and_offset(ref.shape[q.dim], world_size, r)
            want = ref.narrow(q.dim, off, size)
            if v.shape != want.shape:
                return f"{q}: rank {r} has shape {tuple(v.shape)}, its chunk is {tuple(want.shape)}"
            if not close(v, want, ()):
                return f"{q}: rank {r}'s values differ from its chunk of the result"
        return None
    if isinstance(q, Partial):
        if q.reduce_op not in output_partials(ref.dtype):
            return f"{q} is not defined for {ref.dtype} outputs"
        for r, v in enumerate(locs):
            if v.shape != ref.shape:
                return f"{q}: rank {r} has shape {tuple(v.shape)}, expected {tuple(ref.shape)}"
        hi = ref.dtype
        if ref.dtype.is_floating_point:
            hi = torch.float64
        elif ref.is_complex():
            hi = torch.complex128
        elif q.reduce_op == "sum":
            hi = torch.int64
        red = _reduce(torch.stack([v.to(hi) for v in locs]), q.reduce_op)
        summed = list(locs) if q.reduce_op in ("sum", "avg") else ()
        want = ref.to(hi)
        if partial_where_finite and (ref.dtype.is_floating_point or ref.is_complex()):
            keep = torch.isfinite(want)
            red, want, summed = red[keep], want[keep], [v[keep] for v in summed]
        if not close(red, want, summed, ref.dtype):
            return f"{q}: reduction over ranks differs from the single-device result"
        return None
    return f"unknown placement {q!r}"


# ------------------------------------------------------------------ the op under test


def _tie_values(x: torch.Tensor, i: int) -> torch.Tensor:
    """Sign-preserving values in {-2, -1, 1, 2}: equal elements across inputs happen."""
    def q(v: torch.Tensor) -> torch.Tensor:
        return torch.where(v >= 0, 1.0, -1.0).to(v.dtype) * (1 + (v.abs() > 0.7).to(v.dtype))
    return torch.complex(q(x.real), q(x.imag)) if x.is_complex() else q(x)


def _special_values(x: torch.Tensor, i: int) -> torch.Tensor:
    """NaN, +inf, -inf on odd flat positions; zeros on even ones: every 4th in all inputs
    (logical_or(0, 0)) and every 8th, offset by input, in one input only (and(0, 1))."""
    k = torch.arange(x.numel()).reshape(x.shape)
    odd = (k + 2 * i) % 6
    zero = (k % 4 == 0) | (k % 8 == (2 if i % 2 == 0 else 6))
    out = torch.where(zero, torch.zeros_like(x), x)
    out = torch.where(odd == 1, torch.full_like(x, float("nan")), out)
    return torch.where(odd == 3, float("inf"), torch.where(odd == 5, float("-inf"), out))


# name -> (transform of each floating input, judge Partial outputs only where finite).
# On the special-values sample inf parts summed with mixed signs give NaN even for linear
# ops, and x / 0 does not distribute over parts; finite positions must still agree. The
# sample is there for outputs whose value ignores Partial inputs on ordinary data:
# isnan(P(sum)) -> R, logical_or(R, P(sum)) -> R, heaviside(R, P(sum)) -> P(avg).
def _lone_zero(x: torch.Tensor, i: int) -> torch.Tensor:
    """One zero, at the last element: it lies in the last non-empty shard along every
    dim, so a shard without a zero sits beside one with it (all(S(d)) -> R looks valid
    when every shard, or none, holds a zero)."""
    out = x.clone()  # keeps x's strides: some ops read them
    if out.numel():
        out[(-1,) * out.dim()] = 0
    return out


VARIANTS: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], bool]] = {
    "ties": (_tie_values, False),  # eq(P(sum), R) -> R looks valid when nothing is equal
    "negated": (lambda x, i: -x, False),  # mul(P(max), R) -> P(max) looks valid if R >= 0
    "special": (_special_values, True),
    "lone zero": (_lone_zero, True),  # a zero can make a matrix singular (lu_solve: inf)
    # count_nonzero(P(max)) -> P(min) looks valid while at most one element is zero
    "zeros": (lambda x, i: torch.zeros_like(x), True),
}


def resample_values(x: torch.Tensor, i: int) -> torch.Tensor:
    """An integer or bool input with new values: bools fair coin flips, integers drawn
    with replacement from the values the tensor already holds (so every element stays
    a value the op accepted, e.g. an in-range index, while duplicates and new orders
    appear). Strategies are chosen per metadata, not per value: a rule that holds only
    because an index is a permutation (index_copy overwrites every row) or a mask is
    all True is not a rule."""
    g = torch.Generator().manual_seed(7_919 * (i + 1))
    if x.numel() == 0:
        return x.clone()
    if x.dtype == torch.bool:
        return torch.rand(x.shape, generator=g) < 0.5
    pool = x.reshape(-1)
    return pool[torch.randint(0, pool.numel(), x.shape, generator=g)].to(x.dtype)


class Sample:
    """One set of input values with its single-device reference and local-input cache."""

    def __init__(self, name: str, leaves: list[Any], ref_all: list[Any], inputs: list[torch.Tensor],
                 partial_where_finite: bool = False, n_mutated: int = 0):
        self.name, self.leaves, self.ref_all, self.inputs = name, leaves, ref_all, inputs
        self.partial_where_finite = partial_where_finite
        self.ref_leaves = ref_all[: len(ref_all) - n_mutated]  # the op's result, flattened
        self.cache: dict[tuple, list[torch.Tensor]] = {}


class OpCase:
    """One op call (op, args, kwargs) prepared for rank simulation.

    `samples[0]` is the caller's data (floating inputs promoted). Further samples derive
    from it (see VARIANTS) and guard against data that makes a wrong rule look right; a
    rule is valid only if it holds on every sample. A variant is dropped (and listed in
    `dropped`) when the op raises on it, is not reproducible on it, or returns a
    differently structured result.
    """

    def __init__(self, op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None,
                 *, variants: bool = True):
        self.op = op
        self.untestable: str | None = None
        self.dropped: list[str] = []
        leaves, self.spec = tree_flatten((tuple(args), dict(kwargs or {})))
        self.tensor_pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.n_mutated = len(self.tensor_pos)  # every call also returns its inputs, after
        self.mutated: list[int] = []  # tensor inputs some reference call changed in place
        self._meta_trusted: bool | None = None
        self._reads_strides = _takes_strides(op)
        self._probe_layouts = False  # set once the base sample is in (never for it)
        self._meta_verdicts: dict[tuple, str | None] = {}
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            self.untestable = f"{op} is random (nondeterministic_seeded): no ground truth"
            self.samples = [Sample("base", leaves, [], [leaves[i] for i in self.tensor_pos])]
            self.inputs = self.samples[0].inputs
            return
        promoted = [promote(v) if isinstance(v, torch.Tensor) else v for v in leaves]
        base = self._sample("base", promoted)
        if isinstance(base, str):  # float64 unsupported? retry with the caller's dtypes
            base = self._sample("base", [v.detach() if isinstance(v, torch.Tensor) else v for v in leaves])
        if isinstance(base, str):
            self.untestable = f"the op cannot be checked on the given inputs: {base}"
            base = Sample("base", leaves, [], [leaves[i] for i in self.tensor_pos])
        self.samples = [base]
        self.inputs = base.inputs
        if self.untestable or not variants:
            return
        # the layout probe is trusted only for a kernel that handles the other layout
        # on the caller's data (see _layout_dependence)
        self._probe_layouts = self._layout_dependence(base.leaves, base.ref_all) is None
        floats = [i for i, x in enumerate(self.inputs) if x.dtype.is_floating_point or x.is_complex()]
        discrete = [i for i in range(len(self.inputs)) if i not in floats]
        plans = [(name, fn, where_finite, floats) for name, (fn, where_finite) in VARIANTS.items()]
        plans.append(("resampled", resample_values, False, discrete))
        for name, fn, where_finite, which in plans:
            if not which:
                continue
            new = list(base.leaves)
            try:
                for i in which:
                    new[self.tensor_pos[i]] = fn(self.inputs[i], i)
            except Exception as e:  # a variant we cannot build is dropped, never fatal
                self.dropped.append(f"{name}: could not derive it: {one_line(e, 160)}")
                continue
            s = self._sample(name, new, where_finite)
            if isinstance(s, str) or not _same_structure(s.ref_all, base.ref_all):
                self.dropped.append(f"{name}: {s if isinstance(s, str) else 'result structure differs'}")
            else:
                self.samples.append(s)

    def _sample(self, name: str, leaves: list[Any], where_finite: bool = False) -> Sample | str:
        try:
            ref = self._call(leaves)
            if not leaves_equal(ref, self._call(leaves)):
                return "results differ between identical calls"
        except Exception as e:
            return one_line(e, 160)
        if self._probe_layouts:
            why = self._layout_dependence(leaves, ref)
            if why:
                return why
        after = ref[len(ref) - self.n_mutated:]
        for i, pos in enumerate(self.tensor_pos):
            if i not in self.mutated and not leaves_equal([after[i]], [leaves[pos]]):
                self.mutated.append(i)
        return Sample(name, leaves, ref, [leaves[i] for i in self.tensor_pos], where_finite, self.n_mutated)

    def _layout_dependence(self, leaves: list[Any], ref: list[Any]) -> str | None:
        """Why these values cannot witness any rule, or None: the op's kernel gives a
        different result on the same values in another memory layout (every tensor
        input copied into a buffer with gaps, or made contiguous if it was not: `_relaid`).

        CPU kernels run a vectorised loop over the bulk of a contiguous tensor and a
        scalar loop over its tail and over strided tensors, and the two do not always
        agree on NaN/inf (hardtanh_backward(-inf grad, NaN self) is 0 vectorised, -inf
        scalar). A rank's shard puts elements at other positions than the global
        tensor, so the same element can take the other loop: one device disagreeing
        with itself, not a wrong rule. Only derived samples are judged this way, and
        only when the kernel agrees with itself on the caller's data: some kernels
        ignore strides (CPU native_group_norm_backward reads any input as contiguous)
        and give garbage in the other layout whatever the values, which says nothing
        about the contiguous shards ranks hold. A kernel that refuses the other layout
        (a view) proves nothing either way; ops that take strides as an argument
        (as_strided) read memory layout by definition and are not probed."""
        if self._reads_strides:
            return None
        moved = list(leaves)
        for pos in self.tensor_pos:
            moved[pos] = _relaid(leaves[pos])
        try:
            other = self._call(moved, copy=False)  # clone() would make them contiguous again
        except Exception:
            return None
        if len(other) != len(ref) or all(_same_result(a, b) for a, b in zip(ref, other)):
            return None
        return ("the kernel's result on these values depends on memory layout (contiguous vs "
                "strided inputs): one device disagrees with itself, so they cannot witness a rule")

    @property
    def ref_leaves(self) -> list[Any]:
        return self.samples[0].ref_leaves

    def _call(self, leaves: list[Any], *, copy: bool = True) -> list[Any]:
        """The flattened result, followed by every tensor input as it is after the call.

        Inputs are copied first (unless the caller passes fresh ones, `copy=False`):
        schemas do not always admit mutation (legacy native_batch_norm updates running
        stats in place), and the caches must survive.
        """
        if copy:
            leaves = [v.clone() if isinstance(v, torch.Tensor) else v for v in leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.op(*args, **kwargs)
        return tree_flatten(out)[0] + [leaves[i] for i in self.tensor_pos]

    def rule_error(self, inputs: Sequence[MaybePlacement], outputs: Sequence[MaybePlacement]) -> str | None:
        """Why a rule cannot even be simulated here (wrong arity, bad dims); None if fine."""
        if len(inputs) != len(self.inputs):
            return f"rule has {len(inputs)} input placements, the op call has {len(self.inputs)} tensor inputs"
        if len(outputs) != len(self.ref_leaves):
            return f"rule has {len(outputs)} output placements, the op returns {len(self.ref_leaves)} values"
        for i, (p, x) in enumerate(zip(inputs, self.inputs)):
            if p is None:
                return f"input {i} is a tensor, placement None is not allowed for inputs"
            if isinstance(p, ShardPlaceholder) and p.dim >= x.dim():
                return f"input {i}: {p} is out of range for a {x.dim()}-d tensor"
            if isinstance(p, Partial) and (x.dtype == torch.bool or (x.is_complex() and p.reduce_op in ("max", "min"))):
                return f"input {i}: {p} is not defined for a {x.dtype} tensor"
        return None

    def sharded_sizes(self, inputs: Sequence[MaybePlacement]) -> list[int]:
        return [int(x.shape[p.dim]) for p, x in zip(inputs, self.inputs) if isinstance(p, ShardPlaceholder)]

    def _meta_call(self, shapes: Sequence[Sequence[int]]) -> str | None:
        """Run the op on meta tensors of these input shapes; the error text, or None."""
        leaves = list(self.samples[0].leaves)
        for pos, x, shape in zip(self.tensor_pos, self.inputs, shapes):
            leaves[pos] = torch.empty(tuple(shape), dtype=x.dtype, device="meta")
        try:
            self._call(leaves)
        except Exception as e:
            return one_line(e, 160)
        return None

    def shape_error(self, inputs: Sequence[MaybePlacement], world_size: int) -> str | None:
        """Why some rank's local shapes are unacceptable to the op, checked on meta tensors.

        Some CPU kernels trust their size arguments (native_batch_norm with a sharded
        running_mean writes past the buffer and corrupts the heap), so sharded inputs
        are shown to the op's meta kernel before any real call. Used only when the meta
        kernel accepts the global shapes (otherwise it says nothing about local ones).
        """
        if not any(isinstance(p, ShardPlaceholder) for p in inputs):
            return None
        if self._meta_trusted is None:
            self._meta_trusted = self._meta_call([x.shape for x in self.inputs]) is None
        if not self._meta_trusted:
            return None
        for r in range(world_size):
            shapes = tuple(local_shape(x.shape, (p,), (world_size,), (r,)) for x, p in zip(self.inputs, inputs))
            if shapes not in self._meta_verdicts:
                self._meta_verdicts[shapes] = self._meta_call(shapes)
            if self._meta_verdicts[shapes]:
                return f"the op rejects rank {r}'s local shapes {list(shapes)}: {self._meta_verdicts[shapes]}"
        return None

    def run(self, sample: Sample, inputs: Sequence[MaybePlacement], world_size: int, draw: Draw) -> Outputs | str:
        """Each rank's flattened result on `sample`, or a string saying why ranks failed."""
        bad_shapes = self.shape_error(inputs, world_size)
        if bad_shapes:
            return bad_shapes
        locals_ = []
        for i, p in enumerate(inputs):
            key = (i, p, world_size, draw if isinstance(p, Partial) else None)
            if key not in sample.cache:
                sample.cache[key] = make_local(sample.inputs[i], p, world_size, draw, salt=i)
            locals_.append(sample.cache[key])
        outs: Outputs = []
        for r in range(world_size):
            leaves = list(sample.leaves)
            for i, pos in enumerate(self.tensor_pos):
                leaves[pos] = locals_[i][r]
            try:
                res = self._call(leaves)
            except Exception as e:
                return f"the op raises on rank {r}'s local inputs: {one_line(e, 160)}"
            if len(res) != len(sample.ref_all):
                return f"rank {r} returned {len(res)} values, the single-device call {len(sample.ref_all)}"
            outs.append(res)
        return outs


def _relaid(x: Any) -> Any:
    """The same values in another memory layout: a non-contiguous tensor made
    contiguous; a contiguous one copied into a larger buffer with gaps, so that
    elementwise kernels can no longer treat it as one flat run (their vectorised loop
    then covers other elements). The last dim stays dense where there are two or more
    dims (rows spaced apart): some kernels assume it without checking (CPU flash
    attention's backward reads garbage from a last dim of stride 2); a 1-d tensor
    takes every other element."""
    if not isinstance(x, torch.Tensor):
        return x
    if not x.is_contiguous():
        return x.contiguous()
    if x.dim() >= 2:
        n = x.shape[-1]
        return torch.empty((*x.shape[:-1], 2 * n), dtype=x.dtype)[..., :n].copy_(x)
    return torch.empty((*x.shape, 2), dtype=x.dtype)[..., 0].copy_(x)


def _same_result(a: Any, b: Any) -> bool:
    """Equal up to the checker's tolerance (`close`, NaN equal to NaN); non-tensors exactly."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and close(b, a, ())
    return _same_value(a, b)


def _takes_strides(op: Any) -> bool:
    """Whether the op has a `stride` argument (as_strided, _reshape_alias, empty_strided):
    its values depend on memory layout by definition."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.name == "stride" for a in schema.arguments)


def _same_structure(a: list[Any], b: list[Any]) -> bool:
    """Same leaf count, and tensors (of equal rank and dtype) in the same places."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.dim() != y.dim() or x.dtype != y.dtype):
            return False
    return True
