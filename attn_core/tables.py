"""Plain-text tables for the terminal (no dependency; wraps long cells)."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

__all__ = ["render_table"]


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    title: str | None = None,
    max_width: int | None = None,
) -> str:
    """Render ``rows`` under ``headers`` with box-drawing rules, wrapping the widest column.

    The last column is wrapped to fit ``max_width`` (default: the terminal width).
    """
    width_limit = max_width or shutil.get_terminal_size((120, 40)).columns
    cells = [[str(c) for c in r] for r in rows]
    n = len(headers)
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], *(len(line) for line in c.splitlines() or [""]))
    fixed = sum(widths[:-1]) + 3 * (n - 1) + 4
    widths[-1] = max(20, min(widths[-1], width_limit - fixed))

    def line(left: str, mid: str, right: str) -> str:
        return left + mid.join("─" * (w + 2) for w in widths) + right

    def row(values: Sequence[str]) -> list[str]:
        wrapped = []
        for i, v in enumerate(values):
            parts = []
            for para in v.splitlines() or [""]:
                parts += textwrap.wrap(para, widths[i]) or [""]
            wrapped.append(parts)
        height = max(len(w) for w in wrapped)
        out = []
        for k in range(height):
            out.append(
                "│ "
                + " │ ".join(
                    (wrapped[i][k] if k < len(wrapped[i]) else "").ljust(widths[i])
                    for i in range(n)
                )
                + " │"
            )
        return out

    lines = []
    if title:
        lines.append(title)
    lines.append(line("┌", "┬", "┐"))
    lines += row(list(headers))
    lines.append(line("├", "┼", "┤"))
    for i, r in enumerate(cells):
        lines += row(r)
        if i != len(cells) - 1:
            lines.append(line("├", "┼", "┤"))
    lines.append(line("└", "┴", "┘"))
    return "\n".join(lines)
