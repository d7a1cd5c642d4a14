"""The one patch mechanism (decompshard/runtime/table_patches.py): declared entries set
together, every slot put back exactly (the same objects, an empty slot emptied again),
warn-once per installation or per process, from many threads; and, through it,
`enable()`/`disable()` leaving all of DTensor's tables as they were."""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from decompshard.runtime.table_patches import Slot, TablePatches, where_none


class _Holder:
    @staticmethod
    def kept() -> str:
        return "theirs"


def _tables() -> tuple[dict, object]:
    table = {"a": object(), "b": object()}
    inst = _Holder()
    inst.attr = object()
    return table, inst


def test_install_sets_in_order_and_uninstall_puts_back_the_same_objects():
    table, inst = _tables()
    before = dict(table)
    own_attr, static = inst.attr, vars(_Holder)["kept"]
    seen = []

    def declare():
        yield table, "a", "A"
        seen.append(table["a"])  # a later entry reads what an earlier one set
        yield table, "new", "N"  # an empty slot
        yield inst, "attr", "X"
        yield inst, "fresh", "F"  # an attribute the instance did not have
        yield _Holder, "kept", staticmethod(lambda: "ours")

    patches = TablePatches(declare)
    assert not patches.is_installed()
    patches.install()
    assert seen == ["A"] and patches.is_installed()
    assert (table["a"], table["new"], inst.attr, inst.fresh, _Holder.kept()) == ("A", "N", "X", "F", "ours")
    patches.install()  # idempotent: declared once
    assert seen == ["A"]
    patches.uninstall()
    assert table == before and all(table[k] is before[k] for k in before) and "new" not in table
    assert inst.attr is own_attr and not hasattr(inst, "fresh")
    assert vars(_Holder)["kept"] is static and _Holder.kept() == "theirs"
    assert not patches.is_installed()
    patches.uninstall()  # idempotent
    assert table == before


def test_a_slot_set_twice_gets_its_first_value_back():
    table, _ = _tables()
    first = table["a"]
    patches = TablePatches(lambda: [(table, "a", 1), (table, "a", 2)])
    patches.install()
    assert table["a"] == 2
    patches.uninstall()
    assert table["a"] is first


def test_records_unwind_last_in_first_out_when_one_wraps_the_others_entry():
    table = {"f": "plain"}
    lower = TablePatches(lambda: [(table, "f", ("lower", table["f"]))])
    upper = TablePatches(lambda: [(table, "f", ("upper", table["f"]))])
    lower.install()
    upper.install()
    assert table["f"] == ("upper", ("lower", "plain"))
    lower.uninstall()  # not the last installed: upper comes out first and goes back over it
    assert table["f"] == ("upper", "plain") and upper.is_installed() and not lower.is_installed()
    upper.uninstall()
    assert table == {"f": "plain"}


def test_an_entry_added_while_installed_goes_back_with_the_rest():
    table = {"kept": "theirs"}
    patches = TablePatches(lambda: [(table, "kept", "ours")])
    assert not patches.add(table, "late", 1) and table == {"kept": "theirs"}  # not installed: nothing set
    patches.install()
    assert patches.add(table, "late", 1) and patches.add(table, "kept", "again")
    assert table == {"kept": "again", "late": 1}
    patches.uninstall()
    assert table == {"kept": "theirs"}


def test_where_none_leaves_someone_elses_entry():
    theirs = object()
    table = {"taken": theirs}
    patches = TablePatches(lambda: where_none(table, [("taken", 1), ("free", 2)], lambda op, n: (op, n)))
    patches.install()
    assert table == {"taken": theirs, "free": ("free", 2)}
    patches.uninstall()
    assert table == {"taken": theirs}


def test_a_failing_declaration_leaves_nothing_behind():
    table, _ = _tables()
    before = dict(table)

    def declare():
        yield table, "a", "A"
        yield table, "new", "N"
        raise ValueError("declaration broke")

    patches = TablePatches(declare)
    with pytest.raises(ValueError, match="declaration broke"):
        patches.install()
    assert table == before and all(table[k] is before[k] for k in before)
    assert not patches.is_installed()


