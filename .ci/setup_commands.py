"""Print the README's set-up commands, one a line.

They are the indented lines of the README's "Set-up commands" section (from that heading to the
next one). ``.ci/run`` runs exactly what this prints, so CI cannot drift from what the README
tells a user to run; ``tests/test_readme_setup.py`` checks what the commands are. Standard
library only: it runs before anything is installed.

Usage: ``python3 .ci/setup_commands.py [README.md]``
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADING = "Set-up commands"
_HEADING_RE = re.compile(r"#{1,6}\s+(.*)")


def setup_commands(readme: Path) -> list[str]:
    """The indented (4+ spaces) lines of the ``Set-up commands`` section, stripped."""
    commands: list[str] = []
    inside = False
    for line in readme.read_text(encoding="utf-8").splitlines():
        heading = _HEADING_RE.fullmatch(line)
        if heading:
            inside = heading.group(1).startswith(HEADING)
        elif inside and line.startswith("    ") and line.strip():
            commands.append(line.strip())
    return commands


def main(argv: list[str]) -> int:
    readme = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "README.md"
    commands = setup_commands(readme)
    if not commands:
        print(f"{readme}: no indented command under a '{HEADING}' heading", file=sys.stderr)
        return 1
    print("\n".join(commands))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
