"""Backend options: a schema a backend declares, values a run sets, checked at selection.

A backend declares what it can be configured with::

    Backend(name="mykernel", capabilities=..., option_schema={
        "split_kv": OptionSpec(bool, True, "split long KV ranges across CTAs"),
        "num_splits": OptionSpec(int, 0, "0: a heuristic picks"),
    })

A run sets values per backend (short or qualified name) from three places; for one backend and
key the first that sets it wins:

1. ``ExecutionConstraints(backend_options={"vendor:mykernel": {"split_kv": False}})``;
2. the CLI, ``attn explain/run/bench --option mykernel.split_kv=false`` (repeatable), which the
   CLI stores in ``ExecutionConstraints.cli_backend_options``;
3. the environment, ``ATTN_CORE_BACKEND_OPTIONS="mykernel.split_kv=false,other.key=3"``.

:func:`attn_core.selector.select` checks every value (an unknown backend or key, or a value of
the wrong type or not among the choices, is a :class:`~attn_core.errors.SelectionError` naming
the backend, the key, what is allowed and where the value came from) and hands the chosen
backend its options with the defaults filled in: ``GroupChoice.backend.options`` (the
``backend`` every hook receives) and ``GroupChoice.option_sources``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attn_core.errors import SelectionError

if TYPE_CHECKING:
    from attn_core.backend import Backend
    from attn_core.registry import Registry
    from attn_core.specs import ExecutionConstraints

__all__ = [
    "ENV_OPTIONS",
    "OptionSpec",
    "parse_option_entries",
    "resolve_backend_options",
]

ENV_OPTIONS = "ATTN_CORE_BACKEND_OPTIONS"  # e.g. "flashinfer.split_kv=false,fa3.num_splits=4"
#: Where a value set by ``ExecutionConstraints.backend_options`` came from, in errors.
SOURCE_CONSTRAINTS = "ExecutionConstraints.backend_options"
SOURCE_CLI = "--option"
SOURCE_DEFAULT = "default"

_TYPES: tuple[type, ...] = (bool, int, float, str)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: ``((backend, ((key, value), ...)), ...)``: the hashable form ExecutionConstraints keeps.
OptionTable = tuple[tuple[str, tuple[tuple[str, object], ...]], ...]


def _article(t: type) -> str:
    """``"an int"``, ``"a float"``: the type's name with its article, for error messages."""
    name = t.__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One option a backend accepts: its type, default, meaning and (optionally) its choices.

    ``type`` is ``bool``, ``int``, ``float`` or ``str``. Text from the CLI or the environment is
    converted (``true/false/1/0/yes/no/on/off`` for a bool); a typed value must have the type
    (an int is accepted for a float, a bool never for an int).
    """

    type: type
    default: object
    doc: str = ""
    choices: tuple[object, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(
                f"OptionSpec type={self.type!r}: expected one of bool, int, float, str"
            )
        if self.choices is not None:
            choices = tuple(self.choices)
            if not choices:
                raise ValueError("OptionSpec choices=(): give at least one value, or None")
            object.__setattr__(self, "choices", tuple(self._typed(c, "choices") for c in choices))
        object.__setattr__(self, "default", self._typed(self.default, "default"))
        if self.choices is not None and self.default not in self.choices:
            raise ValueError(
                f"OptionSpec default={self.default!r} is not among choices {list(self.choices)}"
            )

    def _typed(self, value: object, what: str) -> object:
        t = self.type
        ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ValueError(f"OptionSpec {what}={value!r}: expected {_article(t)}")
        return value

    def allowed(self) -> str:
        """What a value may be, for error messages: ``"one of 'fixed', 'ragged'"``."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type is bool:
            return "a bool (true/false)"
        return _article(self.type)

    def convert(self, value: object) -> object:
        """``value`` (typed, or text from the CLI / environment) as this option's type.

        :raises ValueError: the value is not of the type, cannot be parsed, or is not a choice.
        """
        t = self.type
        out: object
        if isinstance(value, str) and t is not str:
            text = value.strip().lower()
            try:
                if t is bool:
                    if text not in _TRUE + _FALSE:
                        raise ValueError(text)
                    out = text in _TRUE
                else:
                    out = t(text)
            except ValueError:
                raise ValueError(f"{value!r} is not {self.allowed()}") from None
        else:
            try:
                out = self._typed(value, "value")
            except ValueError:
                raise ValueError(f"{value!r} is not {self.allowed()}") from None
        if self.choices is not None and out not in self.choices:
            raise ValueError(f"{value!r} is not {self.allowed()}")
        return out


