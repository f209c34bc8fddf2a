"""``attn run --model NAME|CONFIG.json``: drive models end to end, check them against transformers.

:func:`run_main` builds each architecture's tiny transformers model (random weights, seeded),
plans its attention layout through the registry, runs continuous batching (chunked prefill,
mixed steps, greedy decode, optional CUDA-graph decode) through the bindings, and compares every
logit and greedy token with transformers' eager forward of the same model. A ``config.json``
(or a folder holding one) whose model_type one of those architectures covers runs at its own
sizes, with random weights; any other is refused with what ``attn explain`` maps instead.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attn_core.e2e.compare import MatchResult, compare_generation, compare_vision
from attn_core.e2e.configs import ARCHITECTURES, TinyModel, build_tiny
from attn_core.e2e.runner import Engine
from attn_core.e2e.vision import VisionRunner, sample_images
from attn_core.models import MODEL_TYPE_FAMILIES, sample_names, specs_from_hf_config
from attn_core.runtime import AttentionRuntime
from attn_core.selector import Plan, select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, GraphMode

__all__ = [
    "ArchitectureRun",
    "RunReport",
    "default_registry",
    "make_prompts",
    "plan_for",
    "resolve_models",
    "run_architecture",
    "run_main",
]

_ALIASES = {
    "qwen2.5-vl": "qwen2.5-vl-vision",
    "qwen2_5_vl": "qwen2.5-vl-vision",
    "qwen3_next": "qwen3-next",
    "deepseek_v3": "deepseek-v3",
    "gpt_oss": "gpt-oss",
    "mamba2": "bamba",
    "falcon_mamba": "falcon-mamba",
    "mamba1": "falcon-mamba",
}
_VISION_GRIDS = [(1, 8, 8), (1, 4, 12), (2, 4, 4), (1, 12, 8)]


@dataclass(frozen=True, slots=True)
class _Input:
    label: str  # what the report calls it: the sample name or the config path
    name: str  # the architecture (sample name) whose adapter drives it
    config: dict[str, Any] | None = None  # a config.json's dict; None: the shrunk sample


# Model types of the generic dense mapping whose modules the generic (qwen3) adapter drives:
# pre-norm layers with q/k/v projections and nothing outside the attention op it does not call
# (tests/e2e/test_run_dense.py checks them against transformers).
_DENSE_DRIVEN: tuple[str, ...] = ("ministral", "starcoder2")


def _driven_model_types() -> list[str]:
    return [
        t
        for t, family in MODEL_TYPE_FAMILIES.items()
        if family in ARCHITECTURES or (family == "dense" and t in _DENSE_DRIVEN)
    ]


def _config_input(part: str) -> _Input | None:
    """A config.json path (or a folder holding one) the runner drives; None if not a path."""
    path = Path(part)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        return None
    with file.open(encoding="utf-8") as fh:
        cfg = json.load(fh)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    layout = specs_from_hf_config(cfg)  # an unsupported config fails here, as in explain
    if layout.family == "dense" and layout.model_type in _DENSE_DRIVEN:
        return _Input(str(path), "qwen3", cfg)
    if layout.family not in ARCHITECTURES:
        raise ValueError(
            f"{part}: model_type {layout.model_type!r} is mapped by `attn explain {part}` "
            f"but `attn run` has no adapter for it yet; run drives config.json files of model "
            f"types {_driven_model_types()} and the samples {list(ARCHITECTURES)}"
        )
    return _Input(str(path), layout.family, cfg)


def _resolve(model: str) -> list[_Input]:
    inputs: list[_Input] = []
    for part in (p.strip() for p in model.split(",") if p.strip()):
        if part.lower() == "all":
            inputs.extend(_Input(n, n) for n in ARCHITECTURES)
            continue
        given = _config_input(part)
        if given is not None:
            inputs.append(given)
            continue
        name = _ALIASES.get(part.lower(), part.lower())
        if name in ARCHITECTURES:
            inputs.append(_Input(name, name))
        elif name in sample_names():
            raise ValueError(
                f"sample {part!r} is mapped by `attn explain {part}` but `attn run` has no "
                f"adapter for it yet; run drives the samples {list(ARCHITECTURES)} and "
                f"config.json files of model types {_driven_model_types()}"
            )
        else:
            raise ValueError(
                f"model {part!r} is not one the runner drives; choose 'all', one of "
                f"{list(ARCHITECTURES)}, or the path of a config.json (or of its folder) of "
                f"model type {_driven_model_types()}"
            )
    if not inputs:
        raise ValueError(f"model={model!r}: expected 'all' or one of {list(ARCHITECTURES)}")
    return list({i.label: i for i in inputs}.values())


def resolve_models(model: str) -> list[str]:
    """``"all"``, a comma list of architecture names (aliases allowed) or config.json paths
    (files or folders) -> the names the report uses (sample names, or the paths as given)."""
    return [i.label for i in _resolve(model)]


def default_registry():
    """A registry holding only the reference backend (when the caller passes none)."""
    import attn_core.reference.plugin as reference
    from attn_core.registry import Registry

    registry = Registry()
    registry.register_plugin(reference, name="attn_core")
    return registry


def default_shapes(device: torch.device | str, shapes: str | None) -> str:
    """``shapes`` if given, else ``"kernel"`` on CUDA (head dims the GPU kernels serve) and
    ``"tiny"`` elsewhere (see :func:`attn_core.e2e.configs.tiny_config`)."""
    if shapes is not None:
        return shapes
    return "kernel" if torch.device(device).type == "cuda" else "tiny"


def make_prompts(n: int, *, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of varied lengths (3..17 tokens), deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i + 4) % 15 for i in range(n)]
    return [torch.randint(3, vocab, (L,), generator=gen).tolist() for L in lengths]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_for(
    model: TinyModel,
    registry: Any,
    device: torch.device,
    constraints: ExecutionConstraints | None,
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_model_len: int,
    graphs: bool,
) -> Plan:
    """Select backends for the model's groups under the run's constraints (sizes capped)."""
    base = constraints or ExecutionConstraints()
    c = base.with_(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_model_len=max_model_len,
        graph_mode=GraphMode.DECODE if graphs and not model.is_encoder else GraphMode.NONE,
    )
    return select(model.layout.groups, registry, DeviceCapabilities.detect(device), c)


@dataclass
class ArchitectureRun:
    """One architecture's run: what was selected, whether it matched, how fast, how many steps."""

    name: str
    architecture: str
    layout: str
    plan: dict[str, Any]
    match: MatchResult
    steps: int
    mode_counts: dict[str, int]
    tokens: int
    seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float = 0.0
    graph_replays: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.match.ok

    def format(self) -> str:
        lines = [f"== {self.name} ({self.architecture})"]
        for g in self.plan["groups"]:
            layers = ",".join(str(i) for i in g["layers"])
            lines.append(
                f"   {g['group_id']:<8} -> {g['backend']:<28} {g['spec']}  [layers {layers}]"
            )
        lines.append(f"   {self.match.short()}")
        modes = ", ".join(f"{k} {v}" for k, v in sorted(self.mode_counts.items()))
        speed = f"{self.tokens_per_second:,.0f} tok/s"
        if self.decode_tokens_per_second:
            speed += f", decode {self.decode_tokens_per_second:,.0f} tok/s"
        lines.append(
            f"   {self.steps} steps ({modes}); {self.tokens} tokens in {self.seconds:.2f}s: {speed}"
        )
        if self.graph_replays:
            lines.append(f"   CUDA-graph decode replays: {self.graph_replays}")
        lines += [f"   note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "plan": self.plan,
            "match": self.match.to_dict(),
            "steps": self.steps,
            "mode_counts": self.mode_counts,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "graph_replays": self.graph_replays,
            "notes": self.notes,
        }


