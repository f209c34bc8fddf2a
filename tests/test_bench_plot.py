"""``attn bench --plot`` (issue 24 item 7): a PNG of every candidate's time per phase and batch.

matplotlib comes with the ``plot`` extra (the ``test`` extra includes it). Nothing is timed here:
the plot is drawn from a stand-in timing table, and the CLI runs with ``bench_group`` replaced.
"""

from __future__ import annotations

import struct
import sys

import pytest

from attn_core import bench, cli
from attn_core.bench import BenchResult, Timing, plot_figure, write_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

TABLE = [  # (group, phase, batch, backend, us) in no particular order
    Timing("full", "decode", 64, "fast:fast", 30.0),
    Timing("full", "decode", 1, "fast:fast", 12.0),
    Timing("full", "decode", 1, "attn_core:reference", 40.0),
    Timing("full", "decode", 64, "attn_core:reference", 90.0),
    Timing("full", "prefill", 8, "fast:fast", 200.0),
    Timing("linear", "decode", 1, "attn_core:reference", 25.0),
]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:8]
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    return width, height


def test_figure_has_one_panel_per_group_and_phase_and_a_line_per_candidate():
    import matplotlib.pyplot as plt

    fig = plot_figure(TABLE)
    try:
        panels = {ax.get_title(): ax for ax in fig.axes}
        assert sorted(panels) == ["full: decode", "full: prefill", "linear: decode"]
        lines = {ln.get_label(): ln for ln in panels["full: decode"].get_lines()}
        assert sorted(lines) == ["attn_core:reference", "fast:fast"]
        # batch sizes in order, times as given
        assert list(lines["fast:fast"].get_xdata()) == [1, 64]
        assert list(lines["fast:fast"].get_ydata()) == [12.0, 30.0]
        assert list(lines["attn_core:reference"].get_ydata()) == [40.0, 90.0]
        assert [ln.get_label() for ln in panels["full: prefill"].get_lines()] == ["fast:fast"]
        assert panels["full: decode"].get_xlabel() == "batch size (requests)"
        assert panels["full: decode"].get_ylabel() == "us per layer"
    finally:
        plt.close(fig)


def test_write_plot_writes_a_png(tmp_path):
    path = tmp_path / "bench.png"
    write_plot(TABLE, path)
    width, height = _png_size(path)
    assert width > 100 and height > 100


def test_write_plot_refuses_an_empty_table(tmp_path):
    with pytest.raises(ValueError, match="no timings to plot"):
        write_plot([], tmp_path / "bench.png")
    assert not (tmp_path / "bench.png").exists()


# ------------------------------------------------------------------------------------------
# attn bench --plot
# ------------------------------------------------------------------------------------------
@pytest.fixture
def stand_in_bench(monkeypatch, ref_registry):
    """``attn bench`` on the reference only, each candidate 'timed' by a stand-in."""
    calls = []

    def fake_bench_group(group, backend, registry, plan, device, *, batch, context, iters, phase):
        calls.append((group.group_id, backend.qualified_name, phase.value, batch))
        return BenchResult(
            group.group_id,
            backend.qualified_name,
            10.0 + batch,
            9.0 + batch,
            phase=phase.value,
            batch=batch,
            context=context,
        )

    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    monkeypatch.setattr(bench, "bench_group", fake_bench_group)
    return calls


def test_bench_plot_writes_the_png(tmp_path, capsys, stand_in_bench):
    path = tmp_path / "bench.png"
    argv = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "4", "--plot", str(path)]
    assert cli.main(argv) == 0
    assert stand_in_bench == [
        ("full", "attn_core:reference", "prefill", 4),
        ("full", "attn_core:reference", "decode", 4),
    ]
    assert f"plot written to {path}" in capsys.readouterr().out
    assert _png_size(path)[0] > 100


def test_bench_plot_without_matplotlib_is_an_error_before_timing(
    tmp_path, capsys, monkeypatch, stand_in_bench
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    path = tmp_path / "bench.png"
    rc = cli.main(["bench", "--model", "qwen3", "--device", "cpu", "--plot", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (
        "attn bench: error: --plot needs matplotlib, which is not installed: "
        "pip install 'attn-core[plot]'"
    )
    assert stand_in_bench == []  # nothing was timed
    assert not path.exists()


def test_the_plot_extra_installs_matplotlib_and_the_test_extra_includes_it():
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("matplotlib") for dep in extras["plot"])
    assert "attn-core[plot]" in extras["test"]
    readme = (root / "README.md").read_text()
    assert "pip install 'attn-core[plot]'" in readme or 'pip install -e ".[plot]"' in readme
