"""The type checker's view of the normalising dataclasses matches what runs.

LayerSpec, ExecutionConstraints and BackendCapabilities accept more on construction than their
fields hold afterwards (names for enums, plain sets, ``None`` for "derive it"): each declares the
constructor it accepts in an ``if TYPE_CHECKING:`` ``__init__`` stub, while the dataclass builds
the real one from the fields. The stub is invisible at run time, so it is read from the source
here and compared with the fields: same names, same order, same defaults. A field whose default
is :data:`attn_core.backend.REQUIRED` (refused when left out) is a parameter without a default,
and the stub may take by name only what the dataclass also takes by position (never the other
way round).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap

import pytest

from attn_core.backend import REQUIRED, BackendCapabilities
from attn_core.specs import ExecutionConstraints, LayerSpec

_MISSING = object()


def _stub(cls: type) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    (klass,) = tree.body
    assert isinstance(klass, ast.ClassDef)
    for node in klass.body:
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef) and inner.name == "__init__":
                    return inner
    raise AssertionError(f"{cls.__name__} has no `if TYPE_CHECKING:` __init__ stub")


def _stub_params(cls: type) -> list[tuple[str, object]]:
    """(name, default or _MISSING) of the stub's parameters after ``self``."""
    fn = _stub(cls)
    namespace = vars(sys.modules[cls.__module__])
    args = fn.args
    assert not args.vararg and not args.kwarg, "the stub takes no *args / **kwargs"
    positional = args.posonlyargs + args.args
    assert positional[0].arg == "self"
    positional = positional[1:]
    defaults: list[object] = [_MISSING] * (len(positional) - len(args.defaults))
    defaults += [eval(ast.unparse(d), namespace) for d in args.defaults]
    params = [(a.arg, d) for a, d in zip(positional, defaults, strict=True)]
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append((a.arg, _MISSING if d is None else eval(ast.unparse(d), namespace)))
    return params


def _field_params(cls: type) -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default is REQUIRED:
            out.append((f.name, _MISSING))
        elif f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, f.default_factory()))
        else:
            out.append((f.name, _MISSING))
    return out


@pytest.mark.parametrize("cls", [LayerSpec, ExecutionConstraints, BackendCapabilities])
def test_init_stub_matches_the_fields(cls):
    assert _stub_params(cls) == _field_params(cls)
    # what the dataclass takes by name only, the stub does too
    kw_only = {f.name for f in dataclasses.fields(cls) if f.kw_only}
    assert kw_only <= {a.arg for a in _stub(cls).args.kwonlyargs}