@dataclass
class RunReport:
    """What ``attn run`` prints: per architecture the plan, the match with transformers, speed."""

    model: str
    device: str
    dtype: str
    runs: list[ArchitectureRun]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def format(self) -> str:
        head = f"attn run --model {self.model}  (device {self.device}, dtype {self.dtype})"
        body = "\n".join(r.format() for r in self.runs)
        passed = sum(r.ok for r in self.runs)
        tail = f"{passed}/{len(self.runs)} architectures match transformers"
        return f"{head}\n{body}\n{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "ok": self.ok,
            "runs": [r.to_dict() for r in self.runs],
        }


def run_architecture(
    name: str,
    *,
    device: torch.device | str = "cpu",
    dtype: str = "float32",
    prompts: int = 4,
    max_new_tokens: int = 8,
    graphs: bool = False,
    registry: Any = None,
    constraints: ExecutionConstraints | None = None,
    chunk_size: int = 5,
    on_progress: Callable[[int, int, int], None] | None = None,
    shapes: str | None = None,
    config: dict[str, Any] | None = None,
    label: str | None = None,
) -> ArchitectureRun:
    """Build, run and compare one architecture (see :func:`run_main`).

    :param config: a ``config.json`` dict of architecture ``name`` to run at its own sizes
        instead of the shrunk sample; ``label`` (default ``name``) names it in the report.
    """
    device = torch.device(device)
    registry = registry if registry is not None else default_registry()
    model = build_tiny(
        name, device=device, dtype=dtype, shapes=default_shapes(device, shapes), config=config
    )
    label = label if label is not None else name
    notes: list[str] = []
    if model.is_encoder:
        grids = [_VISION_GRIDS[i % len(_VISION_GRIDS)] for i in range(max(prompts, 1))]
        tokens = sum(t * h * w for t, h, w in grids)
        plan = plan_for(
            model,
            registry,
            device,
            constraints,
            max_batch_size=256,
            max_num_tokens=max(tokens, 1),
            max_model_len=max(tokens, 1),
            graphs=False,
        )
        runtime = AttentionRuntime(plan, registry, state=None, device=device)
        pixels, grid_thw = sample_images(model, grids)
        t0 = time.perf_counter()
        vision = VisionRunner(model, runtime, max_tokens=tokens).forward(pixels, grid_thw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if on_progress:
            on_progress(len(grids), len(grids), len(vision.blocks))
        match = compare_vision(model, vision, pixels, grid_thw)
        if graphs:
            notes.append("the vision tower runs without CUDA graphs (one encoder pass)")
        return ArchitectureRun(
            label,
            model.layout.architecture,
            model.layout.short(),
            plan.to_dict(),
            match,
            steps=len(vision.blocks),
            mode_counts={"encoder": len(vision.blocks)},
            tokens=tokens,
            seconds=seconds,
            tokens_per_second=tokens / seconds if seconds else 0.0,
            notes=notes,
        )
    prompt_ids = make_prompts(prompts)
    batch = _pow2(max(prompts, 1))
    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + 1
    plan = plan_for(
        model,
        registry,
        device,
        constraints,
        max_batch_size=batch,
        max_num_tokens=batch * chunk_size,
        max_model_len=max_len,
        graphs=graphs,
    )
    engine = Engine(
        model,
        plan,
        registry,
        device=device,
        chunk_size=chunk_size,
        max_batch_size=batch,
        max_model_len=max_len,
        graphs=graphs,
    )
    result = engine.generate(prompt_ids, max_new_tokens, progress=on_progress)
    if result.graph_note:
        notes.append(result.graph_note)
    match = compare_generation(model, result)
    return ArchitectureRun(
        label,
        model.layout.architecture,
        model.layout.short(),
        plan.to_dict(),
        match,
        steps=result.steps,
        mode_counts=result.mode_counts(),
        tokens=result.total_tokens,
        seconds=result.total_seconds,
        tokens_per_second=result.tokens_per_second,
        decode_tokens_per_second=result.decode_tokens_per_second,
        graph_replays=result.graph_replays,
        notes=notes,
    )


@contextlib.contextmanager
def _progress_display(enabled: bool, console: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Yields ``start(name, total) -> update(done, total, step)``: rich bars when rich is
    installed and output goes to print, else one plain line per finished architecture."""
    if enabled and console is print:
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        except ImportError:
            pass
        else:
            with Progress(
                TextColumn("{task.description:<20}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("step {task.fields[step]}"),
                transient=True,
            ) as bar:

                def start(name: str, total: int):
                    task = bar.add_task(name, total=total, step=0)
                    return lambda done, _total, step: bar.update(task, completed=done, step=step)

                yield start
                return

    def start_plain(name: str, total: int):
        if enabled:
            console(f"running {name} ({total} requests) ...")
        return None

    yield start_plain


def run_main(
    model: str,
    *,
    device: str,
    dtype: str,
    prompts: int,
    max_new_tokens: int,
    graphs: bool,
    registry: Any,
    constraints: ExecutionConstraints | None,
    progress: bool = True,
    console: Callable[..., Any] = print,
    shapes: str | None = None,
) -> RunReport:
    """Entry point of ``attn run --model NAME``.

    :param model: ``"all"``, one architecture (``qwen3``, ``qwen3-next``, ``deepseek-v3``,
        ``bamba``, ``gpt-oss``, ``qwen2.5-vl-vision``), the path of a ``config.json`` (or of
        its folder) whose model_type one of them covers (run at the config's own sizes, random
        weights; ``shapes`` does not apply), or a comma list.
    :param device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
    :param dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` (aliases ``fp32``, ``bf16``).
    :param prompts: requests per architecture (images for the vision tower).
    :param max_new_tokens: greedy tokens per request.
    :param graphs: capture pure-decode steps in CUDA graphs (CUDA only; noted otherwise).
    :param registry: the loaded :class:`~attn_core.registry.Registry` (None: reference only).
    :param constraints: the run's :class:`ExecutionConstraints`; batch / token / length limits
        and the graph mode are set from the run itself.
    :param progress: show a progress display.
    :param console: where plain progress lines go.
    :param shapes: ``"tiny"`` or ``"kernel"`` model shapes (default: kernel on CUDA).
    :returns: a :class:`RunReport`; ``report.format()`` is the text to print.
    """
    from attn_core.specs import DTYPES, _canonical_dtype

    dtype = _canonical_dtype(dtype, DTYPES, "dtype")
    inputs = _resolve(model)
    if prompts < 1 or max_new_tokens < 1:
        raise ValueError(f"prompts={prompts}, max_new_tokens={max_new_tokens}: both must be >= 1")
    registry = registry if registry is not None else default_registry()
    runs = []
    with _progress_display(progress, console) as start:
        for given in inputs:
            update = start(given.label, prompts)
            runs.append(
                run_architecture(
                    given.name,
                    config=given.config,
                    label=given.label,
                    device=device,
                    dtype=dtype,
                    prompts=prompts,
                    max_new_tokens=max_new_tokens,
                    graphs=graphs,
                    registry=registry,
                    constraints=constraints,
                    on_progress=update,
                    shapes=shapes,
                )
            )
    return RunReport(model, str(torch.device(device)), dtype, runs)
