"""Precision sweep: derive and numerically check every aten op with a decomposition that
torch's OpInfo samples can call — native ops and CompositeImplicitAutograd ones included,
not just the decomp-only set the tests cover. Any claimed rule the checker refutes is a
bug in decompshard (this sweep found two: see git log).

Each op runs in a forked child: the checker runs real CPU kernels on per-rank inputs, and
some kernels (max_pool2d_with_indices_backward with replicated global indices on a local
shard) write out of bounds instead of raising. A crash is reported, not fatal.

    python scripts/precision_sweep.py            # about 2-3 minutes on 2 cores
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def _cases() -> list[tuple]:
    """(op, args, kwargs): dispatch-level ops from the OpInfo capture, plus CIA ops called
    directly with their OpInfo's largest sample."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._pytree import tree_leaves

    from decompshard.coverage.opinfo_samples import capture_aten_samples
    from decompshard.dispatch_modes.tracing import has_decomposition

    def size(x) -> int:
        return sum(t.numel() for t in tree_leaves(x) if isinstance(t, torch.Tensor))

    cases, seen = [], set()
    samples = capture_aten_samples()
    for op in sorted(samples, key=str):
        if has_decomposition(op) and torch.Tag.nondeterministic_seeded not in op.tags:
            s = max(samples[op], key=lambda s: size((s.args, s.kwargs)))
            cases.append((op, s.args, s.kwargs))
            seen.add(op)
    for info in op_db:
        packet = getattr(torch.ops.aten, (info.aten_name or info.name).split(".")[-1], None)
        if packet is None:
            continue
        try:
            ss = sorted(info.sample_inputs_func(info, "cpu", torch.float32, False), key=size, reverse=True)[:1]
        except Exception:
            continue
        for name in packet.overloads():
            op = getattr(packet, name)
            try:
                if op in seen or not op._can_decompose() or torch.Tag.nondeterministic_seeded in op.tags:
                    continue
            except RuntimeError:  # an overload listed but not registered
                continue
            for s in ss:
                args = (s.input, *s.args) if isinstance(s.input, torch.Tensor) else (*s.input, *s.args)
                try:
                    op(*args, **s.kwargs)
                except Exception:
                    continue
                cases.append((op, args, s.kwargs))
                seen.add(op)
    return cases


def _check(op, args, kwargs) -> dict:
    from decompshard import derive_rules
    from decompshard.verify.rule_check import check_rules

    derived = derive_rules(op, *args, **kwargs)
    if derived.unsupported_reason:
        return {"unsupported": derived.unsupported_reason[:100]}
    report = check_rules(op, args, kwargs, derived.rules)
    return {"rules": len(derived.rules), "incorrect": [(str(r), why[:160]) for r, why in report.incorrect]}


def _isolated(fn, timeout: float = 40.0) -> dict | None:
    """`fn()`'s dict in a forked child (decompshard's one process isolator); an exception
    becomes {"error": ...}; None for a crash or a hang past `timeout` seconds."""
    from decompshard.errors import one_line
    from decompshard.isolate import isolated

    status, out = isolated(fn, timeout, describe=lambda e: one_line(e, 150))
    if status == "error":
        return {"error": out}
    return out if status == "ok" else None


def main() -> int:
    cases = _cases()
    print(f"{len(cases)} ops with a decomposition", flush=True)
    incorrect = crashed = derived = 0
    start = time.time()
    for op, args, kwargs in cases:
        out = _isolated(lambda: _check(op, args, kwargs))
        if out is None:
            crashed += 1
            print(f"CRASH/TIMEOUT {op} (in the checker or the kernel; see module docstring)", flush=True)
            continue
        derived += bool(out.get("rules"))
        for rule, why in out.get("incorrect", []):
            incorrect += 1
            print(f"INCORRECT {op}: {rule}: {why}", flush=True)
        if "error" in out:
            print(f"ERROR {op}: {out['error']}", flush=True)
    print(f"{len(cases)} ops, {derived} with derived rules, {incorrect} incorrect rules, "
          f"{crashed} crashed/timed out, {time.time() - start:.0f} s")
    return 1 if incorrect else 0


if __name__ == "__main__":
    sys.exit(main())
