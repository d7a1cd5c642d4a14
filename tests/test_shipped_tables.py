"""The shipped table of torch's rules by shape class (decompshard/rules/torch_tables.py).

A wrong class key is a wrong rule, so these tests ask torch live: the whole table is
built again and must equal the shipped one, and for pointwise ops under broadcasting and
size-1 dims, every member of a class must get from the table what torch says for it.
"""

from __future__ import annotations

import json

import pytest
import torch

from decompshard._compat import TensorMeta
from decompshard.dispatch_modes.graph import PrimNode
from decompshard.rules import registry, torch_op_strategy, torch_single_dim, torch_tables
from decompshard.rules.shape_class import class_key, members
from decompshard.coverage.rule_tables import build_table

aten = torch.ops.aten


def _meta(*shape, dtype=torch.float32, stride=None):
    t = torch.empty(shape, dtype=dtype, device="meta")
    if stride is not None:
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)


def _node(op, *args, n_out=1, **kwargs):
    n_in = sum(isinstance(a, TensorMeta) for a in list(args) + list(kwargs.values()))
    return PrimNode(0, op, tuple(args), dict(kwargs), tuple(range(n_in)), tuple(range(n_in, n_in + n_out)), False)


def _source(op):
    return next(s for s in (torch_single_dim, torch_op_strategy) if s.has_rules(op))


def test_the_shipped_table_is_what_torch_says_now():
    """Rebuilt from scratch (derive the default op set, ask torch at three members of
    every class): the same verified ops and the same answer for every class."""
    shipped = json.loads(torch_tables.TABLE_PATH.read_text())
    assert shipped["torch"] == torch_tables.torch_release(), "run scripts/gen_rule_tables.py for this torch"
    fresh = build_table()
    assert fresh["verified_ops"] == shipped["verified_ops"]
    assert fresh["entries"] == shipped["entries"]
    assert sum(len(v) for v in shipped["entries"].values()) > 100


def test_the_table_is_used_and_says_the_same_as_a_live_query():
    table = torch_tables.shipped_table()
    assert "aten.add.Tensor" in table["verified_ops"]
    node = _node(aten.mul.Tensor, _meta(4, 6), _meta(6))
    key = class_key(node)
    src = _source(node.op)
    registry.clear_cache()
    assert [r.key() for r in torch_tables.torch_rules(src, node)] == [r.key() for r in src.rules(node)]
    assert key is not None


def test_decoded_entries_are_kept_only_for_what_ships():
    """The decode memo lives across clear_caches (it holds package data), so a class
    the table lacks must not be remembered in it: a long job meets unboundedly many."""
    src = _source(aten.mul.Tensor)
    shipped = torch_tables.shipped_table()["entries"][src.SOURCE]
    unshipped = [n for n in (_node(aten.mul.Tensor, _meta(*[2 + i] * 7), _meta(*[2 + i] * 7)) for i in range(3))
                 if class_key(n) is not None and class_key(n) not in shipped]
    assert unshipped, "expected rank-7 classes to be absent from the shipped table"
    before = dict(torch_tables._SHIPPED.decoded)
    for node in unshipped:
        assert [r.key() for r in torch_tables.torch_rules(src, node)] == [r.key() for r in src.rules(node)]
    new = set(torch_tables._SHIPPED.decoded) - set(before)
    assert all(key in shipped for _, key in new)
    assert not any(class_key(n) in {k for _, k in torch_tables._SHIPPED.decoded} for n in unshipped)


# Broadcasting and size-1 patterns: pairs of input shapes, each a class of its own.
BROADCASTS = [
    ((5, 7), (5, 7)), ((5, 5), (5, 5)), ((5, 7), (7,)), ((5, 7), (1, 7)), ((5, 7), (5, 1)),
    ((5, 1), (1, 7)), ((1, 7), (5, 1)), ((1, 1), (5, 7)), ((3, 1, 4), (2, 4)), ((3, 5, 4), (5, 1)),
    ((4,), (3, 1, 4)), ((1,), (6, 5)), ((), (4, 3)), ((2, 3, 4, 5), (3, 1, 5)),
]
POINTWISE = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.maximum.default,
             aten.eq.Tensor, aten.where.self, aten.lt.Tensor]


