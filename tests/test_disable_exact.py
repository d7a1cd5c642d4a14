"""`disable()` leaves DTensor as the same program would have left it without decompshard.

The workload (tests/_dtensor_state.py: a derived op, `block_diag`'s `Tensor[]`, SDPA
with a keyword mask, ops the guard wraps, in-place ops, an uneven view, `.item()`) runs
in two fresh processes, once without decompshard and once inside `enable()` ...
`disable()`; each describes how DTensor's state changed (every table's keys and whether
each value is the object it was, every schema-info object's fields, the propagator's,
dispatcher's and fallback's instance attributes, the patched classes' attributes).

Torch fills one table lazily by itself: its decomposition fallback registers an op's
`op_to_schema_info` entry (its sharding-cache key) on the op's first call, and for every
op it meets while tracing a decomposition (`matmul` inside SDPA's math). Under
decompshard torch's fallback never traces, so those inner ops' entries are not made;
an entry made on one side only must be exactly torch's own (what torch would register
on the op's first call), never decompshard's (`needs_pytree` set, an op torch cannot
decompose). Every other change, and every entry both sides made, must match.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _dtensor_state as state
import decompshard
from decompshard.runtime.fences import guard

SCRIPT = Path(__file__).with_name("_dtensor_state.py")


@pytest.fixture(autouse=True)
def _disabled():
    decompshard.disable()
    yield
    decompshard.disable()
    guard.uninstall()


def _no_changes(before: dict) -> dict:
    """Every table's changes since `before`, the empty ones left out."""
    found = state.changes(before, state.capture())
    fields = {name: found.pop(f"{name} fields") for name in state.SCHEMA_INFOS}
    was = {name: {str(k): repr(dataclasses.asdict(v)) for k, v in sorted(before[name].items(), key=str)}
           for name in state.SCHEMA_INFOS}
    changed = {name: diff for name, diff in found.items() if diff}
    changed.update({f"{name} fields": "changed" for name in state.SCHEMA_INFOS if fields[name] != was[name]})
    return changed


def test_disable_leaves_dtensor_as_the_workload_without_decompshard():
    env = {k: v for k, v in os.environ.items() if k not in ("DECOMPSHARD_ENABLE", guard.ENV)}
    procs = {mode: subprocess.Popen([sys.executable, str(SCRIPT), mode], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for mode in ("plain", "decompshard")}
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        out[mode] = json.loads(stdout)
    plain, ours = out["plain"], out["decompshard"]

    assert ours["during"] == {"block_diag needs_pytree": True}  # the workload reached what is undone
    assert ours["results"] == plain["results"]  # DTensor's own behaviour after disable(), caches included
    lazily = state.SCHEMA_INFOS[0]
    for name in plain["changes"]:
        if not name.startswith(lazily):
            assert ours["changes"][name] == plain["changes"][name], name
    for key in ("", " fields"):
        p, o = plain["changes"][lazily + key], ours["changes"][lazily + key]
        assert {k: o[k] for k in o.keys() & p.keys()} == {k: p[k] for k in o.keys() & p.keys()}, key
        one_side = {k: "plain" for k in p.keys() - o.keys()} | {k: "decompshard" for k in o.keys() - p.keys()}
        assert all(k in (plain if side == "plain" else ours)["torch_inferred"] for k, side in one_side.items()), \
            one_side
    assert not any("needs_pytree': True" in v for v in ours["changes"][lazily].values())


def test_enable_enable_without_the_guard_then_disable_leaves_nothing():
    before = state.capture()
    decompshard.enable()
    decompshard.enable(guard_native=False)
    assert decompshard.is_enabled() and not guard.is_installed()
    decompshard.enable(guard_native=True)
    decompshard.disable()
    assert _no_changes(before) == {}
    assert not decompshard.is_enabled() and not guard.is_installed()


def test_the_guard_taken_out_alone_leaves_enable_and_then_nothing():
    before = state.capture()
    guard.install()  # the guard alone, then decompshard over it
    decompshard.enable()
    guard.uninstall()  # under enable()'s entries: they come out and go back
    assert decompshard.is_enabled() and not guard.is_installed()
    assert isinstance(state.DTensor._op_dispatcher.sharding_propagator.decomp_strategy,
                      decompshard.runtime.derived.DerivedStrategy)
    decompshard.disable()
    assert _no_changes(before) == {}


@pytest.mark.parametrize("context", ["switched(True)", "switched(False)", "enabled()", "enabled(False)"])
@pytest.mark.parametrize("found", ["disabled", "guard alone", "enabled", "enabled without the guard"])
def test_switched_and_enabled_restore_decompshard_and_the_guard_as_found(monkeypatch, context, found):
    from decompshard.runtime.enable import switched

    monkeypatch.delenv(guard.ENV, raising=False)
    setup = {"disabled": lambda: None, "guard alone": guard.install, "enabled": decompshard.enable,
             "enabled without the guard": lambda: decompshard.enable(guard_native=False)}
    blocks = {"switched(True)": lambda: switched(True), "switched(False)": lambda: switched(False),
              "enabled()": decompshard.enabled, "enabled(False)": lambda: decompshard.enabled(False)}
    inside = {"switched(True)": (True, True), "switched(False)": (False, False),
              "enabled()": (True, True), "enabled(False)": (True, False)}
    clean = state.capture()
    setup[found]()
    was = (decompshard.is_enabled(), guard.is_installed())
    before = state.capture()
    with blocks[context]():
        assert (decompshard.is_enabled(), guard.is_installed()) == inside[context]
    assert (decompshard.is_enabled(), guard.is_installed()) == was
    if inside[context] == was:  # nothing had to change: the very same objects stayed
        assert _no_changes(before) == {}
    decompshard.disable()
    guard.uninstall()
    assert _no_changes(clean) == {}
