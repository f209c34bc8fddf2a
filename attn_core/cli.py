"""The ``attn`` command: list plugins, explain a selection, run a model, benchmark backends.

attn list [--json]
attn explain qwen3-next --target h200 [--tp 2] [--graph-mode decode] [--json]
attn run --model qwen3-next [--device cpu] [--backends full=flashinfer]
    [--option reference.decode_path=ragged]
attn bench --model qwen3 [--device cuda] [--batch 1,8,64] [--context 512,4096]
    [--write-tuning tuning.json] [--plot bench.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from attn_core.errors import AttnCoreError, SelectionError
from attn_core.registry import Registry
from attn_core.tables import render_table

if TYPE_CHECKING:
    import torch

__all__ = ["main"]

# What a command reports as an error line (exit 2) rather than a traceback: attn-core's own
# errors and bad input (a config, a model name, an option).
_EXPECTED_ERRORS = (AttnCoreError, ValueError, KeyError)


def _count(text: str) -> int:
    """An argparse type: a whole number >= 1 (timed calls, rounds)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _backend_names(text: str) -> frozenset[str]:
    """An argparse type: comma-separated backend names, at least one (an empty ``--allow``
    would otherwise allow every backend, as if the flag were not given)."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no backend; give comma-separated backend names"
        )
    return names


def _torch_device(text: str) -> str:
    """An argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device (cpu, cuda, cuda:N), got {text!r}"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has no CUDA device (torch {torch.__version__})"
            )
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA devices")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    return text


def _add_constraint_args(
    p: argparse.ArgumentParser, *, tuning: bool = True, run_sized: bool = False
) -> None:
    """The selection's arguments; ``tuning=False`` for a command that ranks nothing (bench);
    ``run_sized`` for ``attn run``, which plans its graph mode from ``--graphs`` and its step
    sizes from its prompts, so it offers neither ``--graph-mode`` nor ``--max-batch`` /
    ``--max-tokens``."""
    g = p.add_argument_group("constraints")
    if not run_sized:
        g.add_argument(
            "--graph-mode",
            default="none",
            choices=["none", "decode", "full"],
            help="CUDA graphs the run captures: none (default), decode (pure-decode steps), "
            "full (prefill and mixed steps too); lowered per --downgrade where a group has no "
            "backend",
        )
    g.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="tokens per KV page; default: one the backends of every group accept",
    )
    g.add_argument(
        "--kv-layout",
        default=None,
        choices=["NHD", "HND"],
        help="KV cache layout; default: one the backends of every group read",
    )
    g.add_argument(
        "--kv-dtype", default=None, help="KV cache dtype, e.g. fp8_e4m3; default: the model's"
    )
    g.add_argument("--spec-tokens", type=int, default=0, help="draft tokens verified per request")
    g.add_argument(
        "--spec-strategy",
        default=None,
        choices=["native", "replay"],
        help="how linear layers verify drafts (a backend must declare it); default: any",
    )
    if not run_sized:
        g.add_argument(
            "--max-batch", type=int, default=256, help="most requests in one step (default 256)"
        )
        g.add_argument(
            "--max-tokens",
            type=int,
            default=8192,
            help="most new tokens in one step (default 8192)",
        )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="only backends that give bit-identical results run to run",
    )
    g.add_argument(
        "--backends",
        default=None,
        help="force backends per kind or group: 'full=flashinfer,linear=triton_ssm'; a phase "
        "prefix forces one phase: 'decode:full=flashinfer', 'prefill=fa3' (also "
        "ATTN_CORE_BACKENDS)",
    )
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="BACKEND.KEY=VALUE",
        help="set an option a backend declares, e.g. reference.decode_path=ragged (repeatable; "
        "also ATTN_CORE_BACKEND_OPTIONS, which --option overrides)",
    )
    g.add_argument(
        "--allow",
        type=_backend_names,
        default=None,
        help="comma-separated backend names to consider",
    )
    g.add_argument(
        "--deny",
        type=_backend_names,
        default=None,
        help="comma-separated backend names never used",
    )
    g.add_argument(
        "--downgrade",
        default="warn",
        choices=["error", "warn", "allow"],
        help="when a backend ranked above the chosen one was rejected, or the graph mode must "
        "be lowered: error refuses, warn (default) warns, allow goes on silently",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="fail on a plugin that does not load (also ATTN_CORE_STRICT=1)",
    )
    if tuning:
        g.add_argument(
            "--tuning",
            default=None,
            help="rank by the times in this file (written by `attn bench --write-tuning`; also "
            "ATTN_CORE_TUNING)",
        )


