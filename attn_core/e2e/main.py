"""``attn run --model NAME|CONFIG.json``: drive models end to end, check them against transformers.

:func:`run_main` builds each architecture's tiny transformers model (random weights, seeded),
plans its attention layout through the registry, runs continuous batching (chunked prefill,
mixed steps, greedy decode, optional CUDA-graph decode) through the bindings, and compares every
logit and greedy token with transformers' eager forward of the same model. A ``config.json``
(or a folder holding one) whose model_type one of those architectures covers runs at its own
sizes, with random weights, or with the folder's safetensors weights when it has them (a
``save_pretrained`` checkpoint); any other is refused with what ``attn explain`` maps instead.
On CUDA a warm-up generation runs first, so the throughput excludes JIT compilation and graph
capture (printed on a line of their own).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attn_core.e2e.compare import MatchResult, compare_generation, compare_vision
from attn_core.e2e.configs import (
    ARCHITECTURES,
    ENCODER_RUNS,
    TinyModel,
    build_tiny,
    first_layers,
    real_size_config,
    run_stack,
)
from attn_core.e2e.hf_reference import check_hf_forward
from attn_core.e2e.runner import Engine, graph_mode_of
from attn_core.e2e.vision import VisionRunner, encoder_inputs
from attn_core.models import (
    MODEL_TYPE_FAMILIES,
    MULTI_STACK_MODEL_TYPES,
    SAMPLE_STACKS,
    ModelLayout,
    load_sample,
    sample_names,
    specs_from_hf_config,
    stack_families,
)
from attn_core.runtime import AttentionRuntime
from attn_core.selector import Plan, select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, GraphMode

__all__ = [
    "ArchitectureRun",
    "RunReport",
    "default_registry",
    "explain_inputs",
    "make_prompts",
    "plan_for",
    "resolve_models",
    "run_architecture",
    "run_main",
]

_ALIASES = {
    "qwen2.5-vl": "qwen2.5-vl-vision",
    "qwen2_5_vl": "qwen2.5-vl-vision",
    "qwen2-vl": "qwen2-vl-vision",
    "qwen2_vl": "qwen2-vl-vision",
    "siglip": "siglip-vision",
    "qwen3_next": "qwen3-next",
    "deepseek_v3": "deepseek-v3",
    "kimi_linear": "kimi-linear",
    "gpt_oss": "gpt-oss",
    "mamba2": "bamba",
    "falcon_mamba": "falcon-mamba",
    "mamba1": "falcon-mamba",
    "falcon_h1": "falcon-h1",
}


@dataclass(frozen=True, slots=True)
class _Input:
    label: str  # what the report calls it: the sample name or the config path
    name: str  # the architecture (sample name) whose adapter drives it
    config: dict[str, Any] | None = None  # a config.json's dict; None: the shrunk sample
    checkpoint: str | None = None  # a folder with safetensors weights to load
    stack: str | None = None  # the stack of a multi-stack config this run drives
    notes: tuple[str, ...] = ()  # what of a multi-stack config this run does not drive, and why


# Stack families of multi-stack configs that `attn run` has no adapter for, and why: a run of
# the config drives its other stacks and says this.
_NOT_DRIVEN: dict[str, str] = {
    "llama-4-vision": "attn run has no adapter for the Llama-4 vision tower (2D rotary per "
    "tile, pixel shuffle); `attn explain` plans its groups",
}


def _stack_notes(
    cfg: dict[str, Any], driven: list[str], *, skipped: str = "not asked for (--stack)"
) -> list[str]:
    """Notes on a multi-stack config's stacks not in ``driven``: why each is not run
    (``skipped``: why for one the runner could drive)."""
    families = stack_families(cfg)
    notes = []
    for stack, family in families.items():
        if stack in driven:
            continue
        if not family:  # a stack no layer kind describes: its refusal says why
            try:
                specs_from_hf_config(cfg, stack=stack)
                why = "no layer kind describes it"
            except ValueError as err:  # its first clause: the feature and its layers
                why = str(err).split("; ")[0]
        elif family in ARCHITECTURES or family in _CONFIG_FAMILIES:
            why = skipped
        else:
            why = _NOT_DRIVEN.get(family, f"attn run has no adapter for {family}")
        notes.append(f"stack {stack} ({family or 'unmapped'}) is not run here: {why}")
    return notes


def _sample_notes(name: str) -> tuple[str, ...]:
    """A sample named for one stack of a multi-stack sample (:data:`SAMPLE_STACKS`): which stack
    runs, and why the others do not."""
    if name not in SAMPLE_STACKS:
        return ()
    stack = SAMPLE_STACKS[name][1]
    cfg = load_sample(name)  # the whole model's config
    head = f"runs stack {stack} of {cfg['model_type']} (stacks {', '.join(stack_families(cfg))})"
    why = (
        "the sample runs this stack alone, at tiny sizes; `attn run` of a config.json of the "
        "model runs every stack it has an adapter for"
    )
    return (head, *_stack_notes(cfg, [stack], skipped=why))


# Families with no bundled sample that run from a config.json (or checkpoint): through the
# layer-forward adapter the generic dense mapping's model types (any dense family using the
# common names, tests/e2e/test_run_dense.py), Granite-4.0-H, Qwen3.5 and the gdn-hybrid family
# (Lara-Mini, Qwen4-Exp; tests/e2e/test_run_families.py) and the Qwen-VL language models;
# through the tower driver the Qwen3-VL and Qwen3.5 vision towers (tests/e2e/test_run_qwen_vl.py)
# and LLaVA's CLIP tower (tests/e2e/test_run_llava.py); each checked against transformers.
_CONFIG_FAMILIES: tuple[str, ...] = (
    "dense",
    "granite-4.0-h",
    "qwen3.5",
    "gdn-hybrid",
    "qwen2-vl-text",
    "qwen3-vl-text",
    "qwen3-vl-vision",
    "qwen3.5-vision",
    "clip-vision",
)


# Hub configs of remote-code models a family maps but transformers cannot build, and the
# transformers form that `attn run` drives instead.
_HUB_ONLY: dict[str, str] = {
    "minimax_m1": "model_type 'minimax' with layer_types",
    "minimax_text_01": "model_type 'minimax' with layer_types",
}


def _driven_model_types() -> list[str]:
    """The named model types ``attn run`` drives from a config.json (plus any other model type
    the generic dense mapping reads)."""
    return [
        t
        for t, family in MODEL_TYPE_FAMILIES.items()
        if t not in _HUB_ONLY
        and (
            family in ARCHITECTURES
            or family in _CONFIG_FAMILIES
            # a multi-stack model type: run drives the stacks it has an adapter for
            or any(
                f in ARCHITECTURES or f in _CONFIG_FAMILIES
                for f in MULTI_STACK_MODEL_TYPES.get(t, {}).values()
            )
        )
    ]


def _config_input(part: str, stack: str | None = None) -> list[_Input] | None:
    """A config.json path (or a folder holding one) the runner drives; None if not a path.

    A multi-stack config gives one input per stack the runner drives (``stack``: that one),
    each labelled ``PATH [stack]`` and noting the stacks it does not run."""
    path = Path(part)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        return None
    with file.open(encoding="utf-8") as fh:
        cfg = json.load(fh)
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    # an unsupported config (or stack: Whisper's decoder) fails here, as in explain
    layout = specs_from_hf_config(cfg, stack=stack)
    if layout.stacks or layout.stack:
        return _stack_inputs(part, path, cfg, layout.stacks or (layout,))
    if layout.model_type in _HUB_ONLY:
        raise ValueError(
            f"{part}: model_type {layout.model_type!r} is mapped by `attn explain {part}`, but "
            f"transformers has no class for it (remote code only); `attn run` builds the model "
            f"with transformers: give the config in transformers' form "
            f"({_HUB_ONLY[layout.model_type]})"
        )
    weights = path.is_dir() and any(path.glob("*.safetensors"))
    checkpoint = str(path) if weights else None
    if layout.family not in ARCHITECTURES and layout.family not in _CONFIG_FAMILIES:
        raise ValueError(
            f"{part}: model_type {layout.model_type!r} is mapped by `attn explain {part}` "
            f"but `attn run` has no adapter for it yet; run drives config.json files of model "
            f"types {_driven_model_types()} and the samples {list(ARCHITECTURES)}"
        )
    return [_Input(str(path), layout.family, cfg, checkpoint)]


def _stack_inputs(
    part: str, path: Path, cfg: dict[str, Any], stacks: Sequence[ModelLayout]
) -> list[_Input]:
    """The runs of a multi-stack config: each stack (of ``stacks``) the runner has an adapter
    for; refused when there is none."""
    weights = path.is_dir() and any(path.glob("*.safetensors"))
    checkpoint = str(path) if weights else None
    driven = [
        s
        for s in stacks
        if (s.family in ARCHITECTURES or s.family in _CONFIG_FAMILIES)
        and not (checkpoint and s.family in ENCODER_RUNS)
    ]
    if not driven:
        names = [f"{s.stack} ({s.family})" for s in stacks]
        raise ValueError(
            f"{part}: model_type {cfg.get('model_type')!r}: `attn run` drives none of the "
            f"stacks {names}; {'; '.join(_stack_notes(cfg, []))}"
        )
    notes = _stack_notes(cfg, [s.stack for s in driven])
    if checkpoint:
        notes += [
            f"stack {s.stack} is not run: weights load for language models only"
            for s in stacks
            if s.family in ENCODER_RUNS
        ]
    return [
        _Input(
            f"{path} [{s.stack}]",
            s.family,
            cfg,
            None if s.family in ENCODER_RUNS else checkpoint,
            s.stack,
            (f"runs stack {s.stack} of {cfg.get('model_type')}", *notes),
        )
        for s in driven
    ]


def _stack_sample(part: str, name: str, stack: str) -> str:
    """The sample named for stack ``stack`` of sample ``name`` (``--stack``)."""
    file = SAMPLE_STACKS.get(name, (name, ""))[0]
    for sample, (whole, named) in SAMPLE_STACKS.items():
        if whole == file and named == stack:
            return sample
    known = [f"{k} ({v[1]})" for k, v in SAMPLE_STACKS.items() if v[0] == file]
    raise ValueError(
        f"sample {part!r}: `attn run` drives no stack {stack!r} of it"
        + (f"; its stacks that run: {known}" if known else " (it has one stack)")
    )


def _resolve(model: str, stack: str | None = None) -> list[_Input]:
    inputs: list[_Input] = []
    for part in (p.strip() for p in model.split(",") if p.strip()):
        if part.lower() == "all":
            inputs.extend(_Input(n, n, notes=_sample_notes(n)) for n in ARCHITECTURES)
            continue
        given = _config_input(part, stack)
        if given is not None:
            inputs.extend(given)
            continue
        name = _ALIASES.get(part.lower(), part.lower())
        if stack is not None and name in sample_names():
            name = _stack_sample(part, name, stack)
        if name in ARCHITECTURES:
            inputs.append(_Input(name, name, notes=_sample_notes(name)))
        elif name in sample_names():
            specs_from_hf_config(name)  # a sample explain refuses too (Whisper): its reason
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


def resolve_models(model: str, stack: str | None = None) -> list[str]:
    """``"all"``, a comma list of architecture names (aliases allowed) or config.json paths
    (files or folders) -> the names the report uses (sample names, or the paths as given; a
    multi-stack config's ``PATH [stack]`` per stack that runs)."""
    return [i.label for i in _resolve(model, stack)]


def explain_inputs(model: str) -> list[str]:
    """``attn run``'s ``--model`` vocabulary as ``attn explain`` reads it: ``"all"`` (every
    architecture the runner drives), a comma list, run's spellings of a name (``qwen3_next``),
    samples and config.json paths (files or folders), each once, in the order given.

    A sample keeps its own meaning (``qwen2-vl``: the whole model, both stacks, where ``attn
    run qwen2-vl`` drives its vision tower); any other name is left as given, for explain's
    own error to name."""
    names: list[str] = []
    for part in (p.strip() for p in model.split(",") if p.strip()):
        if part.lower() == "all":
            names.extend(ARCHITECTURES)
        elif Path(part).exists() or part in sample_names():
            names.append(part)
        else:
            names.append(_ALIASES.get(part.lower(), part))
    if not names:  # "" or ",": run refuses them alike
        raise ValueError(f"model={model!r}: expected 'all' or one of {list(ARCHITECTURES)}")
    return list(dict.fromkeys(names))


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
    graphs: bool | str,
) -> Plan:
    """Select backends for the model's groups under the run's constraints (sizes capped)."""
    base = constraints or ExecutionConstraints()
    c = base.with_(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_model_len=max_model_len,
        graph_mode=GraphMode.NONE if model.is_encoder else graph_mode_of(graphs),
    )
    return select(model.layout.groups, registry, DeviceCapabilities.detect(device), c)