def test_on_change_runs_once_per_real_change():
    table, _ = _tables()
    calls = []
    patches = TablePatches(lambda: [(table, "a", "A")], on_change=calls.append)
    patches.install()
    patches.install()
    patches.uninstall()
    patches.uninstall()
    assert calls == [True, False]


def _caller_of_the_warning_site(patches: TablePatches, key: str, **kw) -> None:
    patches.warn_once(key, f"message {key}", stacklevel=3, **kw)


def test_warn_once_per_installation_or_per_process():
    table, _ = _tables()
    patches = TablePatches(lambda: [(table, "a", "A")])

    def warned() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                line = inspect.currentframe().f_lineno + 1
                _caller_of_the_warning_site(patches, "install"), _caller_of_the_warning_site(patches, "process", per_install=False)
        # stacklevel counts as warnings.warn's would in the caller of warn_once
        assert all((w.filename, w.lineno) == (__file__, line) for w in caught)
        return [str(w.message) for w in caught]

    patches.install()
    assert warned() == ["message install", "message process"]
    assert warned() == []
    patches.uninstall()
    patches.install()  # a new installation: its warnings again, the per-process one not
    assert warned() == ["message install"]
    patches.uninstall()


def test_install_and_uninstall_from_many_threads_never_wrap_twice():
    table = {"f": "plain"}

    def declare():
        yield table, "g", "G"
        sum(range(2000))  # room for another thread to step in
        yield table, "f", ("wrapped", table["f"])

    patches = TablePatches(declare)
    start = threading.Barrier(8, timeout=120)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside install and uninstall

    def worker(i: int) -> None:
        start.wait()
        for k in range(500):
            (patches.install if (i + k) % 2 else patches.uninstall)()
            assert table["f"] in ("plain", ("wrapped", "plain"))

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))  # a worker's error is raised here
    finally:
        sys.setswitchinterval(switch)
    assert patches.is_installed() == (table["f"] != "plain")
    patches.uninstall()
    assert table == {"f": "plain"}  # "g" emptied again


def test_enable_then_disable_leaves_every_dtensor_table_as_it_was():
    """Every entry of DTensor's handler and strategy tables (the op families' and the
    guard's included) and the decomposition fallback: the very same objects back."""
    import decompshard
    from decompshard._compat import DecompShardingStrategy, custom_op_handlers, sharding_propagator
    from decompshard.runtime.fences import guard

    sp = sharding_propagator()

    def snapshot() -> list[dict]:
        return [dict(custom_op_handlers()), dict(sp.op_strategy_funcs), dict(sp.op_single_dim_strategy_funcs),
                dict(vars(sp)), dict(vars(DecompShardingStrategy))]

    decompshard.disable()
    before = snapshot()
    decompshard.enable(guard_native=True)
    try:
        during = snapshot()
        changed = [sum(1 for k in b if k not in d or d[k] is not b[k]) + len(d.keys() - b.keys())
                   for b, d in zip(before, during)]
        assert all(changed[:4]) and changed[4] == 1, changed  # each table patched; has_decomp
        assert guard.is_installed() and decompshard.is_enabled()
    finally:
        decompshard.disable()
    after = snapshot()
    assert [b.keys() == a.keys() for b, a in zip(before, after)] == [True] * 5
    assert all(a[k] is b[k] for b, a in zip(before, after) for k in b)
    assert not guard.is_installed() and not decompshard.is_enabled()


def test_a_slot_is_put_back_by_its_own_undo_last_in_first_out():
    """A Slot (a setting with its own exact restore, torch's config): each record's
    first put undone, the upper record's first, an unset setting unset again."""
    unset = object()
    state = {"value": unset}

    def put(value):
        held = state["value"]
        state["value"] = value
        return lambda: state.update(value=held)

    slot = Slot("setting", put)
    lower = TablePatches(lambda: [(slot, slot.name, "low")])
    upper = TablePatches(lambda: [(slot, slot.name, "up"), (slot, slot.name, "up2")])
    lower.install()
    upper.install()
    assert state["value"] == "up2"
    upper.uninstall()
    assert state["value"] == "low"
    upper.install()
    lower.uninstall()  # the upper record comes out, then goes back in over what is left
    assert state["value"] == "up2" and upper.is_installed()
    upper.uninstall()
    assert state["value"] is unset
