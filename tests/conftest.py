"""Fixtures shared by the tests, and the seeds that make every run draw the same data."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

# Values drawn while test modules are collected (parametrize arguments) are the same on
# every run: a CI failure reproduces, and no rare draw fails one run in a hundred (an
# all-negative randn(7) once made a prelu rule hold that the sign analysis cannot know).
torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws from its own seed (a hash of its id), whatever ran before it."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture(scope="session")
def opinfo_cache(tmp_path_factory):
    """A cache folder holding the `--opinfo-samples 1` capture with the samples' backward
    (what `decompshard coverage` captures), written from this process's own capture
    (shared with test_coverage's in-process sweeps; a forward-only request is served from
    it), so CLI subprocesses with `--opinfo-samples 1` read it instead of capturing again."""
    from decompshard.coverage.opinfo_samples import capture_aten_samples

    folder = tmp_path_factory.mktemp("decompshard-cache")
    capture_aten_samples(max_samples_per_opinfo=1, backward=True, cache_dir=str(folder))
    assert any(folder.iterdir()), "the capture was not kept on disk"
    return folder


@pytest.fixture(scope="module")
def world(request):
    """Simulated ranks (a fake process group) for a module's tests: four, or the module's
    `WORLD_SIZE`; decompshard disabled afterwards. A module asks for it with
    `pytestmark = pytest.mark.usefixtures("world")` or by naming it in a test."""
    import decompshard
    from decompshard.verify.dtensor_case import simulated_world

    with simulated_world(getattr(request.module, "WORLD_SIZE", 4)):
        yield
    decompshard.disable()


@pytest.fixture(autouse=True)
def _user_modules_stay_in_their_test():
    """An in-process `--import`/`--model` is remembered for the worker processes to
    import (decompshard.user_modules): not past the test that asked for it."""
    from decompshard import user_modules

    before = list(user_modules._IMPORTED)
    yield
    user_modules._IMPORTED[:] = before
