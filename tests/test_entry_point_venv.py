"""A third-party plugin found through a real entry point, in a real virtual environment (no mocks).

The test writes a plugin distribution as a vendor would (one module, a pyproject with one entry
point in group ``attn_core``), creates a venv with ``--system-site-packages`` (torch and pluggy
come from the system), ``pip install --no-deps --no-build-isolation`` attn-core and the plugin
into it, and runs ``Registry.discover()`` in the venv's interpreter.

The venv is made ``--without-pip``: its ``python -m pip`` is then the system's pip (through the
system site-packages) with the system's setuptools, where ensurepip would seed an older
setuptools that shadows the system one and cannot build wheels without network access.

attn-core is installed from a copy of the repository's packaging files (``pyproject.toml``,
``README.md``, ``attn_core/``): building in place would write ``build/`` into a working tree
other people share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGIN_MODULE = '''
"""acme: a third-party attention backend plugin (test fixture)."""
from attn_core.backend import Backend, BackendCapabilities
from attn_core.hookspecs import hookimpl

ATTN_CORE_API_VERSION = "1.1"


@hookimpl
def attn_core_register_backends(register):
    register(Backend(
        name="turbo",
        capabilities=BackendCapabilities(kinds={"full"}, device_types={"cuda"},
                                         min_compute_capability=(9, 0), head_dims={128}),
        priority=70,
        version="0.0.1",
    ))
'''

PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "attn-plugin-acme-test"
version = "0.0.1"

[project.entry-points.attn_core]
acme = "acme_attn"

[tool.setuptools]
py-modules = ["acme_attn"]
"""

SNIPPET = """
import json, attn_core, acme_attn
from attn_core.registry import Registry
reg = Registry.discover()
print(json.dumps({
    "attn_core_file": attn_core.__file__,
    "acme_file": acme_attn.__file__,
    "summary": reg.summary(),
}))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_plugin_found_through_real_entry_point(tmp_path: Path):
    try:
        import venv  # noqa: F401

        import setuptools  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the Python build
        pytest.skip(f"venv / setuptools unavailable: {exc}")

    # the plugin distribution, as a vendor writes it
    plugin_dir = tmp_path / "acme_plugin"
    plugin_dir.mkdir()
    (plugin_dir / "acme_attn.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (plugin_dir / "pyproject.toml").write_text(textwrap.dedent(PLUGIN_PYPROJECT))

    # attn-core's packaging files, copied so the build does not write into the working tree
    core_dir = tmp_path / "attn_core_src"
    core_dir.mkdir()
    shutil.copy(ROOT / "pyproject.toml", core_dir)
    if (ROOT / "README.md").exists():
        shutil.copy(ROOT / "README.md", core_dir)
    else:
        (core_dir / "README.md").write_text("attn-core\n")
    shutil.copytree(
        ROOT / "attn_core",
        core_dir / "attn_core",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    venv_dir = tmp_path / "venv"
    made = _run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv_dir)],
        tmp_path,
        env,
    )
    if made.returncode != 0:
        pytest.skip(f"python -m venv failed: {made.stderr.strip()[-500:]}")
    py = venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if _run([str(py), "-m", "pip", "--version"], tmp_path, env).returncode != 0:
        pytest.skip("pip is not available in the new venv")

    for src in (core_dir, plugin_dir):
        inst = _run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-q",
                str(src),
            ],
            tmp_path,
            env,
        )
        assert inst.returncode == 0, f"pip install {src.name} failed:\n{inst.stdout}\n{inst.stderr}"

    # run from an empty directory: nothing importable except what the venv has installed
    work = tmp_path / "cwd"
    work.mkdir()
    res = _run([str(py), "-c", SNIPPET], work, env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert str(venv_dir) in data["attn_core_file"], data["attn_core_file"]
    assert str(venv_dir) in data["acme_file"], data["acme_file"]

    summary = data["summary"]
    plugins = {p["name"]: p for p in summary["plugins"]}
    assert "acme" in plugins, summary
    acme = plugins["acme"]
    assert acme["distribution"] == "attn-plugin-acme-test"
    assert acme["version"] == "0.0.1"
    assert acme["api_version"] == "1.1"
    (turbo,) = acme["backends"]
    assert turbo["name"] == "acme:turbo"
    assert turbo["kinds"] == ["full"] and turbo["priority"] == 70
    # the core's own reference plugin comes through its entry point as well
    assert "attn_core:reference" in {b["name"] for p in summary["plugins"] for b in p["backends"]}
    assert summary["quarantined"] == [], summary["quarantined"]
