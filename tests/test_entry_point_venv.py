"""A third-party plugin found through a real entry point, in a real virtual environment (no mocks).

The test writes a plugin distribution as a vendor would (one module, a pyproject with one entry
point in group ``attn_core``), builds wheels of it and of attn-core, installs both with pip into a
new venv and runs ``Registry.discover()`` in that venv's interpreter.

Where the tools and dependencies come from, and why:

- The wheels are built by the interpreter that runs this test (``sys.executable -m pip wheel
  --no-build-isolation --no-index``), so with the setuptools of the environment that ``pip install
  -e ".[test]"`` made: the ``test`` extra pins ``setuptools>=70.1``, the first release that has
  ``bdist_wheel`` itself. Nothing is fetched, so the test needs no network. The base Python's
  setuptools is never used: a fresh venv of Python 3.10 / 3.11 seeds one without ``bdist_wheel``
  (``invalid command 'bdist_wheel'``) and Python 3.12+ seeds none, so a build there only worked on
  machines whose base Python happened to have ``wheel`` installed.
- The new venv does not use ``--system-site-packages`` either: that is the *base* Python's
  site-packages, which on a fresh machine has neither torch nor pluggy. Instead it sees the
  running environment's site-packages (torch, pluggy, numpy, pip) through a folder of symlinks
  named in a ``.pth`` file, minus every distribution that is attn-core or declares an
  ``attn_core`` entry point (and the editable-install hooks): attn-core and plugins are then only
  what pip installed into the venv, and installing torch a second time (a multi-GB CUDA build
  from PyPI) is never needed.

attn-core is built from a copy of the repository's packaging files (``pyproject.toml``,
``README.md``, ``attn_core/``): building in place would write ``build/`` into a working tree
other people share.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from importlib import metadata
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
                                         min_compute_capability=(9, 0),
                                         dtypes={"bfloat16", "float16"}, head_dims={128}),
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


def _attn_distribution(dist: metadata.Distribution) -> bool:
    """attn-core itself, or a distribution that declares an ``attn_core`` entry point."""
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    return name == "attn-core" or any(ep.group == "attn_core" for ep in dist.entry_points)


def _outer_site_view(dest: Path) -> Path:
    """Symlinks to the running environment's site-packages, less attn-core and its plugins.

    Every site-packages directory of this interpreter is linked entry by entry, the first
    directory winning for a name (as on ``sys.path``). Left out: the files of every distribution
    that :func:`_attn_distribution` picks (its metadata folder, its modules, its editable hooks),
    any other ``__editable__`` hook, and ``.pth`` files (not read from a plain path entry anyway).
    """
    dest.mkdir()
    site_dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        site_dirs.append(site.getusersitepackages())
    linked: set[str] = set()
    for sp in site_dirs:
        sp_path = Path(sp)
        if not sp_path.is_dir():
            continue
        hidden: set[str] = set()
        for dist in metadata.distributions(path=[sp]):
            if _attn_distribution(dist):
                hidden.update(f.parts[0] for f in dist.files or () if f.parts[0] != "..")
        for entry in sorted(sp_path.iterdir()):
            name = entry.name
            if (
                name in linked
                or name in hidden
                or name.startswith("__editable__")
                or name.endswith(".pth")
            ):
                continue
            (dest / name).symlink_to(entry, target_is_directory=entry.is_dir())
            linked.add(name)
    return dest


@pytest.mark.slow
def test_plugin_found_through_real_entry_point(tmp_path: Path):
    try:
        import venv  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the Python build
        pytest.skip(f"venv unavailable: {exc}")
    try:
        import setuptools
    except ImportError:
        pytest.fail(
            "setuptools is missing from the test environment; the 'test' extra provides it "
            '(pip install -e ".[test]")'
        )
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

    # both wheels, built by this interpreter with this environment's setuptools
    wheels = tmp_path / "wheels"
    for src in (core_dir, plugin_dir):
        built = _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-q",
                "-w",
                str(wheels),
                str(src),
            ],
            tmp_path,
            env,
        )
        assert built.returncode == 0, (
            f"building the {src.name} wheel with setuptools {setuptools.__version__} "
            f"({setuptools.__file__}) failed:\n{built.stdout}\n{built.stderr}"
        )
    wheel_files = sorted(wheels.glob("*.whl"))
    assert len(wheel_files) == 2, wheel_files

    venv_dir = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv_dir)], tmp_path, env)
    if made.returncode != 0:
        pytest.skip(f"python -m venv failed: {made.stderr.strip()[-500:]}")
    py = venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        tmp_path,
        env,
    )
    assert purelib.returncode == 0, purelib.stderr
    venv_site = Path(purelib.stdout.strip())
    assert venv_site.resolve().is_relative_to(venv_dir.resolve()), venv_site
    try:
        view = _outer_site_view(tmp_path / "outer_site")
    except OSError as exc:  # pragma: no cover - e.g. Windows without symlink rights
        pytest.skip(f"cannot make symlinks here: {exc}")
    (venv_site / "outer_site.pth").write_text(f"{view}\n")

    # the venv's pip (the running environment's, through the view) installs into the venv
    inst = _run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", *map(str, wheel_files)],
        tmp_path,
        env,
    )
    assert inst.returncode == 0, f"pip install of the wheels failed:\n{inst.stdout}\n{inst.stderr}"

    # run from an empty directory: nothing importable except what the venv has installed
    work = tmp_path / "cwd"
    work.mkdir()
    res = _run([str(py), "-c", SNIPPET], work, env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(data["attn_core_file"]).is_relative_to(venv_site), data["attn_core_file"]
    assert Path(data["acme_file"]).is_relative_to(venv_site), data["acme_file"]

    summary = data["summary"]
    plugins = {p["name"]: p for p in summary["plugins"]}
    # exactly the two distributions installed into the venv: none of the outer environment's
    assert set(plugins) == {"acme", "attn_core"}, summary
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
