"""Cold-path timings: plugin discovery and whole-model selection.

- discovery: ``Registry.discover()`` over five entry points - the reference plugin plus four
  plugin modules written to a temporary folder and imported for real (``importlib``), the entry
  points served by a patched ``importlib.metadata.entry_points``. The four modules are dropped
  from ``sys.modules`` before each run so every run imports them again. Target < 300 ms. Timed
  without the subprocess probes (``plugin_timeout=0``): a start-up pays for those only until they
  are cached (:mod:`attn_core.probe`), which the one "first start-up" run shows.
- selection: ``select()`` for a 64-layer hybrid (48 Gated DeltaNet + 8 global + 8 sliding
  full-attention layers) with those five plugins, planned for a named H200. Target < 50 ms.

Usage::

    python bench/bench_selection.py [--runs 50] [--out result.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import tempfile
import textwrap
import time
from importlib.metadata import EntryPoint
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attn_core.registry import Registry  # noqa: E402
from attn_core.selector import select  # noqa: E402
from attn_core.specs import (  # noqa: E402
    DeviceCapabilities,
    ExecutionConstraints,
    LayerSpec,
    group_layers,
)

PLUGIN_TEMPLATE = '''
"""Benchmark plugin {name}."""
from attn_core.backend import Backend, BackendCapabilities
from attn_core.hookspecs import hookimpl

ATTN_CORE_API_VERSION = "1.1"


@hookimpl
def attn_core_register_backends(register):
    register(Backend(name={backend!r}, priority={priority},
                     capabilities=BackendCapabilities(**{caps!r})))
'''

PLUGINS: dict[str, tuple[str, int, dict[str, object]]] = {
    "bench_fastattn": (
        "flash",
        100,
        dict(
            kinds=["full"],
            min_compute_capability=(9, 0),
            head_dims=[64, 128, 256],
            page_sizes=[16, 32, 64],
            graph_modes=["none", "decode", "full"],
            sliding_window=True,
        ),
    ),
    "bench_bigpage": (
        "paged64",
        200,
        dict(
            kinds=["full", "mla"], page_sizes=[64], kv_layouts=["NHD", "HND"], sliding_window=True
        ),
    ),
    "bench_ssmkern": (
        "gdn",
        50,
        dict(kinds=["linear"], linear_variants=["gated_deltanet", "mamba2"]),
    ),
    "bench_oldgpu": ("legacy", 150, dict(kinds=["full"], max_compute_capability=(8, 9))),
}


def write_plugins(folder: Path) -> list[EntryPoint]:
    eps = [EntryPoint(name="attn_core", value="attn_core.reference.plugin", group="attn_core")]
    for module, (backend, priority, caps) in PLUGINS.items():
        caps = {"device_types": ["cuda"], "dtypes": ["bfloat16", "float16"], **caps}  # required
        src = PLUGIN_TEMPLATE.format(name=module, backend=backend, priority=priority, caps=caps)
        (folder / f"{module}.py").write_text(textwrap.dedent(src))
        eps.append(EntryPoint(name=module.removeprefix("bench_"), value=module, group="attn_core"))
    return eps


def hybrid64() -> list[LayerSpec]:
    full = LayerSpec(kind="full", num_heads=16, num_kv_heads=2, head_dim=256)
    sliding = full.with_(sliding_window=4096)
    gdn = LayerSpec(
        kind="linear",
        linear_variant="gated_deltanet",
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        conv_kernel_size=4,
        conv_channels=8192,
        qk_l2norm=True,
    )
    return [gdn if i % 4 != 3 else (full if i % 8 == 3 else sliding) for i in range(64)]


def _ms(samples: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "min_ms": min(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    import attn_core.reference.plugin  # noqa: F401  (torch import is not the registry's cost)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        eps = write_plugins(folder)
        sys.path.insert(0, str(folder))
        original = importlib.metadata.entry_points
        importlib.metadata.entry_points = lambda **kw: list(eps)  # type: ignore[assignment]
        try:
            discovery = []
            registry = None
            for _ in range(args.runs):
                for module in PLUGINS:
                    sys.modules.pop(module, None)
                importlib.invalidate_caches()
                t0 = time.perf_counter()
                registry = Registry.discover(strict=True, plugin_timeout=0)
                discovery.append(time.perf_counter() - t0)
            for module in PLUGINS:
                sys.modules.pop(module, None)
            t0 = time.perf_counter()
            Registry.discover(strict=True, probe_cache=False)  # every plugin probed
            first_start = [time.perf_counter() - t0]
        finally:
            importlib.metadata.entry_points = original
            sys.path.remove(str(folder))
    assert registry is not None
    assert len(registry.backends) == 5, registry.summary()

    specs = hybrid64()
    device = DeviceCapabilities.target("h200")
    constraints = ExecutionConstraints(downgrade="allow")
    selection, grouping = [], []
    plan = None
    for _ in range(args.runs):
        t0 = time.perf_counter()
        groups = group_layers(specs)
        t1 = time.perf_counter()
        plan = select(groups, registry, device, constraints)
        t2 = time.perf_counter()
        grouping.append(t1 - t0)
        selection.append(t2 - t1)

    assert plan is not None  # args.runs > 0: the registry assertion above held
    result = {
        "runs": args.runs,
        "plugins": len(registry.plugins),
        "backends": [b.qualified_name for b in registry.backends],
        "discovery": _ms(discovery) | {"target_ms": 300.0},
        "discovery_first_start": _ms(first_start),
        "group_layers_64": _ms(grouping),
        "selection_64_layers": _ms(selection) | {"target_ms": 50.0},
        "plan": {c.group.group_id: c.backend.qualified_name for c in plan.choices},
    }
    rows = [
        ("discovery (5 plugins)", result["discovery"], 300.0),
        ("  first start-up (4 probes)", result["discovery_first_start"], None),
        ("group_layers (64 layers)", result["group_layers_64"], None),
        ("select (64 layers, 5 plugins)", result["selection_64_layers"], 50.0),
    ]
    print(f"{'what':<32}{'median ms':>12}{'min ms':>10}{'max ms':>10}{'target ms':>11}")
    for label, r, target in rows:
        t = f"{target:.0f}" if target else "-"
        print(f"{label:<32}{r['median_ms']:>12.3f}{r['min_ms']:>10.3f}{r['max_ms']:>10.3f}{t:>11}")
    print("plan:", result["plan"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
