"""What a newcomer reads carries no history: no session logs, no dates, no machine paths.

History stays in git. Every tracked text file is read (Markdown, Python, TOML, JSON, CI); in shell
scripts only the comments, since their commands may name the scratch folder they install into.
One-off reproductions (``scripts/diag_*``) do not belong in the tree.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: what a log of the work would leave behind
PATTERNS = {
    "a session log": re.compile(r"\bsession\s+\d+\b", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-(0[1-9]|1[0-2])\b"),
    "a machine path": re.compile(r"(?<![\w.~$}])/(tmp|work|home|root|Users|mnt)/"),
}
TEXT_SUFFIXES = {".md", ".py", ".toml", ".json", ".sh", ".cfg", ".txt", ".yml", ".yaml", ""}


def _tracked() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if (ROOT / name).suffix in TEXT_SUFFIXES]


def _lines(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text()
    except (UnicodeDecodeError, FileNotFoundError):
        return []
    lines = list(enumerate(text.splitlines(), 1))
    if path.suffix == ".sh":  # commands may name a scratch folder; what they say may not
        return [(n, line) for n, line in lines if line.lstrip().startswith("#")]
    return lines


def find(path: Path) -> list[str]:
    """``"file:line: what: text"`` for each line of ``path`` that carries history."""
    return [
        f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}"
        for n, line in _lines(path)
        for what, pattern in PATTERNS.items()
        if pattern.search(line)
    ]


def test_no_session_logs_dates_or_machine_paths_in_the_tree():
    found = [hit for path in _tracked() for hit in find(path)]
    assert not found, "\n".join(found)


def test_no_one_off_reproduction_scripts():
    assert not sorted(p.name for p in (ROOT / "scripts").glob("diag_*"))


def test_the_patterns_catch_what_they_are_for(tmp_path: Path):
    # built from pieces, so that this file itself holds none of them
    lines = {
        "measured in session" + " 14 on the H200": "a session log",
        "numbers of 20" + "26-05 (re-run)": "a date",
        "logs under /" + "tmp/attn-run and /" + "work/main": "a machine path",
        "see (/" + "home/dev/x)": "a machine path",
    }
    clean = ["a session of the kit", "$TMPDIR/site", "attn_plugins/varlen/README.md", "float16"]
    for line, what in lines.items():
        assert [w for w, p in PATTERNS.items() if p.search(line)] == [what], line
    for line in clean:
        assert not [w for w, p in PATTERNS.items() if p.search(line)], line
