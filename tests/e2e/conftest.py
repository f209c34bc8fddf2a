"""Shared fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

_REFERENCE = "attn_core:reference"


def _on_reference(plan: dict[str, Any]) -> dict[str, list[str]]:
    """The groups of ``plan`` (``Plan.to_dict()``) that run some step on the reference backend:
    the group's choice, a phase's (prefill / decode / verify) or one a phase switches to by step
    size or requests; each with every rejection that group's phases name (``phase: backend
    [code] reason``), which says why no GPU plugin took it."""
    out: dict[str, list[str]] = {}
    for g in plan["groups"]:
        phases: dict[str, Any] = g.get("phases") or {"all": g}
        backends = {g["backend"]}
        for p in phases.values():
            backends.add(p["backend"])
            backends.update(
                s["backend"] for k in ("by_step_size", "by_requests") for s in p.get(k, ())
            )
        if _REFERENCE in backends:
            out[g["group_id"]] = [
                f"{name}: {r['backend']} [{r['code']}] {r['reason']}"
                for name, p in phases.items()
                for r in p["rejected"]
            ]
    return out


@pytest.fixture
def run_on_cpu() -> Callable[..., Any]:
    """``attn run --model MODEL`` in fp32 on the CPU, eager, quiet: 2 prompts, 3 new tokens;
    keyword arguments go to ``run_main`` as well and take the place of these (``stack=``,
    ``layers=``, ``dtype="bf16"``, ...); returns the run's report."""
    from attn_core.e2e import run_main

    def run(model: str, **options: Any) -> Any:
        defaults: dict[str, Any] = dict(
            device="cpu",
            dtype="fp32",
            prompts=2,
            max_new_tokens=3,
            graphs=False,
            registry=None,
            constraints=None,
            progress=False,
            console=lambda *a: None,
        )
        return run_main(model, **{**defaults, **options})

    return run


@pytest.fixture
def run_on_gpu_plugins() -> Callable[..., Any]:
    """``attn run --model MODEL --device cuda`` in bf16 on the plugins found by entry points
    (``graphs``: False, or ``"decode"`` for CUDA-graph decode), quiet: 3 prompts, 4 new tokens
    (other keyword arguments go to ``run_main``). Asserts that the tokens and logits match
    transformers' own bf16 forward, that every step of every layer group runs on a GPU plugin,
    not the reference (a group that stayed on it fails naming its plugins' rejections), and,
    with graphs, that decode steps replayed captured graphs (``capture_fails``: that the report
    says why capture failed and decode ran eagerly); returns the run's report. Skips
    without a CUDA GPU."""

    def run(model: str, *, graphs: bool | str, capture_fails: bool = False, **options: Any) -> Any:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        from attn_core.e2e import run_main
        from attn_core.registry import Registry

        args: dict[str, Any] = dict(
            device="cuda",
            dtype="bf16",
            prompts=3,
            max_new_tokens=4,
            graphs=graphs,
            registry=Registry.discover(),  # None would mean the reference alone
            constraints=None,
            progress=False,
            console=lambda *a: None,
        )
        report = run_main(model, **{**args, **options})
        text = report.format()
        assert report.ok and "MATCH" in text, text
        assert report.runs, text
        for arch in report.runs:
            assert arch.plan["groups"], text
            left = _on_reference(arch.plan)
            assert not left, f"groups no GPU plugin took from the reference: {left}\n{text}"
            if graphs and capture_fails:  # the model's own code cannot be captured: said so
                assert arch.graph_replays == 0 and "graph capture failed" in text, text
            elif graphs:
                assert arch.graph_replays > 0, text
        return report

    return run


@pytest.fixture
def h200_plan() -> Callable[..., dict[str, Any]]:
    """The offline plan (no GPU needed) an H200 gets for the ``config.json`` at ``path`` in
    bf16 with the plugins found by entry points, under the graph mode ``graphs`` asks for
    (False / ``"decode"``); asserts that it keeps that graph mode and that no group stays on the
    reference (see ``run_on_gpu_plugins``); returns ``Plan.to_dict()``. It checks on CPU that
    a GPU test's config has the shapes the GPU plugins serve."""

    def plan(path: str, *, graphs: bool | str) -> dict[str, Any]:
        from attn_core.e2e.runner import graph_mode_of
        from attn_core.models import specs_from_hf_config
        from attn_core.registry import Registry
        from attn_core.selector import select
        from attn_core.specs import DeviceCapabilities, ExecutionConstraints

        layout = specs_from_hf_config(path, dtype="bfloat16")
        mode = graph_mode_of(graphs)
        chosen = select(
            layout.groups,
            Registry.discover(),
            DeviceCapabilities.target("h200"),
            ExecutionConstraints(graph_mode=mode),
        ).to_dict()
        assert chosen["graph_mode"] == mode.value, chosen
        left = _on_reference(chosen)
        assert not left, f"groups no GPU plugin takes from the reference on an H200: {left}"
        return chosen

    return plan
