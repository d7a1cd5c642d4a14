"""Run `python -m decompshard` as a user does: a real process, its exit code, stdout and
stderr apart. The checkout under test comes first on PYTHONPATH; the OpInfo capture is
read from `cache_dir` (see conftest.opinfo_cache), never from the user's own cache."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


def cli_env(cache_dir: str | os.PathLike, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["DECOMPSHARD_CACHE_DIR"] = str(cache_dir)
    env.pop("COLUMNS", None)
    env.pop("DECOMPSHARD_ENABLE", None)
    env.update(extra)
    return env


def run_cli(*argv: str, cache_dir: str | os.PathLike, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decompshard", *argv], capture_output=True, text=True,
                          env=cli_env(cache_dir, **env), timeout=timeout, cwd=ROOT)


@contextlib.contextmanager
def ctrl_c_reaches_children() -> Iterator[None]:
    """Processes started inside begin with SIGINT at its default action, as a terminal's
    foreground job does. A test run started in the background by a non-interactive shell
    (`pytest ... &`, CI wrappers) ignores SIGINT, and an ignored signal stays ignored
    across exec: the child would never see the Ctrl-C the test sends (it honours the
    shell's wish, rightly). A Python-level handler here becomes SIG_DFL in the exec'd
    child."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def spawn_cli(*argv: str, cache_dir: str | os.PathLike, **env: str) -> subprocess.Popen:
    """In its own session (process group), so a test can Ctrl-C the whole group, workers
    included, as a terminal does."""
    with ctrl_c_reaches_children():
        return subprocess.Popen([sys.executable, "-m", "decompshard", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cli_env(cache_dir, **env), cwd=ROOT,
                                start_new_session=True)
