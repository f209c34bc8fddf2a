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

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p for p in (ROOT / "attn_plugins").iterdir() if (p / "pyproject.toml").exists())

#: import name -> distribution, for the third-party packages the plugins may import
DISTRIBUTIONS = {
    "triton": "triton",
    "flashinfer": "flashinfer-python",
    "fla": "fla-core",
    "packaging": "packaging",
}
#: imports a plugin needs not declare beside attn-core: the core itself and what it declares
#: (torch, pluggy, numpy: the core's request rows are numpy arrays), the standard library and
#: the plugin's own package
PROVIDED = {"attn_core", "torch", "pluggy", "numpy"}


def _imports(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def _declared(plugin: Path) -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((plugin / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {Requirement(r).name.lower() for r in reqs}


@pytest.mark.parametrize("plugin", PLUGINS, ids=[p.name for p in PLUGINS])
def test_every_imported_kernel_library_is_declared(plugin: Path) -> None:
    packages = [p for p in plugin.iterdir() if p.name.startswith("attn_plugin_") and p.is_dir()]
    assert packages, f"no attn_plugin_* package in {plugin}"
    imported = set().union(*(_imports(p) for p in packages))
    imported -= PROVIDED | set(sys.stdlib_module_names) | {p.name for p in packages}
    missing = {
        DISTRIBUTIONS[name]
        for name in imported
        if name in DISTRIBUTIONS and DISTRIBUTIONS[name] not in _declared(plugin)
    }
    assert not missing, f"{plugin.name} imports {sorted(missing)} without declaring them"
