"""The coverage table's status of ops decompshard derives nothing for (issue 22), on a
real `decompshard coverage` run: factory ops by their schema; ops `enable()` runs on
replicated inputs, claimed only because a DTensor run under `enable()` matched one
device (runtime_probe.py; per-op runs in tests/test_replicated_ops.py); in-place view
ops; and the ops that stay unsupported, each with its reason.

One sweep with `--opinfo-samples 1` (the capture is shared in-process with
test_coverage.py)."""

from __future__ import annotations

import json

import pytest
import torch

from decompshard.cli import main
from decompshard.coverage.runtime_probe import probe
from decompshard.coverage import report
from decompshard.coverage.sweep import FACTORY, STATUS_MEANINGS, STATUSES, is_factory

aten = torch.ops.aten

OPS = {  # op: expected status
    "aten.arange.start": "factory",
    "aten.zeros.default": "factory",
    "aten.empty.memory_format": "factory",  # no decomposition either: its reason used to say so
    "aten.randn.default": "factory",
    "aten.nonzero.default": "replicate-only",
    "aten.masked_select.default": "replicate-only",
    "aten.allclose.default": "replicate-only",
    "aten.histogram.bin_ct": "replicate-only",
    "aten.transpose_.default": "derived",
    # routed like the two above, but the first OpInfo sample never reaches them: no
    # probe, no claim (the default sweep reaches and probes both)
    "aten.embedding_renorm_.default": "unsupported",
    "aten.unsqueeze_.default": "unsupported",
    "aten.as_strided.default": "unsupported",
    "aten.resize_.default": "unsupported",
    "aten._ctc_loss.default": "unsupported",
    "aten._to_sparse.default": "unsupported",
}


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("status") / "status.json"
    assert main(["coverage", "--ops", ",".join(OPS), "--format", "json", "-o", str(out), "--no-verify",
                 "--opinfo-samples", "1", "-j", "1", "-q", "--no-backward"]) == 0  # forward samples only
    return {r["op"]: r for r in json.loads(out.read_text())["ops"]}


def test_statuses(doc):
    assert {op: r["status"] for op, r in doc.items()} == OPS


def test_factory_ops_by_schema(doc):
    assert STATUSES.index("factory") < STATUSES.index("unsupported")
    for op, status in OPS.items():
        if status == "factory":
            assert doc[op]["reason"] == FACTORY and "torch.distributed.tensor" in FACTORY
    # by the schema, not a list: a Tensor? argument makes an op non-factory
    assert is_factory(aten.linspace.default) and is_factory(aten.normal.float_float)
    assert not is_factory(aten.linspace.Scalar_Tensor) and not is_factory(aten.zeros_like.default)


def test_replicate_only_reasons(doc):
    assert doc["aten.nonzero.default"]["reason"].startswith("output size depends on values: runs on replicated inputs")
    assert doc["aten.allclose.default"]["reason"].startswith("returns a Python value computed from whole tensors")
    assert doc["aten.histogram.bin_ct"]["reason"] == "no decomposition: runs on replicated inputs under enable()"
    assert "aten.transpose.int's native strategy" in doc["aten.transpose_.default"]["reason"]


def test_no_claim_without_a_probe(doc):
    for op, twin in (("aten.embedding_renorm_.default", "aten.embedding_renorm.default"),
                     ("aten.unsqueeze_.default", "aten.unsqueeze.default")):
        assert twin in doc[op]["reason"] and "unchecked: no sample inputs" in doc[op]["reason"]


def test_unsupported_reasons(doc):
    assert "uninitialized memory" in doc["aten._ctc_loss.default"]["reason"]
    assert "sparse_coo tensor" in doc["aten._to_sparse.default"]["reason"]
    assert "moves no element" in doc["aten.as_strided.default"]["reason"]
    assert "resize_ reallocates" in doc["aten.resize_.default"]["reason"]


def test_the_probe_refuses_what_the_runtime_gets_wrong():
    """A route is not a claim: the probe runs the op through DTensor under enable()."""
    x = torch.randn(7, 3, dtype=torch.float64)
    assert probe(aten.nonzero.default, [((x,), {}, "")]) == (True, "")
    ok, why = probe(aten._to_sparse.default, [((x,), {}, "")])
    assert not ok and "sparse" in why
    ok, why = probe(aten.normal.Tensor_float, [((x,), {}, "")])  # each rank draws its own numbers
    assert not ok and "differs from one device" in why


def test_summary_table_counts_and_explains_each_status(doc):
    assert set(STATUS_MEANINGS) == set(STATUSES)
    text = report.render_summary(report.summarize(list(doc.values())), "text")
    row = next(line for line in text.splitlines() if line.startswith("factory "))
    assert row.split()[1] == "4" and "DTensor never dispatches it" in row
