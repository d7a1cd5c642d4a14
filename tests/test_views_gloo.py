"""The uneven-view, data-dependent, in-place and as_strided_ fixes on 4 real gloo
processes (tests/_views_gloo.py): simulated ranks share one process, so this checks
that real collectives and per-process storage give the same one-device numbers."""

from __future__ import annotations

import json

import _e2e_model as M
import _gloo_cases as G
import _views_gloo as V


def test_fixes_match_one_device_on_gloo(tmp_path):
    G.spawn(V.worker, (4, M.free_port(), str(tmp_path)), 4)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, errors in enumerate(per_rank):
        assert "crash" not in errors, (r, errors)
        assert set(errors) == {"linear", "linear_tokens", "nonzero", "index_add_", "pool"}, (r, errors)
        assert all(isinstance(v, (int, float)) and v < 1e-10 for v in errors.values()), (r, errors)
