"""Tests that keep the plugin contract's documentation honest (datasette style).

Every hookspec in :mod:`attn_core.hookspecs` documents each argument (``:param name:``), what it
returns (``:returns:``) and whether it is firstresult, and appears in the plugin guide.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from attn_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "plugin-guide.md"


def _hookspecs() -> dict[str, object]:
    marker = f"{hookspecs.PROJECT}_spec"
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("attn_core_") and callable(fn) and hasattr(fn, marker)
    }


HOOKS = _hookspecs()


def test_the_contract_has_the_documented_hooks():
    assert set(HOOKS) == {
        "attn_core_register_backends",
        "attn_core_workspace_requirements",
        "attn_core_allocate_context",
        "attn_core_bind_forward",
        "attn_core_self_check",
    }
    assert set(HOOKS) <= set(hookspecs.__all__)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_every_argument_has_a_param_line(name):
    fn = HOOKS[name]
    doc = inspect.getdoc(fn) or ""
    assert doc.strip(), f"{name} has no docstring"
    summary = doc.splitlines()[0]
    assert summary.endswith("."), f"{name}: one-line summary expected, got {summary!r}"
    sig = inspect.signature(fn)
    documented = re.findall(r"^:param (\w+):", doc, flags=re.MULTILINE)
    assert documented == list(sig.parameters), (
        f"{name}: :param lines {documented} do not match the signature {list(sig.parameters)}"
    )
    for p in sig.parameters.values():
        assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}) is untyped"
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_every_hook_documents_what_it_returns(name):
    doc = inspect.getdoc(HOOKS[name]) or ""
    assert re.search(r"^:returns:", doc, flags=re.MULTILINE), f"{name} has no :returns: line"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_firstresult_is_documented_and_true(name):
    fn = HOOKS[name]
    doc = " ".join((inspect.getdoc(fn) or "").split())
    firstresult = getattr(fn, f"{hookspecs.PROJECT}_spec")["firstresult"]
    if firstresult:
        assert "(firstresult)" in doc and "not firstresult" not in doc, name
    else:
        assert "not firstresult" in doc, name


def test_module_docstring_names_each_hook_and_the_version():
    doc = hookspecs.__doc__ or ""
    for name in HOOKS:
        assert f"``{name}``" in doc, f"the life-cycle list in hookspecs' docstring misses {name}"
    major, minor = hookspecs.API_VERSION
    assert f'ATTN_CORE_API_VERSION = "{major}.{minor}"' in doc


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_plugin_guide_documents_each_hook(name):
    if not GUIDE.exists():
        pytest.skip(f"{GUIDE.relative_to(ROOT)} does not exist yet")
    text = GUIDE.read_text()
    assert name in text, f"{GUIDE.name} does not document {name}"
    for arg in inspect.signature(HOOKS[name]).parameters:
        assert arg in text, f"{GUIDE.name} does not mention {name}'s argument {arg!r}"
