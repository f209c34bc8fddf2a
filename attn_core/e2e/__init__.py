"""End-to-end runner: tiny transformers models driven through attention bindings.

Public entry points: :func:`run_main` (``attn run``), :func:`measure_overhead` (``attn bench``).
"""

from __future__ import annotations

from attn_core.e2e.compare import MatchResult, Tolerance, compare_generation, compare_vision
from attn_core.e2e.configs import ARCHITECTURES, TinyModel, build_tiny, tiny_config
from attn_core.e2e.main import ArchitectureRun, RunReport, run_architecture, run_main
from attn_core.e2e.overhead import OverheadReport, measure_overhead
from attn_core.e2e.runner import Engine, GenerationResult

__all__ = [
    "ARCHITECTURES",
    "ArchitectureRun",
    "Engine",
    "GenerationResult",
    "MatchResult",
    "OverheadReport",
    "RunReport",
    "TinyModel",
    "Tolerance",
    "build_tiny",
    "compare_generation",
    "compare_vision",
    "measure_overhead",
    "run_architecture",
    "run_main",
    "tiny_config",
]