def _constraints(args: argparse.Namespace):
    from attn_core.options import SOURCE_CLI, parse_option_entries
    from attn_core.selector import parse_forced
    from attn_core.specs import ExecutionConstraints

    # Parsed here, not by ExecutionConstraints, so that a mistake names the option.
    force = parse_forced(args.backends, source="--backends") if args.backends else {}
    options = parse_option_entries(getattr(args, "option", None) or [], source=SOURCE_CLI)
    # attn run offers no --graph-mode / --max-batch / --max-tokens (plan_for sets them from
    # --graphs and its prompts): the constraints' defaults stand in for them there
    given = {
        field: getattr(args, name)
        for field, name in (
            ("graph_mode", "graph_mode"),
            ("max_batch_size", "max_batch"),
            ("max_num_tokens", "max_tokens"),
        )
        if hasattr(args, name)
    }
    return ExecutionConstraints(
        **given,
        page_size=args.page_size,
        kv_layout=args.kv_layout,
        kv_dtype=args.kv_dtype,
        speculative_tokens=args.spec_tokens,
        spec_verify_strategy=args.spec_strategy,
        deterministic=args.deterministic,
        force=force,
        allow=args.allow or frozenset(),
        deny=args.deny or frozenset(),
        downgrade=args.downgrade,
        cli_backend_options=options,
    )


def _registry(args: argparse.Namespace) -> Registry:
    return Registry.discover(strict=True if getattr(args, "strict", False) else None)


@contextlib.contextmanager
def _tuning_for_runner(path: str | None) -> Iterator[None]:
    """``--tuning FILE`` for a command whose selection is made further in (the runner's, which
    hands the selector no tuning data): the selector then reads the file ``ATTN_CORE_TUNING``
    names, so the variable names this one while the command runs. Read once here first, so
    that a file that does not load fails before anything runs."""
    if not path:
        yield
        return
    from attn_core.selector import ENV_TUNING, TuningData

    TuningData.load(path)
    before = os.environ.get(ENV_TUNING)
    os.environ[ENV_TUNING] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_TUNING, None)
        else:
            os.environ[ENV_TUNING] = before


def _warn_quarantined(registry: Registry, command: str) -> None:
    """One line on stderr per quarantined plugin (stdout may be --json)."""
    for q in registry.quarantined.values():
        dist = f" (distribution {q.distribution})" if q.distribution else ""
        reason = (q.reason.strip().splitlines() or ["no reason recorded"])[0]
        print(
            f"attn {command}: warning: plugin {q.plugin!r}{dist} is quarantined (stage "
            f"{q.stage}): {reason}; none of its backends can be chosen (attn list shows why)",
            file=sys.stderr,
        )