def encoder_runner(
    model: TinyModel,
    registry: Any,
    device: torch.device,
    constraints: ExecutionConstraints | None,
    tokens: int,
) -> VisionRunner:
    """An encoder stack's runner: its groups planned for one pass over ``tokens`` tokens
    (no persistent state, no CUDA graphs: an encoder runs once per input)."""
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
    return VisionRunner(model, runtime, max_tokens=tokens)


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
    mixed_graph_replays: int = 0  # prefill / mixed steps replayed in a graph (graph mode full)
    notes: list[str] = field(default_factory=list)
    weights: str = "random"  # "random" (seeded init) or the checkpoint folder loaded
    warmup_seconds: float | None = None  # the warm-up pass (None: none ran)
    capture_seconds: float = 0.0  # CUDA-graph capture, all of it inside the warm-up pass
    overhead: Any = None  # an OverheadReport when asked for (--overhead)

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
            others = {
                phase: p["backend"]
                for phase, p in g.get("phases", {}).items()
                if p["backend"] != g["backend"]
            }
            if others:  # phases served by another backend than prefill / mixed steps
                lines.append("   " + " " * 12 + "; ".join(f"{ph}: {b}" for ph, b in others.items()))
        lines.append(f"   {self.match.short()}")
        if self.weights != "random":
            lines.append(f"   weights: {self.weights}")
        modes = ", ".join(f"{k} {v}" for k, v in sorted(self.mode_counts.items()))
        speed = f"{self.tokens_per_second:,.0f} tok/s"
        if self.decode_tokens_per_second:
            speed += f", decode {self.decode_tokens_per_second:,.0f} tok/s"
        lines.append(
            f"   {self.steps} steps ({modes}); {self.tokens} tokens in {self.seconds:.2f}s: {speed}"
        )
        if self.warmup_seconds is not None:
            lines.append(
                f"   warm-up pass (JIT compile, CUDA-graph capture; not in the figures above): "
                f"{self.warmup_seconds:.2f}s, of which graph capture {self.capture_seconds:.2f}s"
            )
        else:
            lines.append("   no warm-up pass: the figures above include first-call costs")
        if self.overhead is not None:
            o = self.overhead
            lines.append(
                f"   overhead (eager decode step, batch {o.batch_size}, context "
                f"{o.context_len}): binding {o.binding_ms:.3f} ms, direct {o.direct_ms:.3f} ms, "
                f"ratio {o.ratio:.3f} ({o.per_layer_us:+.1f} us per attention layer)"
            )
        if self.graph_replays:
            lines.append(f"   CUDA-graph decode replays: {self.graph_replays}")
        if self.mixed_graph_replays:
            lines.append(
                f"   CUDA-graph mixed-step replays (graph mode full): {self.mixed_graph_replays}"
            )
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
            "mixed_graph_replays": self.mixed_graph_replays,
            "notes": self.notes,
            "weights": self.weights,
            "warmup_seconds": self.warmup_seconds,
            "capture_seconds": self.capture_seconds,
            "overhead": self.overhead.to_dict() if self.overhead is not None else None,
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

    def format_head(self) -> str:
        return f"attn run --model {self.model}  (device {self.device}, dtype {self.dtype})"

    def format_tail(self) -> str:
        passed = sum(r.ok for r in self.runs)
        return f"{passed}/{len(self.runs)} architectures match transformers"

    def format(self) -> str:
        body = "\n".join(r.format() for r in self.runs)
        return f"{self.format_head()}\n{body}\n{self.format_tail()}"

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
    graphs: bool | str = False,
    registry: Any = None,
    constraints: ExecutionConstraints | None = None,
    chunk_size: int = 5,
    on_progress: Callable[[int, int, int], None] | None = None,
    shapes: str | None = None,
    config: dict[str, Any] | None = None,
    label: str | None = None,
    checkpoint: str | None = None,
    warmup: bool | None = None,
    layers: int | None = None,
    overhead: bool = False,
    stack: str | None = None,
    stack_notes: Sequence[str] = (),
) -> ArchitectureRun:
    """Build, run and compare one architecture (see :func:`run_main`).

    :param config: a ``config.json`` dict of architecture ``name`` to run at its own sizes
        instead of the shrunk sample; ``label`` (default ``name``) names it in the report.
    :param checkpoint: a folder with safetensors weights (and ``config``'s config.json) to load
        instead of random init; the comparison is with transformers' forward of that model.
    :param warmup: run the whole generation once before the timed one, so JIT compilation and
        CUDA-graph capture stay out of the throughput (None: on CUDA only).
    :param layers: keep only the first ``layers`` layers (their layer pattern kept) of the
        sample at its real sizes (or of ``config``); ``shapes`` then does not apply.
    :param overhead: also time one eager decode step through the bindings and with the same
        kernels called directly (:func:`attn_core.e2e.overhead.measure_overhead`).
    :param stack: the stack of a multi-stack ``config`` to run (default: the one ``name``
        drives, :func:`attn_core.e2e.configs.run_stack`).
    :param stack_notes: lines the report prints with the run (which stack of a multi-stack
        config runs, and why the others do not).
    """
    device = torch.device(device)
    registry = registry if registry is not None else default_registry()
    cut_note = ""
    if layers is not None:
        whole = config if config is not None else real_size_config(name)
        config = first_layers(whole, layers)
        tower = whole.get("vision_config") if run_stack(name, whole) == "vision" else None
        if isinstance(tower, dict):  # a multimodal config: its tower's blocks are what runs
            total = tower.get("depth", tower.get("num_hidden_layers"))
        elif name == "whisper-encoder":
            total = whole.get("encoder_layers")
        else:
            total = whole.get("num_hidden_layers") or (whole.get("text_config") or {}).get(
                "num_hidden_layers", (whole.get("vision_config") or {}).get("depth")
            )
        cut_note = f"first {layers} of {total} layers, at the config's real sizes"
    model = build_tiny(
        name,
        device=device,
        dtype=dtype,
        shapes=default_shapes(device, shapes),
        config=config,
        checkpoint=checkpoint,
        stack=stack,
    )
    label = label if label is not None else name
    notes = [*([cut_note] if cut_note else []), *stack_notes, *model.notes]
    if model.is_encoder:
        pixels, grid_thw, tokens = encoder_inputs(model, prompts)
        runner = encoder_runner(model, registry, device, constraints, tokens)
        t0 = time.perf_counter()
        vision = runner.forward(pixels, grid_thw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if on_progress:
            images = max(prompts, 1)  # the images (clips) encoder_inputs made
            on_progress(images, images, len(vision.blocks))
        match = compare_vision(model, vision, pixels, grid_thw)
        if graphs:
            notes.append("the encoder runs without CUDA graphs (one encoder pass)")
        return ArchitectureRun(
            label,
            model.layout.architecture,
            model.layout.short(),
            runner.runtime.plan.to_dict(),
            match,
            steps=len(vision.blocks),
            mode_counts={"encoder": len(vision.blocks)},
            tokens=tokens,
            seconds=seconds,
            tokens_per_second=tokens / seconds if seconds else 0.0,
            notes=notes,
        )
    # token ids inside the model's vocabulary (a config.json may have fewer than 256 tokens)
    hf: Any = model.hf  # a transformers PreTrainedModel (typed as a Module)
    vocab = int(hf.get_input_embeddings().weight.shape[0])
    prompt_ids = make_prompts(prompts, vocab=min(vocab, 256))
    # transformers' forward is what every logit is compared with: a config it cannot run is
    # refused here, naming the layer and module, before a step fails inside its modules
    check_hf_forward(hf, model.layout, prompt_ids[0][:4])
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
    warmup_seconds = None
    if warmup if warmup is not None else device.type == "cuda":
        # Same prompts, same schedule: every kernel shape compiles and every graph size is
        # captured here; the timed pass below only replays. The state is released after it.
        t0 = time.perf_counter()
        engine.generate(prompt_ids, max_new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        warmup_seconds = time.perf_counter() - t0
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
        mixed_graph_replays=result.mixed_graph_replays,
        notes=notes,
        weights=checkpoint or "random",
        warmup_seconds=warmup_seconds,
        capture_seconds=engine.capture_seconds,
        overhead=_overhead(model, registry, device, constraints) if overhead else None,
    )


def _overhead(model: TinyModel, registry: Any, device: torch.device, constraints: Any) -> Any:
    from attn_core.e2e.overhead import measure_overhead

    return measure_overhead(
        model.name,
        str(device),
        dtype=model.layout.layer_specs[0].dtype,
        registry=registry,
        constraints=constraints,
        model_obj=model,
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
    graphs: bool | str,
    registry: Any,
    constraints: ExecutionConstraints | None,
    progress: bool = True,
    console: Callable[..., Any] = print,
    shapes: str | None = None,
    warmup: bool | None = None,
    layers: int | None = None,
    overhead: bool = False,
    on_run: Callable[[ArchitectureRun], None] | None = None,
    stack: str | None = None,
) -> RunReport:
    """Entry point of ``attn run --model NAME``.

    :param model: ``"all"``, one architecture (a sample of :data:`ARCHITECTURES`: ``qwen3``,
        ``qwen3-next``, ``deepseek-v3``, ``bamba``, ``gpt-oss``, ``minimax``, ``lfm2``,
        ``gemma-3``, ``nemotron-h``, ``qwen2.5-vl-vision``, ``qwen2-vl-vision``,
        ``siglip-vision``), the path of a ``config.json`` (or of
        its folder) whose model_type one of them covers (run at the config's own sizes, random
        weights; ``shapes`` does not apply), a checkpoint folder (config.json and safetensors
        weights, loaded with ``from_pretrained``), or a comma list.
    :param device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
    :param dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"`` (aliases ``fp32``, ``bf16``).
    :param prompts: requests per architecture (images for the vision tower).
    :param max_new_tokens: greedy tokens per request.
    :param graphs: the CUDA-graph mode (CUDA only; noted otherwise): True / ``"decode"``
        captures pure-decode steps, ``"full"`` prefill and mixed steps too where the plan
        grants it (every group's prefill backend declares ``full``; else it is lowered, with
        a warning and a note).
    :param registry: the loaded :class:`~attn_core.registry.Registry` (None: reference only).
    :param constraints: the run's :class:`ExecutionConstraints`; batch / token / length limits
        and the graph mode are set from the run itself.
    :param progress: show a progress display.
    :param console: where plain progress lines go.
    :param shapes: ``"tiny"`` or ``"kernel"`` model shapes (default: kernel on CUDA).
    :param warmup: a warm-up generation before the timed one (None: on CUDA only); its time,
        JIT compilation and graph capture, is printed on its own line.
    :param layers: run each model at its real hidden size and head layout with only its first
        ``layers`` layers (the layer pattern of those kept); samples are not shrunk.
    :param overhead: print the overhead ratio: an eager decode step through the bindings over
        the same step with the kernels called directly.
    :param on_run: called with each architecture's result as soon as it is known, so that a
        long run of several models reports as it goes (``attn run`` prints each one there).
    :param stack: one stack of multi-stack inputs (``encoder`` of a Whisper config, ``vision``
        or ``text``); default: every stack the runner drives (a Whisper config is then refused:
        its decoder has cross-attention).
    :returns: a :class:`RunReport`; ``report.format()`` is the text to print.
    """
    from attn_core.e2e.hf_version import require_transformers
    from attn_core.specs import DTYPES, _canonical_dtype

    require_transformers()  # an older release's classes and defaults are not what it checks
    dtype = _canonical_dtype(dtype, DTYPES, "dtype")
    inputs = _resolve(model, stack)
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
                    checkpoint=given.checkpoint,
                    stack=given.stack,
                    stack_notes=given.notes,
                    warmup=warmup,
                    layers=layers,
                    overhead=overhead,
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
            if on_run is not None:
                on_run(runs[-1])
    return RunReport(model, str(torch.device(device)), dtype, runs)
