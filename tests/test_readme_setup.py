"""The README's two set-up commands, which ``.ci/run`` runs as written in a fresh venv.

``.ci/setup_commands.py`` reads them out of README.md; these tests pin down what they must be,
so an edit of the README that would make CI run something else (or nothing) fails here first.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "pip install torch==2.13.0 && "


def _setup_commands(readme: Path) -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "ci_setup_commands", ROOT / ".ci" / "setup_commands.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.setup_commands(readme)


def test_readme_has_the_two_setup_commands():
    main, tests = _setup_commands(ROOT / "README.md")
    # torch pinned first in both: an unpinned torch pulls a multi-GB CUDA build
    assert main.startswith(TORCH_PIN) and tests.startswith(TORCH_PIN)
    assert main.endswith(" && attn run --model qwen3-next"), main
    assert 'pip install -e ".[run]"' in main, main
    assert 'pip install -e ".[test]"' in tests, tests
    # what CI needs of pytest is what the README says; no .pytest_cache in the tree, and the
    # suite spread over every core by pytest-xdist, which the test extra must then install
    assert tests.endswith(" && pytest -q -p no:cacheprovider -n auto"), tests
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"pytest-xdist' in pyproject, "the README runs pytest -n auto; the test extra lacks it"


def test_readme_installs_every_plugin_in_one_pip_call():
    """A shell loop of pip calls reports only the last one's status; one call fails as a whole."""
    (_, tests) = _setup_commands(ROOT / "README.md")
    plugins = sorted(p.parent.name for p in (ROOT / "attn_plugins").glob("*/pyproject.toml"))
    assert plugins, "no plugin folder under attn_plugins/"
    editables = " ".join(f"-e attn_plugins/{name}" for name in plugins)
    assert f" && pip install --no-deps --no-build-isolation {editables} && " in tests, tests


def test_extractor_reads_only_the_setup_section(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\n    not this\n\n## Set-up commands (anything)\n\ntext\n\n    one\n"
        "\n    two && three\n\n## Other\n\n    not this either\n"
    )
    assert _setup_commands(readme) == ["one", "two && three"]
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "setup_commands.py"), str(readme)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines() == ["one", "two && three"]


def test_extractor_fails_without_the_section(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n    a command elsewhere\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "setup_commands.py"), str(readme)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "Set-up commands" in out.stderr
    assert out.stdout == ""


def test_ci_type_checks_the_core_and_every_plugin_package():
    """``.ci/run`` runs plain ``mypy``, which checks what ``[tool.mypy] files`` lists: the core,
    each plugin package under attn_plugins/ and every benchmark folder (a plugin or a bench
    folder added without it goes unchecked)."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    steps = (ROOT / ".ci" / "run").read_text().splitlines()
    assert 'step "types" "mypy"' in steps, "CI no longer runs mypy"
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    # import packages only, not the egg-info folders that editable installs leave beside them
    inits = ROOT.glob("attn_plugins/*/attn_plugin_*/__init__.py")
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in inits)
    benches = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("attn_plugins/*/bench"))
    assert packages and benches
    assert sorted(files) == sorted(["attn_core", *packages, "bench", *benches])
