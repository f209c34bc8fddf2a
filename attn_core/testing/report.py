"""Per-capability outcomes of a conformance run and the terminal summary (no torch import).

Every battery item names the capabilities it exercises (``"full: dtype bfloat16"``). A capability
passes when every item that exercised it passed, fails when one failed (the first failure's
reason is kept: the whole first line of its message), and is skipped when all its items were
skipped (with their reason).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["CapabilityOutcome", "CapabilityReport", "reason", "statuses"]

#: The battery's failure message starts ``<backend> advertised [<labels>], failed: <reason>``;
#: the labels are the report's own lines, so a report line keeps only the reason.
_CLAIMS = re.compile(r"^\S+ advertised \[[^\]]*\], failed: ")


def reason(message: str) -> str:
    """The whole first line of an item's message, without the battery's claims prefix."""
    lines = message.strip().splitlines()
    return _CLAIMS.sub("", lines[0]) if lines else ""


#: A line of :meth:`CapabilityReport.lines`: status, capability, then its counts or reason.
_LINE = re.compile(r"^(PASS|FAIL|SKIP)  (.+?)( \(\d+ checks.*| - .*)?$")


def statuses(lines: Iterable[str]) -> dict[str, str]:
    """Capability -> ``PASS`` / ``FAIL`` / ``SKIP`` read back from a run's output lines (the
    summary :meth:`CapabilityReport.lines` wrote; other lines are ignored)."""
    matches = (_LINE.match(line) for line in lines)
    return {m.group(2): m.group(1) for m in matches if m}


@dataclass(slots=True)
class CapabilityOutcome:
    """What the run found out about one advertised capability."""

    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    first_failure: str | None = None  # "<test id>: <reason>"
    skip_reason: str | None = None

    @property
    def status(self) -> str:
        if self.failed:
            return "FAIL"
        if self.passed:
            return "PASS"
        return "SKIP"


@dataclass(slots=True)
class CapabilityReport:
    """Outcomes keyed by capability name, in first-seen order."""

    backend: str
    device: str = ""
    seed: int | None = None
    outcomes: dict[str, CapabilityOutcome] = field(default_factory=dict)

    def record(
        self, capabilities: tuple[str, ...], outcome: str, nodeid: str, message: str
    ) -> None:
        """Record one item's result (``"passed"`` / ``"failed"`` / ``"skipped"``)."""
        for name in capabilities:
            entry = self.outcomes.setdefault(name, CapabilityOutcome(name))
            if outcome == "passed":
                entry.passed += 1
            elif outcome == "failed":
                entry.failed += 1
                if entry.first_failure is None:
                    entry.first_failure = f"{nodeid.rpartition('::')[2]}: {reason(message)}"
            else:
                entry.skipped += 1
                if entry.skip_reason is None:
                    entry.skip_reason = reason(message)

    def lines(self) -> list[str]:
        """One line per capability: ``PASS  full: dtype bfloat16 (3 checks)``; a failed or
        skipped one carries its whole reason, however long the line gets."""
        out = []
        for entry in self.outcomes.values():
            status = entry.status
            line = f"{status}  {entry.name}"
            if status == "PASS":
                line += f" ({entry.passed} checks"
                line += f", {entry.skipped} skipped)" if entry.skipped else ")"
            elif status == "FAIL":
                line += f" - {entry.failed} of {entry.passed + entry.failed} checks failed; "
                line += entry.first_failure or ""
            else:
                line += f" - skipped: {entry.skip_reason}"
            out.append(line)
        return out

    @property
    def counts(self) -> dict[str, int]:
        counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        for entry in self.outcomes.values():
            counts[entry.status] += 1
        return counts
