"""Fixtures shared by the CLI tests."""

from __future__ import annotations

import pytest


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
