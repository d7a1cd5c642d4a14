"""The doctor's static checks: the environment, DTensor's hook points, its registries.

Everything torch-private is asked through the capability probes (doctor/hook_points.py, over `_compat`) (feature
detection: an attribute, a signature, an import). If `_compat` itself does not import
(a torch that lacks a private API decompshard needs at import), that is the one finding,
and nothing else can be checked."""

from __future__ import annotations

import platform
import warnings
from typing import Any, Iterator

from decompshard.doctor.findings import FAILED, MISSING, OK, Finding

ENVIRONMENT, HOOKS, REGISTRIES = "environment", "hook points", "registries"


def header() -> dict[str, Any]:
    """What a bug report starts with: the versions (no decompshard import needed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("decompshard")
    except PackageNotFoundError:  # run from a checkout without installing
        mine = "unknown (not installed)"
    try:
        import torch

        torch_version = torch.__version__
    except Exception as e:  # a torch that does not import is a finding
        from decompshard.errors import one_line

        torch_version = f"does not import ({one_line(e, 200)})"
    return {"decompshard": mine, "torch": torch_version, "python": platform.python_version()}


def environment(head: dict[str, Any]) -> tuple[list[Finding], bool]:
    """torch (and whether it is a tested release), python, and whether decompshard's
    torch layer imports; the bool says whether the other checks can run."""
    from decompshard.errors import one_line

    found = [Finding(ENVIRONMENT, "python", OK, head["python"])]
    try:
        import torch  # noqa: F401

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from decompshard._compat import SUPPORTED, TORCH_VERSION
    except Exception as e:  # an ImportError naming the private API this torch lacks
        found.insert(0, Finding(ENVIRONMENT, "torch", FAILED if "does not import" in head["torch"] else OK,
                                head["torch"]))
        found.append(Finding(ENVIRONMENT, "decompshard's torch layer (_compat)", MISSING, one_line(e, 300)))
        return found, False
    tested = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
    if TORCH_VERSION in SUPPORTED:
        torch_line = f"{head['torch']}, a tested release ({tested})"
    else:
        torch_line = f"{head['torch']}, not a tested release (tested: {tested}); the checks below say what works"
    found.insert(0, Finding(ENVIRONMENT, "torch", OK, torch_line))
    found.append(Finding(ENVIRONMENT, "decompshard's torch layer (_compat)", OK, "imports"))
    return found, True


def hook_points() -> Iterator[Finding]:
    """Every hook point decompshard patches or reads, then whether torch's fallback
    takes the arguments enable()'s replacement accepts."""
    from decompshard.doctor.hook_points import hook_probes
    from decompshard.torch_notices import no_cuda_runtime_notice

    # importing OpInfo's database on a CUDA build without a GPU logs "No CUDA runtime is
    # found" (torch.utils.cpp_extension): not a finding
    with no_cuda_runtime_notice(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probes = hook_probes()
    for name, found, detail in probes:
        yield Finding(HOOKS, name, OK if found else MISSING, detail)
    yield _fallback_signature()


def _fallback_signature() -> Finding:
    """DTensor calls whatever stands in `decomp_strategy` with the arguments torch's own
    fallback takes (2.14 added output_tensor_meta): enable()'s DerivedStrategy must take
    them all, or every derived op fails with "no sharding strategy registered"."""
    import inspect

    from decompshard._compat import decomp_strategy_parameters
    from decompshard.errors import one_line
    from decompshard.runtime.derived import DerivedStrategy

    name = "decomp_strategy.propagate_strategy signature"
    try:
        theirs = decomp_strategy_parameters()
    except Exception as e:
        return Finding(HOOKS, name, MISSING, one_line(e, 200))
    ours = tuple(inspect.signature(DerivedStrategy.propagate_strategy).parameters)[1:]
    if len(theirs) <= len(ours) and set(theirs) <= set(ours):
        return Finding(HOOKS, name, OK, f"torch's fallback takes ({', '.join(theirs)}); enable()'s takes them")
    return Finding(HOOKS, name, MISSING, f"torch's fallback takes ({', '.join(theirs)}), enable()'s "
                   f"DerivedStrategy takes ({', '.join(ours)}): DTensor would call it with arguments it lacks")


def registries() -> Iterator[Finding]:
    from decompshard.doctor.hook_points import registry_probes

    for name, found, detail in registry_probes():
        yield Finding(REGISTRIES, name, OK if found else MISSING, detail)
