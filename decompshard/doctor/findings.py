"""A doctor's finding: one check, one line. Every failure the doctor meets ends here as a
line a user can read (the exception's first line, errors.one_line), never a traceback."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

OK, MISSING, FAILED = "OK", "MISSING", "FAILED"
STATUSES = (OK, MISSING, FAILED)
EXIT_PROBLEMS = 3  # something is missing or failed


@dataclass
class Finding:
    section: str  # environment | hook points | registries | smoke run
    name: str
    status: str  # OK | MISSING | FAILED
    detail: str
    seconds: float | None = None

    def line(self) -> str:
        took = f" ({self.seconds:.1f} s)" if self.seconds is not None else ""
        return f"  {self.status:<8} {self.name}: {self.detail}{took}"


def guarded(section: str, name: str, gather: Callable[[], Iterable[Finding]]) -> list[Finding]:
    """`gather()`'s findings; if the doctor itself fails there, one FAILED line saying
    where (the report goes on)."""
    from decompshard.errors import one_line

    try:
        return list(gather())
    except Exception as e:
        return [Finding(section, name, FAILED, f"the doctor could not check this: {one_line(e, 200)}")]


def exit_code(findings: Iterable[Finding]) -> int:
    return 0 if all(f.status == OK for f in findings) else EXIT_PROBLEMS


def summary(findings: list[Finding]) -> dict[str, int]:
    return {s: sum(1 for f in findings if f.status == s) for s in STATUSES}


def verdict(findings: list[Finding]) -> str:
    counts = summary(findings)
    if counts[MISSING] == counts[FAILED] == 0:
        return f"all {len(findings)} checks OK"
    bad = ", ".join(f"{counts[s]} {s}" for s in (MISSING, FAILED) if counts[s])
    return f"{bad} of {len(findings)} checks: the lines above say what does not work here and why"


def as_json(header: dict[str, Any], findings: list[Finding]) -> dict[str, Any]:
    return {**header, "checks": [asdict(f) for f in findings], "summary": summary(findings),
            "exit_code": exit_code(findings)}