# ------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    registry = _registry(args)
    checks = None
    if args.self_check:
        device = _self_check_device()
        checks = registry.self_check(device)
    summary = registry.summary()  # after the checks: the core's fast-launch line too
    failed: dict[str, tuple[str, ...]] = {}
    if checks is not None:
        for p in summary["plugins"]:
            for b in p["backends"]:
                check = checks.get(b["name"])
                if check is not None:
                    b["notes"] = check.notes
                    b["self_check_failed"] = list(check.failed)
                    if check.failed:
                        failed[b["name"]] = check.failed
        summary["self_check"] = {"device": str(device), "checked": sorted(checks)}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 1 if failed else 0
    rows = []
    for p in summary["plugins"]:
        for b in p["backends"] or [None]:
            if b is None:
                rows.append([p["name"], p["version"], p["api_version"], "-", "-", "no backends"])
                continue
            kinds = ", ".join(b["kinds"])
            if b["linear_variants"]:
                kinds += " (" + ", ".join(b["linear_variants"]) + ")"
            status = "available" if b["available"] else f"unavailable: {b['unavailable_reason']}"
            if b["notes"]:
                status += f"; {b['notes']}"
            rows.append(
                [p["name"], p["version"] or "-", p["api_version"], b["name"], kinds, status]
            )
    print(
        render_table(
            ["plugin", "version", "API", "backend", "kinds", "status"],
            rows,
            title=f"attn-core plugin API {summary['api_version']}",
        )
    )
    if summary["quarantined"]:
        print()
        print(
            render_table(
                ["plugin", "distribution", "stage", "reason"],
                [
                    [q["plugin"], q["distribution"] or "-", q["stage"], q["reason"]]
                    for q in summary["quarantined"]
                ],
                title="Quarantined plugins (not loaded)",
            )
        )
    for name, why in summary["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"core: {summary['core']['fast_launch']}")
    if checks is not None:
        checked = ", ".join(sorted(checks)) or "none (no backend here has a self-check)"
        print(f"self-check on {device}: {checked}")
        for name, lines in failed.items():
            for line in lines:
                print(f"self-check FAILED {name}: {line}", file=sys.stderr)
    return 1 if failed else 0


def _self_check_device() -> torch.device:
    """The CUDA device ``attn list --self-check`` checks on (torch's current one); a
    ValueError where there is none: the checks compare GPU kernels."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "--self-check runs the backends' fast paths against their public APIs on a CUDA "
            f"device; torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _device(target: str | None):
    from attn_core.specs import DeviceCapabilities

    if target in (None, "auto"):
        return DeviceCapabilities.detect()
    return DeviceCapabilities.target(target)


def _plan(args, layout, registry, device):
    from attn_core.selector import TuningData, select

    tuning = TuningData.load(args.tuning) if getattr(args, "tuning", None) else None
    return select(layout.groups, registry, device, _constraints(args), tuning=tuning)


def format_plan(plan, registry=None) -> str:
    """Per group, one table per phase (prefill / mixed, decode, verify when planned): the chosen
    backend (with its options in force) and every rejected candidate with its reasons; a phase
    whose choice and candidates equal the first phase's is one line. A chunked group (Llama-4's
    ``attention_chunk_size``) says which admissible backends serve it and how (a native chunk
    mask or local virtual batches); ``registry`` names the admissible ones ranked lower too."""
    out = [
        f"device: {plan.device.short()}   graph mode: {plan.constraints.graph_mode.value}"
        + (
            f" (lowered from {plan.graph_mode_requested.value})"
            if plan.graph_mode_requested
            else ""
        )
        + "   "
        f"page size: {plan.page_size if plan.page_size is not None else '-'}   "
        f"KV layout: {plan.kv_layout or '-'}"
    ]
    if not plan.local:
        out.append(
            "offline plan for a target, not this machine: backends are judged by what they "
            "declare; one marked 'not loadable here' cannot run on this machine"
        )
    for c in plan.choices:
        layers = list(c.group.layer_indices)
        shown = layers if len(layers) <= 12 else [*layers[:12], "..."]
        phases = c.phases or (c.phase_choice("prefill"),)
        spec = c.group.spec
        if spec.page_size is not None and plan.page_size not in (None, spec.page_size):
            spec = spec.with_(page_size=plan.page_size)  # the page size the run keeps KV in
        title = (
            f"\ngroup {c.group.group_id}: {spec.short()}\n  {len(layers)} layers: {shown}"
            + "\n  "
            + "; ".join(
                f"{_PHASE_TITLES[p.phase.value]}: {p.backend.qualified_name}" for p in phases
            )
        )
        if (plan.graph_mode_requested or plan.constraints.graph_mode).value != "none":
            # how each phase's steps are captured: granted, and what was asked where it differs
            captured = []
            for p in phases:
                asked, granted = plan.phase_graph_modes(p.phase)
                captured.append(
                    f"{_PHASE_TITLES[p.phase.value]} {granted.value}"
                    + (f" (asked {asked.value})" if asked is not granted else "")
                )
            title += "\n  CUDA graphs: " + "; ".join(captured)
        chunked = _chunked_line(c, phases, registry)
        if chunked:
            title += "\n  " + chunked
        first = phases[0]
        out.append(_phase_table(c, first, title + f"\n  {_PHASE_TITLES[first.phase.value]}:"))
        for p in phases[1:]:
            label = _PHASE_TITLES[p.phase.value]
            if (
                p.backend.qualified_name,
                p.rejected,
                p.outranked,
                p.tuned_us,
                p.by_step_size,
                p.by_requests,
            ) == (
                first.backend.qualified_name,
                first.rejected,
                first.outranked,
                first.tuned_us,
                first.by_step_size,
                first.by_requests,
            ):
                out.append(
                    f"  {label}: {p.backend.qualified_name}"
                    + (" (forced)" if p.forced else "")
                    + f", the same candidates and reasons as {_PHASE_TITLES[first.phase.value]}"
                )
                continue
            out.append(_phase_table(c, p, f"  {label}:"))
    return "\n".join(out)


def _chunked_line(c, phases, registry) -> str:
    """``chunked attention (chunks of C tokens): served by ...`` for a chunked group, else ''."""
    chunk = c.group.spec.attention_chunk_size
    if chunk is None:
        return ""
    found = {p.backend.qualified_name: p.backend for p in phases}
    if registry is not None:
        for p in phases:
            for name in p.outranked:
                if name not in found:
                    try:
                        found[name] = registry.resolve(name)
                    except SelectionError:
                        continue
    how = []
    for name, backend in sorted(found.items()):
        caps = backend.capabilities
        if caps.chunked_attention:
            how.append(f"{name} (native chunk mask)")
        elif caps.chunked_virtual_batches:
            how.append(f"{name} (local virtual batches)")
    return f"chunked attention (chunks of {chunk} tokens): served by " + ", ".join(how)


#: How explain names each phase.
_PHASE_TITLES = {
    "prefill": "prefill / mixed steps",
    "decode": "decode steps",
    "verify": "speculative verify steps",
}


def _measured_note(p, backend: str) -> str:
    """`` (tuned: X us)`` for a backend ranked lower in phase choice ``p`` that has a measured
    time, saying so where it measured faster than the chosen one by less than
    ``MEASURED_TIE``: a tie, which the default rule decided."""
    from attn_core.selector import MEASURED_TIE, is_measured_tie

    t = dict(p.outranked_us).get(backend)
    if t is None:
        return ""
    if p.tuned_us is not None and t < p.tuned_us and is_measured_tie(p.tuned_us, t):
        return (
            f" (tuned: {t:.1f} us: a lead under {MEASURED_TIE * 100:g} %, a tie the default "
            "rule decided)"
        )
    return f" (tuned: {t:.1f} us)"


def _phase_table(c, p, title: str) -> str:
    """The table of one phase of group choice ``c``: the chosen backend (with its options in
    force), the admissible ones ranked lower, every rejected candidate with its reasons."""
    from attn_core.options import format_options

    here = {b: f"not loadable here: {why}" for b, why in c.not_loadable_here}
    note = " (forced)" if p.forced else ""
    if p.tuned_us is not None:
        note += f" (tuned: {p.tuned_us:.1f} us)"
    if p.downgraded_from:
        note += f" (downgraded from {', '.join(p.downgraded_from)})"
    name = p.backend.qualified_name
    chosen_notes = [here[name]] if name in here else []
    if p.options:
        chosen_notes.append("options: " + format_options(p.options, dict(p.option_sources)))
    chosen_notes += p.switch_notes()
    rows = [[name, "chosen" + note, "\n".join(chosen_notes)]]
    switching = {b.qualified_name for b in p.switch_backends} - {name}
    rows += [
        [
            b,
            "serves some steps" + (_measured_note(p, b) or " (tuned)")
            if b in switching
            else "admissible, ranked lower" + _measured_note(p, b),
            here.get(b, ""),
        ]
        for b in p.outranked
    ]
    for backend, reasons in sorted(p.rejections_by_backend().items()):
        lines = [f"[{r.code}] {r.reason}" + (f" -> fix: {r.fix}" if r.fix else "") for r in reasons]
        if backend in here:
            lines.append(here[backend])
        rows.append([backend, "rejected", "\n".join(lines)])
    return render_table(["backend", "decision", "reasons"], rows, title=title)


def _span(indices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"layers 0-2, 5"``."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "layers " + ", ".join(parts)


def cmd_explain(args: argparse.Namespace) -> int:
    from attn_core.e2e.main import explain_inputs

    registry = _registry(args)
    _warn_quarantined(registry, "explain")
    names = explain_inputs(args.model)
    if len(names) == 1:  # one model: its plan (or JSON object) alone; an error is main()'s
        shown, messages = _explain_model(args, names[0], registry)
        print(json.dumps(shown, indent=1) if isinstance(shown, dict) else shown)
        # on stderr, after the plan: stdout stays the plan (or its JSON) alone
        for message in messages:
            print(f"attn explain: warning: {message}", file=sys.stderr)
        return 0
    # several ('all', a comma list): every model is planned, a refused one named and counted
    payloads: list[dict[str, Any]] = []
    refused: list[str] = []
    for name in names:
        try:
            shown, messages = _explain_model(args, name, registry)
        except _EXPECTED_ERRORS as exc:
            refused.append(name)
            said = str(exc)  # the mapping's errors start with the model's name already
            named = said if said.startswith(f"{name}:") else f"{name}: {said}"
            print(f"attn explain: error: {named}", file=sys.stderr)
            payloads.append({"input": name, "error": str(exc)})
            continue
        if isinstance(shown, dict):
            payloads.append({"input": name, **shown})
        else:
            print(shown + "\n")
        for message in messages:
            print(f"attn explain: warning: {name}: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps(payloads, indent=1))
    if refused:
        print(
            f"attn explain: {len(refused)} of {len(names)} models not planned: "
            f"{', '.join(refused)}",
            file=sys.stderr,
        )
        return 2
    return 0


def _explain_model(
    args: argparse.Namespace, model: str, registry: Any
) -> tuple[dict[str, Any] | str, list[str]]:
    """One model's plan: its JSON payload (``--json``) or its text, and the warnings selection
    gave (downgrades, ...)."""
    from attn_core.models import specs_from_hf_config

    layout = specs_from_hf_config(model, tp_size=args.tp, dtype=args.dtype, stack=args.stack)
    device = _device(args.target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(args, layout, registry, device)
    messages = [str(w.message) for w in caught]
    if args.json:
        payload = plan.to_dict()
        payload["model"] = layout.architecture
        # layers holding an attention op and a linear op side by side (parallel hybrid)
        payload["parallel_layers"] = list(layout.parallel_layers)
        # which stack each group belongs to (a vision tower and a language model: their group
        # ids are prefixed by the stack; a single-stack model: one entry named "")
        payload["stacks"] = {
            s.stack: [g.group_id for g in s.groups] for s in (layout.stacks or (layout,))
        }
        payload["warnings"] = messages
        payload["quarantined"] = registry.summary()["quarantined"]
        return payload, messages
    lines = []
    if layout.stacks:
        stacks = ", ".join(f"{s.stack} ({s.num_layers} layers)" for s in layout.stacks)
        lines.append(f"model: {model} ({layout.architecture}, stacks {stacks}, tp={args.tp})")
    else:
        stack = f", stack {layout.stack}" if layout.stack else ""
        lines.append(
            f"model: {model} ({layout.architecture}, {layout.num_layers} layers{stack}, "
            f"tp={args.tp})"
        )
    # layers two groups list: said, rather than let the groups' counts read as overlap
    pairs: dict[tuple[str, ...], list[int]] = {}
    for i in layout.parallel_layers:
        pairs.setdefault(tuple(g.group_id for g in layout.groups_of(i)), []).append(i)
    for ids, where in pairs.items():
        lines.append(
            f"parallel ops: {len(where)} layers ({_span(tuple(where))}) each hold an op of "
            f"groups {' and '.join(map(repr, ids))} side by side, with KV pages and a conv / "
            "SSM slot each"
        )
    lines.append(format_plan(plan, registry))
    return "\n".join(lines), messages


def cmd_run(args: argparse.Namespace) -> int:
    from attn_core.e2e import run_main

    registry = _registry(args)
    _warn_quarantined(registry, "run")
    device = args.device or ("cuda" if _cuda() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    print(f"attn run --model {args.model}  (device {device}, dtype {dtype})", flush=True)
    with _tuning_for_runner(args.tuning):  # the runner's selection reads it
        report = run_main(
            args.model,
            device=device,
            dtype=dtype,
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            graphs=args.graphs,
            registry=registry,
            constraints=_constraints(args),
            progress=not args.no_progress,
            console=print,
            shapes=args.shapes,
            warmup=args.warmup,
            layers=args.layers,
            overhead=args.overhead,
            on_run=lambda run: print(run.format(), flush=True),  # each model as soon as it ends
            stack=args.stack,
        )
    print(report.format_tail())
    return 0 if getattr(report, "ok", True) else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from attn_core.bench import run_bench

    registry = _registry(args)
    _warn_quarantined(registry, "bench")  # its backends are missing from the table
    device = args.device or ("cuda" if _cuda() else "cpu")
    return run_bench(args, registry, device, _constraints(args))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from attn_core.models import sample_names
    from attn_core.specs import TARGETS

    parser = argparse.ArgumentParser(
        prog="attn", description="attn-core: attention backend registry for LLM inference"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="plugins, backends, the kinds they serve, quarantined plugins")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on a plugin that does not load (also ATTN_CORE_STRICT=1)",
    )
    p.add_argument(
        "--self-check",
        action="store_true",
        help="run every backend's fast-path self-checks now on this machine's GPU (by "
        "default they run at first use) and show the verdicts; exit 1 if one failed",
    )
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "explain",
        help="the backend chosen for every layer group and phase, and why not others",
    )
    p.add_argument(
        "model",
        help=f"a sample ({', '.join(sample_names())}), the path of a Hugging Face "
        "config.json (or of its folder), 'all' (every architecture attn run drives) or a comma "
        "list of these, as attn run --model takes",
    )
    p.add_argument(
        "--target", default="auto", help=f"{', '.join(sorted(TARGETS))}, or auto (this machine)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads per rank)")
    p.add_argument(
        "--dtype", default=None, help="activation dtype; default: the config's, else bfloat16"
    )
    p.add_argument(
        "--stack",
        default=None,
        help="one stack of a multi-stack model (vision, text; Whisper: encoder); default: "
        "every stack (a sample named for a stack, e.g. whisper-encoder: that one)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON (with the warnings and the quarantined plugins)",
    )
    _add_constraint_args(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", help="run a model through the framework and check it against HF")
    p.add_argument(
        "--model",
        default="qwen3-next",
        help="'all', an architecture the runner drives, the path of a Hugging Face config.json "
        "(or of its folder) of a model type one of them covers (a folder with safetensors "
        "weights loads them), or a comma list (an unknown name's error lists them; default: "
        "qwen3-next)",
    )
    p.add_argument(
        "--device",
        type=_torch_device,
        default=None,
        help="cpu or cuda[:N] (default: cuda if present)",
    )
    p.add_argument(
        "--dtype", default=None, help="activation dtype; default: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument(
        "--prompts", type=int, default=3, help="requests per model (images for a vision tower)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="greedy tokens generated per request"
    )
    p.add_argument(
        "--graphs",
        nargs="?",
        const="decode",
        default=None,
        choices=["decode", "full"],
        help="CUDA graphs: 'decode' (the default of a bare --graphs) captures pure-decode "
        "steps, 'full' prefill and mixed steps too where every group's prefill backend "
        "captures them (else lowered per --downgrade)",
    )
    p.add_argument(
        "--shapes",
        choices=("tiny", "kernel"),
        default=None,
        help="model shapes: tiny (head dim 16) or kernel (head dims GPU kernels serve); "
        "default kernel on CUDA, tiny on CPU",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="generate once before the timed pass, so JIT compile and CUDA-graph capture stay "
        "out of tok/s (printed on their own line); default: on CUDA only",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="real hidden size and head layout, only the first N layers (their layer pattern "
        "kept); samples are not shrunk",
    )
    p.add_argument(
        "--overhead",
        action="store_true",
        help="print the overhead ratio: an eager decode step through the bindings over the "
        "same kernels called directly",
    )
    p.add_argument(
        "--stack",
        default=None,
        help="one stack of a multi-stack model (Whisper: encoder; vision, text); default: "
        "every stack the runner drives",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar while a model generates"
    )
    _add_constraint_args(p, run_sized=True)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "bench",
        help="time every admissible backend per group (--write-tuning saves the times for the "
        "selector) and phase, over a grid of batch sizes and context lengths",
    )
    p.add_argument(
        "--model",
        default="qwen3",
        help="one model: a sample or the path of a Hugging Face config.json (default: qwen3)",
    )
    p.add_argument(
        "--device",
        type=_torch_device,
        default=None,
        help="cpu or cuda[:N] (default: cuda if present)",
    )
    p.add_argument(
        "--dtype", default=None, help="activation dtype; default: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads per rank)")
    p.add_argument(
        "--stack",
        default=None,
        help="one stack of a multi-stack model (vision, text; Whisper: encoder); default: every "
        "stack's groups",
    )
    p.add_argument(
        "--batch",
        default="8",
        help="requests per step: one or a comma list, e.g. 1,8,64,256 (each a tuning bucket)",
    )
    p.add_argument(
        "--context",
        default="256",
        help="tokens cached per request (decode, verify) / new tokens per request (prefill): "
        "one or a comma list, e.g. 512,4096",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=_count,
        default=65536,
        help="skip prefill grid points of more tokens per step (batch x context)",
    )
    p.add_argument(
        "--iters", type=_count, default=10, help="timed calls per sample of a grid point"
    )
    p.add_argument(
        "--rounds",
        type=_count,
        default=3,
        help="samples per grid point and candidate where a group and phase has several, taken "
        "in alternating rounds (every candidate once a round, the order rotated each round); "
        "each candidate's median is kept (default: 3)",
    )
    p.add_argument("--write-tuning", default=None, help="write a tuning file for the selector")
    p.add_argument(
        "--plot",
        default=None,
        help="write a PNG of every candidate's time per group, phase and batch size "
        "(needs matplotlib: pip install 'attn-core[plot]')",
    )
    p.add_argument(
        "--json", action="store_true", help="print the measurements as JSON instead of a table"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no line on stderr as each grid point is measured (the table comes at the end)",
    )
    p.add_argument(
        "--include-reference",
        action="store_true",
        help="time attn_core:reference too where a plugin is a candidate (by default it is left "
        "out there: it ranks below every plugin without a time)",
    )
    _add_constraint_args(p, tuning=False)
    p.set_defaults(func=cmd_bench)
    return parser


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Print each ``UserWarning`` (the selector's downgrades, an unmatched ``--deny`` entry,
    ...) as ``attn COMMAND: warning: MESSAGE`` on stderr, as ``explain`` prints its own, in
    place of Python's ``FILE:LINE: UserWarning: MESSAGE`` and the source line; other
    categories (a library's DeprecationWarning) print as they would."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning):
            print(f"attn {command}: warning: {message}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # ATTN_CORE_BACKENDS is read by the selector, which names it in its errors
        with _warnings_as_lines(args.command):
            return args.func(args)
    except Exception as exc:  # a CLI prints the error, not a traceback, for expected failures
        if isinstance(exc, _EXPECTED_ERRORS):
            print(f"attn {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