def options_table(value: Mapping[str, Mapping[str, object]] | OptionTable | None) -> OptionTable:
    """``{"backend": {"key": value}}`` (or the table form) as a sorted, hashable table."""
    if not value:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for backend, opts in items:
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend_options: {backend!r} is not a backend name")
        pairs = opts.items() if isinstance(opts, Mapping) else opts
        out.append((backend, tuple(sorted((str(k), v) for k, v in pairs))))
    return tuple(sorted(out))


def parse_option_entries(entries: Sequence[str], *, source: str) -> dict[str, dict[str, str]]:
    """``["flashinfer.split_kv=false", "fa3.num_splits=4"]`` -> ``{backend: {key: text}}``.

    The key is what follows the last ``.`` before ``=`` (backend names may hold ``:``).

    :param source: where the entries came from (``"--option"``, or the variable and its text),
        named by every error.
    :raises SelectionError: an entry without ``BACKEND.KEY=VALUE`` form, or one set twice.
    """
    out: dict[str, dict[str, str]] = {}
    hint = "expected BACKEND.KEY=VALUE, e.g. 'reference.decode_path=ragged'"
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        lhs, sep, value = entry.partition("=")
        backend, dot, key = lhs.strip().rpartition(".")
        backend, key = backend.strip(), key.strip()
        if not sep or not dot or not backend or not key:
            raise SelectionError(f"{source}: entry {entry!r} is malformed; {hint}")
        per = out.setdefault(backend, {})
        if key in per:
            raise SelectionError(
                f"{source}: {backend}.{key} is given twice ({per[key]!r} and {value.strip()!r}); "
                "keep one"
            )
        per[key] = value.strip()
    return out


def _env_entries() -> tuple[dict[str, dict[str, str]], str]:
    text = os.environ.get(ENV_OPTIONS, "")
    source = f"{ENV_OPTIONS}={text!r}"
    if not text.strip():
        return {}, source
    return parse_option_entries(text.split(","), source=source), source


def resolve_backend_options(
    registry: Registry, constraints: ExecutionConstraints
) -> dict[str, tuple[dict[str, object], dict[str, str]]]:
    """Every backend's options in force: ``{qualified: (values, sources)}``.

    Only backends that declare a schema appear; their values have the defaults filled in and
    ``sources`` says, per key, ``"default"``, ``"--option"``, the variable, or
    ``"ExecutionConstraints.backend_options"``.

    :raises SelectionError: a backend name no registered backend has (or that is ambiguous), a
        key its schema does not declare, or a value it does not accept; the message names the
        backend, the key, what is allowed and the source.
    """
    env, env_source = _env_entries()
    layers: list[tuple[str, Mapping[str, Mapping[str, object]]]] = [
        (env_source, env),
        (SOURCE_CLI, {b: dict(kv) for b, kv in constraints.cli_backend_options}),
        (SOURCE_CONSTRAINTS, {b: dict(kv) for b, kv in constraints.backend_options}),
    ]
    set_values: dict[str, dict[str, tuple[object, str]]] = {}
    for source, table in layers:  # later layers win
        for name, opts in table.items():
            backend = _resolve(registry, name, source)
            schema = dict(backend.option_schema)
            per = set_values.setdefault(backend.qualified_name, {})
            for key, value in opts.items():
                spec = schema.get(key)
                if spec is None:
                    declared = ", ".join(sorted(schema)) or "none"
                    raise SelectionError(
                        f"{source}: backend {backend.qualified_name!r} has no option {key!r}; "
                        f"it declares: {declared}"
                    )
                try:
                    per[key] = (spec.convert(value), source)
                except ValueError as exc:
                    raise SelectionError(
                        f"{source}: option {key!r} of backend {backend.qualified_name!r}: {exc} "
                        f"({spec.doc or 'no description'})"
                    ) from None
    out: dict[str, tuple[dict[str, object], dict[str, str]]] = {}
    for backend in registry.backends:
        if not backend.option_schema:
            continue
        given = set_values.get(backend.qualified_name, {})
        values = {k: s.default for k, s in backend.option_schema}
        sources = dict.fromkeys(values, SOURCE_DEFAULT)
        for key, (value, source) in given.items():
            values[key], sources[key] = value, source
        out[backend.qualified_name] = (values, sources)
    return out


def _resolve(registry: Registry, name: str, source: str) -> Backend:
    try:
        return registry.resolve(name)
    except SelectionError as exc:
        raise SelectionError(f"{source}: options for backend {name!r}: {exc}") from None


def format_options(values: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """``"decode_path=ragged (--option), x=1 (default)"``."""
    return ", ".join(
        f"{k}={values[k]!r} ({sources.get(k, SOURCE_DEFAULT)})" for k in sorted(values)
    )
