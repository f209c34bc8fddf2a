"""``attn run`` names the transformers release it needs; the floor is pyproject's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attn_core.e2e.hf_version as hf_version
from attn_core.e2e.hf_version import TRANSFORMERS_FLOOR, parse_version, require_transformers
from attn_core.errors import AttnCoreError


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("5.17.0", (5, 17, 0)),
        ("5.24", (5, 24, 0)),
        ("5.18.0rc1", (5, 18, 0)),
        ("6.0.1.dev0", (6, 0, 1)),
    ],
)
def test_parse_version(text: str, want: tuple[int, int, int]) -> None:
    assert parse_version(text) == want


def test_the_floor_is_the_run_extras_requirement() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (floor,) = re.findall(r'"transformers>=([0-9.]+)"', pyproject)
    assert parse_version(floor) == parse_version(TRANSFORMERS_FLOOR)


def test_an_older_transformers_is_refused_naming_both_versions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_core import cli
    from attn_core.registry import Registry

    monkeypatch.setattr(hf_version, "installed_transformers", lambda: "5.3.0")
    with pytest.raises(
        AttnCoreError, match=rf"needs transformers>={TRANSFORMERS_FLOOR}: .* 5\.3\.0"
    ):
        require_transformers()
    monkeypatch.setattr(cli, "_registry", lambda args: Registry(strict=True))
    assert cli.main(["run", "--model", "qwen3", "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"attn run: error: `attn run` needs transformers>={TRANSFORMERS_FLOOR}" in err, err
    assert "this environment has transformers 5.3.0" in err, err


def test_a_missing_transformers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_version, "installed_transformers", lambda: None)
    with pytest.raises(AttnCoreError, match=r"transformers is not installed"):
        require_transformers()


def test_the_installed_transformers_passes() -> None:
    pytest.importorskip("transformers")
    assert require_transformers() == hf_version.installed_transformers()
