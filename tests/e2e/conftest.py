"""Shared fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def run_on_cpu() -> Callable[..., Any]:
    """``attn run --model MODEL`` in fp32 on the CPU, eager, quiet: 2 prompts, 3 new tokens;
    keyword arguments go to ``run_main`` as well (``stack=``, ``layers=``, ...); returns the
    run's report."""
    from attn_core.e2e import run_main

    def run(model: str, **options: Any) -> Any:
        return run_main(
            model,
            device="cpu",
            dtype="fp32",
            prompts=2,
            max_new_tokens=3,
            graphs=False,
            registry=None,
            constraints=None,
            progress=False,
            console=lambda *a: None,
            **options,
        )

    return run
