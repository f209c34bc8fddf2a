"""Shared fixtures of the core tests: a fresh registry per test, tiny specs, inline plugins.

- Every test starts with the ``ATTN_CORE_*`` environment variables removed, so a developer's
  shell (``ATTN_CORE_STRICT=1``, ``ATTN_CORE_BACKENDS=...``) never changes a result.
- ``registry`` is a new :class:`attn_core.registry.Registry` (its own pluggy manager) per test;
  ``ref_registry`` has the reference plugin registered under its entry-point name ``attn_core``.
- ``make_plugin`` builds a plugin module (``types.ModuleType``) from backends and hook functions,
  the way a third-party package would write one, without touching ``sys.modules``.
- ``tiny_specs`` gives one small spec per layer kind (float32, so CPU math is exact enough).
- Every test sees a terminal 120 columns wide (``COLUMNS``, set by ``clean_attn_env``): the
  CLI's tables wrap to it.
- ``cuda`` is a skip marker for tests that need a CUDA device; tests marked ``gpu`` are skipped
  without one as well.
- Plugin probes (:mod:`attn_core.probe`) of the whole run share one cache file in pytest's
  temporary folder (``ATTN_CORE_PROBE_CACHE``): the user's cache is never written, and the real
  plugins are probed once per run, not once per discovery (subprocesses started by tests, the
  conformance kit's, inherit the variable).
"""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels can only run under its interpreter, and the interpreter must be
# chosen before any @triton.jit function is created (by our kernels or by fla's, which other
# tests import first); a per-module switch is too late once another module has built them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run from a source checkout without ``pip install``
    sys.path.insert(0, str(_ROOT))

from attn_core.backend import Backend, BackendCapabilities  # noqa: E402
from attn_core.hookspecs import hookimpl  # noqa: E402
from attn_core.registry import Registry  # noqa: E402
from attn_core.specs import LayerSpec  # noqa: E402

# gpu tests skip without CUDA; every test runs without the developer's ATTN_CORE_* variables
from attn_core.testing.gpu import clean_attn_env, pytest_collection_modifyitems  # noqa: E402, F401

HAS_CUDA = torch.cuda.is_available()
#: Marker for tests that need a CUDA device (use together with ``pytest.mark.gpu``).
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available())")


@pytest.fixture(autouse=True)
def probe_cache_in_tmp(
    clean_attn_env: None,  # noqa: F811 (requested, not redefined: it must run first)
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Point ``ATTN_CORE_PROBE_CACHE`` at one file for the whole run (after ``clean_attn_env``
    removed the developer's ``ATTN_CORE_*`` variables)."""
    monkeypatch.setenv(
        "ATTN_CORE_PROBE_CACHE", str(tmp_path_factory.getbasetemp() / "plugin-probes.json")
    )


@pytest.fixture
def registry() -> Registry:
    """A fresh, empty registry (its own pluggy PluginManager)."""
    return Registry()


@pytest.fixture
def ref_registry() -> Registry:
    """A fresh registry with only the reference plugin (``attn_core:reference``)."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    return reg


def caps(**overrides: Any) -> BackendCapabilities:
    """Capabilities of a permissive test backend (CPU and CUDA, every dtype), with overrides."""
    base: dict[str, Any] = dict(
        kinds={"full"},
        device_types={"cpu", "cuda"},
        dtypes={"float32", "bfloat16", "float16"},
    )
    base.update(overrides)
    return BackendCapabilities(**base)


def make_plugin_module(
    name: str,
    backends: Iterable[Backend | Any] = (),
    *,
    api: str | None = "1.1",
    register: Callable[..., None] | None = None,
    allocate: Callable[..., Any] | None = None,
    requirements: Callable[..., Any] | None = None,
    bind: Callable[..., Any] | None = None,
) -> types.ModuleType:
    """A plugin module as a third-party package would write it.

    :param backends: registered in order by ``attn_core_register_backends`` (anything: a test
        can register a non-Backend).
    :param api: ``ATTN_CORE_API_VERSION``; None leaves it undeclared.
    :param register: replaces the generated register hook (e.g. one that raises).
    :param allocate: the ``attn_core_allocate_context`` implementation, wrapped with hookimpl
        as is (its own signature decides which arguments it receives).
    :param requirements: ``attn_core_workspace_requirements`` implementation.
    :param bind: ``attn_core_bind_forward`` implementation.
    """
    mod = types.ModuleType(name)
    if api is not None:
        mod.ATTN_CORE_API_VERSION = api
    items = list(backends)
    if register is None:

        def register_backends(register):
            for b in items:
                register(b)

        register = register_backends
    mod.attn_core_register_backends = hookimpl(register)
    if allocate is not None:
        mod.attn_core_allocate_context = hookimpl(allocate)
    if requirements is not None:
        mod.attn_core_workspace_requirements = hookimpl(requirements)
    if bind is not None:
        mod.attn_core_bind_forward = hookimpl(bind)
    return mod


@pytest.fixture
def make_plugin() -> Callable[..., types.ModuleType]:
    """:func:`make_plugin_module` as a fixture."""
    return make_plugin_module


@pytest.fixture
def make_caps() -> Callable[..., BackendCapabilities]:
    """:func:`caps` as a fixture."""
    return caps


def _tiny_specs() -> dict[str, LayerSpec]:
    f32 = dict(dtype="float32")
    return {
        "full": LayerSpec(
            kind="full", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, **f32
        ),
        "mla": LayerSpec(
            kind="mla",
            num_heads=4,
            num_kv_heads=1,
            head_dim=24,
            head_dim_v=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            page_size=4,
            **f32,
        ),
        "gdn": LayerSpec(
            kind="linear",
            linear_variant="gated_deltanet",
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            head_dim_v=8,
            conv_kernel_size=4,
            conv_channels=64,
            qk_l2norm=True,
            **f32,
        ),
        "kda": LayerSpec(
            kind="linear",
            linear_variant="kda",
            num_heads=4,
            num_kv_heads=4,
            head_dim=8,
            head_dim_v=8,
            conv_kernel_size=4,
            conv_channels=96,
            qk_l2norm=True,
            **f32,
        ),
        "mamba2": LayerSpec(
            kind="linear",
            linear_variant="mamba2",
            num_heads=4,
            num_kv_heads=1,
            head_dim=8,
            head_dim_v=8,
            conv_kernel_size=4,
            conv_channels=48,
            **f32,
        ),
        # d_inner 6 channels (one head each), d_state 8; the conv runs over x only
        "mamba1": LayerSpec(
            kind="linear",
            linear_variant="mamba1",
            num_heads=6,
            num_kv_heads=1,
            head_dim=8,
            head_dim_v=1,
            conv_kernel_size=4,
            conv_channels=6,
            **f32,
        ),
        "encoder": LayerSpec(
            kind="encoder", num_heads=4, num_kv_heads=4, head_dim=16, causal=False, **f32
        ),
    }


@pytest.fixture
def tiny_specs() -> dict[str, LayerSpec]:
    """One small float32 spec per kind: ``full``, ``mla``, ``gdn``, ``kda``, ``mamba2``,
    ``mamba1``, ``encoder`` (page size 4, so a few tokens already cross page boundaries)."""
    return _tiny_specs()
