"""Every private access of a plugin lives in that plugin's one compat module.

A kernel library's private attributes, internal modules and closures change between releases
without notice; each plugin keeps every use of them in one module that gates them by version and
self-checks them against the public API (:data:`COMPAT`). This test reads every other module of
every plugin package (its syntax tree, not its text: comments and docstrings may name internals)
and fails on:

- an attribute ``x._name`` (one leading underscore) of anything the module did not define or
  import from attn-core or its own plugin (``self._x`` and ``_State.x`` are the module's own);
- ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with such a name as a string;
- an import of a kernel library's internals: any ``fla`` module, a ``flash_attn`` module, a
  ``flashinfer`` submodule, a ``triton`` module other than ``triton.language``, or a name with a
  leading underscore from any foreign module (also through ``importlib.import_module``);
- ``triton.runtime`` / ``triton.compiler`` / ``triton.backends`` / ``triton._C`` reached as
  attributes, and ``inspect.getclosurevars`` anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "attn_plugins"

#: Per plugin package, its one module allowed to touch a kernel library's internals (None: the
#: plugin uses public APIs only). fa3's is ``providers.py``: the gated ``_flash_attn_fwd`` path.
COMPAT: dict[str, str | None] = {
    "attn_plugin_fa3": "providers.py",
    "attn_plugin_flashinfer": "compat.py",
    "attn_plugin_triton_ssm": "compat.py",
    "attn_plugin_varlen": None,
}

#: Module roots any import of which is an internal (fla's functions live in stage modules that
#: move between releases; flash_attn's interfaces are gated in fa3's compat module).
INTERNAL_ROOTS = {"fla", "flash_attn", "flash_attn_interface"}
#: Triton's submodules below its public ``triton`` / ``triton.language`` / ``triton.knobs``.
TRITON_INTERNALS = {"runtime", "compiler", "backends", "_C"}
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _internal_module(module: str) -> bool:
    root = module.split(".")[0]
    if root in INTERNAL_ROOTS:
        return True
    parts = module.split(".")
    if root == "flashinfer":  # the top-level module is FlashInfer's public API
        return len(parts) > 1
    if root == "triton":
        return len(parts) > 1 and parts[1] in TRITON_INTERNALS
    return any(_private(part) for part in module.split(".")[1:]) and root != "attn_core"


class _Scan(ast.NodeVisitor):
    def __init__(self, package: str, lines: list[str]) -> None:
        self.package = package
        self.lines = lines
        self.own: set[str] = {"self", "cls"}
        self.offenders: list[tuple[int, str]] = []

    def _own_module(self, module: str) -> bool:
        return module.split(".")[0] in {self.package, "attn_core"}

    def flag(self, node: ast.AST, why: str) -> None:
        lineno = getattr(node, "lineno", 0)
        self.offenders.append((lineno, f"{why}: {self.lines[lineno - 1].strip()}"))

    def collect_own(self, tree: ast.Module) -> None:
        """Names the module binds itself (classes, functions, assignments, own imports)."""
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.own.add(node.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0 or self._own_module(node.module or ""):
                    self.own.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if self._own_module(a.name):
                        self.own.add((a.asname or a.name).split(".")[0])

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if not self._own_module(a.name) and _internal_module(a.name):
                self.flag(node, f"imports internal module {a.name}")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and not self._own_module(module):
            if _internal_module(module):
                self.flag(node, f"imports from internal module {module}")
            for a in node.names:
                if _private(a.name) or _internal_module(f"{module}.{a.name}"):
                    self.flag(node, f"imports private {module}.{a.name}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root: ast.expr = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        root_name = root.id if isinstance(root, ast.Name) else None
        if _private(node.attr) and root_name not in self.own:
            self.flag(node, f"private attribute .{node.attr}")
        if node.attr == "getclosurevars":
            self.flag(node, "reads a closure")
        if (
            root_name == "triton"
            and isinstance(node.value, ast.Name)
            and node.attr in TRITON_INTERNALS
        ):
            self.flag(node, f"triton internal triton.{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
        text = strings[0] if strings and isinstance(strings[0], str) else ""
        target = node.args[0] if node.args else None
        target_name = target.id if isinstance(target, ast.Name) else None
        if name in ACCESSORS and _private(text) and target_name not in self.own:
            self.flag(node, f"{name} of private {text!r}")
        internal = text and not self._own_module(text) and _internal_module(text)
        if name == "import_module" and internal:
            self.flag(node, f"imports internal module {text}")
        self.generic_visit(node)


def scan(text: str, package: str, label: str) -> list[tuple[int, str]]:
    """``(line, "label:line: why: source line")`` for each private access in ``text``, a module
    of the plugin package named ``package``."""
    visitor = _Scan(package, text.splitlines())
    tree = ast.parse(text, filename=label)
    visitor.collect_own(tree)
    visitor.visit(tree)
    return [(n, f"{label}:{n}: {why}") for n, why in sorted(visitor.offenders)]


def _packages() -> list[Path]:
    # only import packages: ``pip install -e`` leaves ``attn_plugin_*.egg-info`` folders beside them
    return sorted(p for p in PLUGINS.glob("*/attn_plugin_*") if (p / "__init__.py").is_file())


def test_every_plugin_package_names_its_compat_module():
    """A new plugin package is added here with its compat module (or None)."""
    assert {p.name for p in _packages()} == set(COMPAT)
    for package in _packages():
        compat = COMPAT[package.name]
        assert compat is None or (package / compat).is_file(), (package.name, compat)


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.name)
def test_no_private_access_outside_the_compat_module(package: Path):
    compat = COMPAT[package.name]
    offenders = [
        line
        for path in sorted(package.rglob("*.py"))
        if compat is None or path != package / compat
        for _, line in scan(path.read_text(), package.name, str(path.relative_to(ROOT)))
    ]
    assert not offenders, "private access outside " + str(compat) + ":\n" + "\n".join(offenders)


_BAD = """
import fla.ops.kda.chunk_intra
import triton
from flashinfer.utils import get_cache_buf
from flashinfer import _private_fn
from attn_plugin_x import helper
from attn_plugin_x.compat import _release

class _State:
    seen = 0

def f(wrapper, compiled, mod, importlib, inspect):
    wrapper._sm_scale = 1.0
    helper._cache.clear()
    _State.seen += 1
    self_ok = _release("1")
    getattr(compiled, "_init_handles", None)
    setattr(wrapper, "__doc__", "dunder is fine")
    triton.runtime.driver.active.utils.get_device_properties(0)
    importlib.import_module("flash_attn.cute.interface")
    inspect.getclosurevars(mod.paged_run)
    return triton.cdiv(3, 2), triton.language
"""


def test_the_scan_finds_each_kind_of_private_access():
    """The scan itself: each line it must catch is caught, and nothing the module owns or any
    public name."""
    lines = _BAD.splitlines()
    must = ["import fla.ops", "from flashinfer.utils", "from flashinfer import _private",
            "wrapper._sm_scale", '"_init_handles"', "triton.runtime", "import_module(",
            "getclosurevars"]  # fmt: skip
    expected = {next(i for i, text in enumerate(lines, 1) if m in text) for m in must}
    found = scan(_BAD, "attn_plugin_x", "probe.py")
    assert {n for n, _ in found} == expected, [line for _, line in found]