@pytest.mark.parametrize("op", POINTWISE, ids=str)
def test_broadcast_classes_agree_with_torch_at_every_member(op):
    """For each broadcasting pattern: the first member's answer (from the shipped table
    or computed and remembered by class) is what torch answers live for the others."""
    registry.clear_cache()
    src = _source(op)
    for a, b in BROADCASTS:
        args = (_meta(*a, dtype=torch.bool), _meta(*a), _meta(*b)) if op is aten.where.self else (_meta(*a), _meta(*b))
        node = _node(op, *args)
        first = torch_tables.torch_rules(src, node)
        for member in members(node):
            assert class_key(member) == class_key(node)
            via_class = torch_tables.torch_rules(src, member)
            live = src.rules(member)
            assert [(r.key(), r.even_only) for r in via_class] == [(r.key(), r.even_only) for r in live], (a, b)
            assert [r.key() for r in via_class] == [r.key() for r in first]


def test_keys_separate_what_torch_can_read():
    add = lambda *a, **k: class_key(_node(aten.add.Tensor, *a, **k))  # noqa: E731
    assert add(_meta(5, 7), _meta(7)) == add(_meta(3, 9), _meta(9))          # same class
    assert add(_meta(5, 7), _meta(7)) != add(_meta(9, 3), _meta(3))          # order of sizes
    assert add(_meta(5, 5), _meta(5)) != add(_meta(5, 7), _meta(7))          # equal sizes
    assert add(_meta(5, 7), _meta(7)) != add(_meta(5, 7), _meta(1, 7))       # rank
    assert add(_meta(5, 7), _meta(1, 7)) != add(_meta(5, 7), _meta(5, 7))    # size-1 dim
    assert add(_meta(5, 7), _meta(7)) != add(_meta(5, 7, dtype=torch.float64), _meta(7))
    assert add(_meta(5, 7), _meta(5, 7)) != add(_meta(5, 7, stride=(1, 5)), _meta(5, 7))  # layout
    assert add(_meta(5, 7), _meta(7), 2) != add(_meta(5, 7), _meta(7), 3)    # int scalars: exact
    m = lambda x: class_key(_node(aten.mul.Tensor, _meta(5, 7), x))  # noqa: E731
    assert m(0.25) == m(0.5) != m(0.0) != m(-0.0)                             # float scalars: class
    assert m(0.5) != m(-0.5) and m(0.5) != m(2.0) and m(float("nan")) != m(float("inf"))
    assert add(_meta(5, 7), _meta(7), 2) != add(_meta(5, 7), _meta(7), alpha=2)  # positional or not
    s = lambda *a: class_key(_node(aten.sum.dim_IntList, *a))  # noqa: E731
    assert s(_meta(4, 6), [0], False) != s(_meta(4, 6), [1], False)          # dims are kept


def test_what_a_class_cannot_stand_for_is_asked_exactly():
    assert class_key(_node(aten.view.default, _meta(4, 6), [24])) is None          # sizes
    assert class_key(_node(aten.narrow.default, _meta(4, 6), 0, 0, 2)) is None     # start/length
    assert class_key(_node(aten.add.Tensor, _meta(0, 6), _meta(6))) is None        # empty dim
    assert class_key(_node(aten.add.Tensor, _meta(4, 6, stride=(0, 1)), _meta(6))) is None  # expanded
    assert "aten.unbind.int" not in torch_tables.shipped_table()["verified_ops"]  # outputs = a size


def test_a_table_for_another_torch_is_ignored(tmp_path, monkeypatch):
    stale = json.loads(torch_tables.TABLE_PATH.read_text())
    stale["torch"] = "1.0.0"
    path = tmp_path / "torch_tables.json"
    path.write_text(json.dumps(stale))
    monkeypatch.setattr(torch_tables, "TABLE_PATH", path)
    monkeypatch.setattr(torch_tables, "_SHIPPED", torch_tables._Shipped())
    assert torch_tables.shipped_table()["verified_ops"] == []
    node = _node(aten.add.Tensor, _meta(4, 6), _meta(6))
    src = _source(node.op)
    assert [r.key() for r in torch_tables.torch_rules(src, node)] == [r.key() for r in src.rules(node)]
