"""``attn ... --help`` says what the command does: the lists it claims to give are there."""

from __future__ import annotations

import pytest

from attn_core import cli
from attn_core.models import sample_names
from attn_core.specs import TARGETS


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens too: one line per help


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_explain_help_lists_the_samples_and_the_targets(capsys):
    text = _help(capsys, "explain")
    samples = sample_names()
    assert len(samples) >= 8
    assert f"a sample ({', '.join(samples)})" in text
    assert f"--target TARGET {', '.join(sorted(TARGETS))}, or auto" in text


def test_bench_help_says_tuning_data_is_written_only_when_asked(capsys):
    text = _help(capsys)
    assert "time every admissible backend per group (--write-tuning saves the times" in text
    assert "--write-tuning WRITE_TUNING" in _help(capsys, "bench")


def test_run_help_says_which_models_it_takes(capsys):
    text = _help(capsys, "run")
    assert "--model MODEL 'all', an architecture the runner drives, the path of a Hugging " in text
    assert "config.json (or of its folder) of a model type one of them covers" in text
    assert "(a folder with safetensors weights loads them)" in text
    assert "--layers LAYERS" in text and "--warmup, --no-warmup" in text
