"""Each bundled plugin declares, in its pyproject, every third-party package its code imports.

A plugin that imports Triton on its CUDA path without declaring it installs cleanly next to a
torch without Triton and then fails at its first step, after selection already chose it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p for p in (ROOT / "attn_plugins").iterdir() if (p / "pyproject.toml").exists())

#: import name -> distribution a plugin that imports it must list in ``dependencies``
REQUIRED = {
    "triton": "triton",
    "flashinfer": "flashinfer-python",
    "fla": "fla-core",
    "packaging": "packaging",
}
#: kernel libraries a plugin may serve without (its backend is then unavailable, with the
#: reason): the distribution goes in an extra; None where none is on PyPI (the official
#: FlashAttention-3 build)
OPTIONAL = {"flash_attn": "flash-attn-4", "flash_attn_interface": None}
#: imports a plugin needs not declare beside attn-core: the core itself and what it declares
#: (torch, pluggy, numpy: the core's request rows are numpy arrays)
PROVIDED = {"attn_core", "torch", "pluggy", "numpy"}


def _imports(package: Path) -> set[str]:
    """Top-level names ``package`` imports: import statements (any depth) and
    ``importlib.import_module("...")`` with a literal name."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and not node.args[0].value.startswith(".")
            ):
                names.add(node.args[0].value.split(".")[0])
    return names


def _declared(plugin: Path) -> tuple[set[str], set[str]]:
    """(``dependencies``, every extra's requirements) as canonical distribution names."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((plugin / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {canonicalize_name(Requirement(r).name) for r in reqs}  # noqa: E731
    extras = [r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]
    return names(project.get("dependencies", [])), names(extras)


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.name for p in PLUGINS])
def test_every_imported_kernel_library_is_declared(plugin: Path) -> None:
    packages = [p for p in plugin.iterdir() if p.name.startswith("attn_plugin_") and p.is_dir()]
    assert packages, f"no attn_plugin_* package in {plugin}"
    imported = set().union(*(_imports(p) for p in packages))
    imported -= PROVIDED | set(sys.stdlib_module_names) | {p.name for p in packages}
    unknown = imported - REQUIRED.keys() - OPTIONAL.keys()
    assert not unknown, f"{plugin.name} imports {sorted(unknown)}: say in this test which kind"
    required, extras = _declared(plugin)
    missing = sorted(REQUIRED[n] for n in imported & REQUIRED.keys() if REQUIRED[n] not in required)
    assert not missing, f"{plugin.name} imports {missing} without listing them in dependencies"
    optional = {OPTIONAL[n] for n in imported & OPTIONAL.keys()} - {None}
    missing = sorted(d for d in optional if d not in required | extras)
    assert not missing, f"{plugin.name} imports {missing} without an extra that installs them"
