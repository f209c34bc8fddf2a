"""The checks behind each battery test: one function per :data:`~attn_core.testing.matrix.CHECKS`.

Each takes the case, the kit session and a generator seeded for this item, and raises
:class:`~attn_core.testing.checks.ConformanceFailure` / ``BackendRaised`` on a defect.
"""

from __future__ import annotations

from typing import Any

import torch

from attn_core.specs import GraphMode, LayerKind
from attn_core.testing.checks import (
    SENTINEL,
    ConformanceFailure,
    assert_close,
    assert_unchanged,
)
from attn_core.testing.harness import Limits, Pair
from attn_core.testing.matrix import Case
from attn_core.testing.workloads import InputBank, Step, Workload, layer_inputs, to_device, workload

__all__ = ["run_case"]

#: the chunk of the chunked prefill kernels backends build on (fla's and triton_ssm's GDN, KDA
#: and SSD stages: 64 tokens); the chunked-prefill check's one-step prefill spans more than two
KERNEL_CHUNK = 64


def _pair(case: Case, session: Any, gen: torch.Generator, limits: Limits, **kw: Any) -> Pair:
    return Pair(
        session,
        case.spec,
        gen,
        num_layers=case.num_layers,
        limits=limits,
        graph_mode=case.graph_mode,
        strategy=case.strategy,
        magnitude=case.magnitude,
        layer_scales=case.layer_scales,
        **kw,
    )


def check_correctness(case: Case, session: Any, gen: torch.Generator) -> None:
    wl = workload(
        case.workload,
        case.spec,
        quick=session.quick,
        spec_tokens=case.spec_tokens,
        cuda=session.has_cuda,
    )
    pair = _pair(case, session, gen, Limits(wl, spec_tokens=case.spec_tokens))
    pair.run(wl, f"workload {case.workload!r}")


check_lifecycle = check_correctness  # the "lifecycle" workload: 13 steps of churn, one allocation


# ------------------------------------------------------------------------------------------
# update() / graph replay
# ------------------------------------------------------------------------------------------
REPLAY_PAD = 4
# Decode batches replayed after one prepare(): other members, other row order, fewer requests.
REPLAY_SUBSETS = ([0, 1, 2, 3], [1, 0, 3, 2], [4, 2, 0], [3, 1], [0, 1, 2, 4], [2, 4, 3, 1])


def _replay_prologue(pair: Pair) -> None:
    ids = (0, 1, 2, 3, 4)
    pair.step(
        Step(list(zip(ids, (5, 9, 3, 12, 7), strict=True)), add=ids), "replay prologue: prefill"
    )


#: Graph mode full: the captured mixed step's padded sizes, and the splits replayed in it
#: after a capture on padding only (pure prefill, pure decode, mixed, a prefill continued, a
#: new request, every row real), request ids 0..4 of the prologue plus 5 and 6.
MIXED_PAD, MIXED_TOKENS = 4, 40
MIXED_SPLITS = (
    [(5, 7), (6, 3)],
    [(0, 1), (1, 1), (2, 1)],
    [(5, 1), (3, 6)],
    [(6, 4), (0, 1), (4, 1), (1, 9)],
    [(2, 1), (5, 1), (6, 1), (3, 1)],
)


def _mixed_step(requests: list[tuple[int, int]], seen: set[int]) -> Step:
    """One captured mixed step of ``requests`` (adds those not ``seen`` yet)."""
    new = tuple(r for r, _ in requests if r not in seen)
    seen.update(new)
    return Step(requests, add=new, pad_to=MIXED_PAD, pad_tokens_to=MIXED_TOKENS)


def check_update(case: Case, session: Any, gen: torch.Generator) -> None:
    """prepare(first decode batch) once, then only update(batch) before each later decode step.

    A context that ignores update() (or keeps metadata copied at prepare time) computes the
    batch it was prepared for and is caught, with or without CUDA graphs. Under graph mode
    ``full``: prepare an all-padding mixed step at the captured sizes once, then only update
    before each split of :data:`MIXED_SPLITS` (what precedes a replay of the captured mixed
    step).
    """
    pair = _pair(case, session, gen, Limits(max_batch=8, max_tokens=64, max_len=40))
    _replay_prologue(pair)
    # One padded step of each loop passes out=None (the last split, whose requests fill every
    # row, and the last decode batch with padding rows): the backend must return every padded
    # row (the binding refuses a result of another shape), whatever rows its kernel computes.
    no_out: list[torch.Tensor | None] = [None] * pair.test.num_layers
    padded_decode = max(i for i, s in enumerate(REPLAY_SUBSETS) if len(s) < REPLAY_PAD)

    def out_text(last: bool) -> str:
        return "; out=None" if last else ""

    if case.graph_mode is GraphMode.FULL:
        seen = {0, 1, 2, 3, 4}
        pair.step(_mixed_step([], seen), "captured mixed step: prepare (padding only)")
        for i, split in enumerate(MIXED_SPLITS):
            last = i == len(MIXED_SPLITS) - 1
            pair.step(
                _mixed_step(list(split), seen),
                f"emulated mixed replay {i} (split {split}, padded to {MIXED_PAD} requests / "
                f"{MIXED_TOKENS} tokens; update only{out_text(last)})",
                update_only=True,
                outs=no_out if last else None,
            )
        return
    for i, subset in enumerate(REPLAY_SUBSETS):
        last = i == padded_decode  # out=None here
        step = Step([(r, 1) for r in subset], pad_to=REPLAY_PAD)
        pair.step(
            step,
            f"emulated replay {i} (requests {subset}, padded to {REPLAY_PAD}; "
            f"{'prepare' if i == 0 else 'update only'}{out_text(last)})",
            update_only=i > 0,
            outs=no_out if last else None,
        )


def check_graph(case: Case, session: Any, gen: torch.Generator) -> None:
    """Capture the decode forward in a CUDA graph after prepare(), replay after update().
    Under graph mode ``full``, then capture one mixed step on padding only and replay it for
    every split of :data:`MIXED_SPLITS`."""
    if not session.has_cuda:
        raise _Skip("CUDA is not available: capture needs a GPU")
    pair = _pair(case, session, gen, Limits(max_batch=8, max_tokens=64, max_len=40))
    _replay_prologue(pair)
    steps = [
        (Step([(r, 1) for r in subset], pad_to=REPLAY_PAD),
         f"graph replay {i} (requests {subset}, padded to {REPLAY_PAD})")
        for i, subset in enumerate(REPLAY_SUBSETS)
    ]  # fmt: skip
    _capture_and_replay(pair, gen, steps, REPLAY_PAD)
    if case.graph_mode is GraphMode.FULL:
        seen = {0, 1, 2, 3, 4}
        mixed = [(_mixed_step([], seen), "mixed-step capture (padding only)")]
        mixed += [
            (_mixed_step(list(split), seen),
             f"mixed-step graph replay {i} (split {split}, padded to {MIXED_PAD} requests / "
             f"{MIXED_TOKENS} tokens)")
            for i, split in enumerate(MIXED_SPLITS)
        ]  # fmt: skip
        _capture_and_replay(pair, gen, mixed, MIXED_TOKENS)


def _capture_and_replay(
    pair: Pair, gen: torch.Generator, steps: list[tuple[Step, str]], rows: int
) -> None:
    """Warm up and capture the first step's forward (after prepare), then replay it for each
    later step (after update), comparing every replay with the reference run eagerly.

    :param rows: the captured step's ``padded_tokens`` (every step's: they share the graph).
    """
    spec, test, ref = pair.spec, pair.test, pair.ref
    layers = range(test.num_layers)
    static = [to_device(layer_inputs(spec, rows, gen), spec, pair.device) for _ in layers]
    outs = [test.poisoned_out(rows) for _ in layers]
    graph = None
    for step, where in steps:
        rb = ref.begin(step)
        tb = test.begin(step, update_only=graph is not None)
        if tb.padded_tokens != rows:
            raise ConformanceFailure(
                f"{where}: the step has {tb.padded_tokens} padded tokens, the graph {rows}"
            )
        fresh = [layer_inputs(spec, rows, gen) for _ in layers]
        for layer in layers:
            for name, t in to_device(fresh[layer], spec, pair.device).items():
                static[layer][name].copy_(t)
            outs[layer].fill_(float("nan"))

        def run_all() -> None:
            for layer in layers:
                test.forward(layer, static[layer], outs[layer], conv=pair.conv[layer])

        if graph is None:  # warm-up (this step's real computation), then capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run_all()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with test.guard("CUDA graph capture"), torch.cuda.graph(graph):
                run_all()
        else:
            with test.guard("CUDA graph replay"):
                graph.replay()
        torch.cuda.synchronize()
        for layer in layers:
            want, _ = ref.forward(
                layer,
                to_device(fresh[layer], spec, pair.device),
                ref.poisoned_out(rb.padded_tokens),
                conv=pair.conv[layer],
            )
            pair.compare_out(outs[layer], want, rb.num_tokens, "attention output", where)
        pair.compare_state(where)
        ref.finish(step, rb, None)
        test.finish(step, tb, None)


class _Skip(Exception):
    pass


# ------------------------------------------------------------------------------------------
# out contracts
# ------------------------------------------------------------------------------------------
def _guarded(pair: Pair, rows: int, *, strided: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """An ``out`` inside a sentinel-filled guard buffer; returns (out, buffer, checker)."""
    spec = pair.spec
    h, dv = spec.num_heads, spec.head_dim_v
    width = dv + 8 if strided else dv
    guard = max(1024, 2 * h * width)
    flat = torch.full(
        (2 * guard + rows * h * width,),
        SENTINEL,
        dtype=pair.test.poisoned_out(1).dtype,
        device=pair.device,
    )
    big = flat[guard : guard + rows * h * width].view(rows, h, width)
    out = big[:, :, :dv]
    out.fill_(float("nan"))

    def check(where: str) -> None:
        assert_unchanged(flat[:guard], SENTINEL, what="guard region before out", where=where)
        assert_unchanged(
            flat[guard + rows * h * width :], SENTINEL, what="guard region after out", where=where
        )
        if strided:
            assert_unchanged(
                big[:, :, dv:],
                SENTINEL,
                what=f"gap columns of the strided out buffer big[:, :, {dv}:]",
                where=where,
            )

    return out, flat, check


def check_out_contract(case: Case, session: Any, gen: torch.Generator) -> None:
    """out given (in guards), a strided view big[:, :, :dv] (in guards), out=None; inputs kept."""
    spec = case.spec
    encoder = spec.kind is LayerKind.ENCODER
    if encoder:
        steps = [
            Step([(0, 7), (1, 3)]),
            Step([(0, 5)]),
            Step([(0, 2), (1, 9), (2, 4)]),
            Step([(0, 6)]),
        ]
    else:
        steps = [
            Step([(0, 5), (1, 9), (2, 3)], add=(0, 1, 2)),
            Step([(0, 1), (1, 1), (2, 1)]),
            Step([(0, 1), (1, 1), (2, 1)]),
            Step([(3, 6), (0, 1), (1, 1)], add=(3,)),
        ]
    modes = ["contiguous", "strided", "none", "strided"]
    pair = _pair(case, session, gen, Limits(Workload("out", steps)))
    for i, (step, mode) in enumerate(zip(steps, modes, strict=True)):
        where = f"out contract step {i} (out={mode})"
        padded = sum(n for _, n in step.requests)
        inputs = [layer_inputs(spec, padded, gen) for _ in range(pair.test.num_layers)]
        # A private copy per call: the check below compares what the backend was given.
        kept = [{n: t.clone() for n, t in x.items()} for x in inputs]
        outs: list[torch.Tensor | None] = []
        checks: list[Any] = []
        for _ in range(pair.test.num_layers):
            if mode == "none":
                outs.append(None)
                checks.append(None)
            else:
                out, _, check = _guarded(pair, padded, strided=mode == "strided")
                outs.append(out)
                checks.append(check)
        got = _step_keeping_inputs(pair, step, where, inputs, outs)
        for layer, check in enumerate(checks):
            if check is not None:
                check(where)
                given = outs[layer]  # a guarded out wherever there is a check
                if given is None or got[layer].data_ptr() != given.data_ptr():
                    raise ConformanceFailure(
                        f"binding.forward(out=...) returned a tensor that is not out ({where})"
                    )
            else:
                result = got[layer]
                want = (padded, spec.num_heads, spec.head_dim_v)
                if tuple(result.shape[1:]) != want[1:] or result.shape[0] < want[0]:
                    raise ConformanceFailure(
                        f"out=None: returned shape {tuple(result.shape)}, expected {want} ({where})"
                    )
                if result.dtype != pair.test.poisoned_out(1).dtype:
                    raise ConformanceFailure(
                        f"out=None: returned dtype {result.dtype}, expected the layer dtype "
                        f"{spec.dtype} ({where})"
                    )
        for layer, (x, k) in enumerate(zip(inputs, kept, strict=True)):
            for name in x:
                assert_unchanged(
                    x[name], k[name], what=f"input {name!r} of layer {layer}", where=where
                )


def _step_keeping_inputs(pair, step, where, inputs, outs):
    """``pair.step`` with device inputs we can inspect afterwards (the backend must not write
    into q / k / v or the extra inputs)."""
    spec = pair.spec
    dev_inputs = [to_device(x, spec, pair.device) for x in inputs]
    snapshot = [{n: t.clone() for n, t in x.items()} for x in dev_inputs]
    rb = pair.ref.begin(step)
    tb = pair.test.begin(step)
    results = []
    for layer in range(pair.test.num_layers):
        want, want_conv = pair.ref.forward(
            layer,
            {n: t.clone() for n, t in dev_inputs[layer].items()},
            pair.ref.poisoned_out(rb.padded_tokens),
            conv=pair.conv[layer],
        )
        got, got_conv = pair.test.forward(
            layer, dev_inputs[layer], outs[layer], conv=pair.conv[layer]
        )
        at = f"{where}, layer {layer}"
        if got_conv is not None:
            pair.compare_out(got_conv, want_conv, rb.num_tokens, "conv1d output", at)
        pair.compare_out(got, want, rb.num_tokens, "attention output", at)
        for name, t in dev_inputs[layer].items():
            assert_unchanged(
                t,
                snapshot[layer][name],
                what=f"input {name!r} (the backend must not write its inputs)",
                where=at,
            )
        results.append(got)
    pair.compare_state(where)
    pair.ref.finish(step, rb, None)
    pair.test.finish(step, tb, None)
    return results


# ------------------------------------------------------------------------------------------
# state: chunked prefill and prefix-cache restore
# ------------------------------------------------------------------------------------------
def _bank_step(
    pair: Pair,
    bank: InputBank,
    pos: dict[int, int],
    step: Step,
    where: str,
    record: dict[int, dict[int, torch.Tensor]],
) -> None:
    spans = []
    for r, n in step.requests:
        spans.append((pos[r], pos[r] + n))
    inputs = [bank.take(layer, spans) for layer in range(pair.test.num_layers)]
    outs = pair.step(step, where, inputs=inputs)
    row = 0
    for r, n in step.requests:
        for t in range(n):
            record.setdefault(r, {})[pos[r] + t] = outs[0][row + t].detach().float().cpu()
        row += n
        pos[r] += n


def _same_outputs(record, a: int, b: int, positions: range, pair: Pair, what: str) -> None:
    got = torch.stack([record[b][p] for p in positions])
    want = torch.stack([record[a][p] for p in positions])
    assert_close(
        got,
        want,
        atol=pair.atol,
        rtol=pair.rtol,
        what=what,
        where=f"positions {positions.start}..{positions.stop - 1}, request {b} vs {a}",
    )


def check_chunked_prefill(case: Case, session: Any, gen: torch.Generator) -> None:
    """Request 0 prefilled in chunks (ending before, on and after page boundaries), request 1 in
    one step, both then decoded, from the same position-indexed inputs: equal outputs, and both
    equal to the reference."""
    spec = case.spec
    ps = spec.page_size if spec.has_kv_cache else 16
    # longer than two chunks of a chunked kernel (fla's and triton_ssm's 64 tokens) in one step,
    # then decodes over that context: the state carried between chunks, a split over the KV
    n = max(3 * ps + 5, 2 * KERNEL_CHUNK + 5)
    chunks = [max(ps - 3, 1), ps + 3, n - max(ps - 3, 1) - (ps + 3)]
    decodes = 3
    bank = InputBank(spec, n + decodes, case.num_layers, gen)
    steps = [
        Step([(0, chunks[0]), (1, n)], add=(0, 1)),
        Step([(0, chunks[1])]),
        Step([(0, chunks[2])]),
    ]
    steps += [Step([(0, 1), (1, 1)]) for _ in range(decodes)]
    pair = _pair(case, session, gen, Limits(Workload("chunked", steps)))
    pos = {0: 0, 1: 0}
    record: dict[int, dict[int, torch.Tensor]] = {}
    for i, step in enumerate(steps):
        _bank_step(pair, bank, pos, step, f"chunked prefill step {i}", record)
    _same_outputs(
        record,
        1,
        0,
        range(0, n + decodes),
        pair,
        f"outputs of a prefill in chunks {chunks} vs one prefill of {n}",
    )


def check_prefix_restore(case: Case, session: Any, gen: torch.Generator) -> None:
    """Request 0 prefills two blocks, caches them (with a state snapshot for linear layers);
    request 1 starts from the cached prefix and must continue exactly like request 0."""
    spec = case.spec
    linear = spec.kind is LayerKind.LINEAR
    ps = spec.page_size if spec.has_kv_cache else 16
    prefix, tail, decodes = 2 * ps, 5, 2
    tokens = list(range(1000, 1000 + prefix + tail))
    bank = InputBank(spec, prefix + tail + decodes, case.num_layers, gen)
    steps_a = [Step([(0, prefix)], add=(0,))]
    later = [Step([(0, tail), (1, tail)])] + [Step([(0, 1), (1, 1)]) for _ in range(decodes)]
    pair = _pair(case, session, gen, Limits(Workload("prefix", steps_a + later)))
    pos = {0: 0}
    record: dict[int, dict[int, torch.Tensor]] = {}
    _bank_step(pair, bank, pos, steps_a[0], "prefix restore: request 0 prefill", record)
    hits = []
    for side in pair.sides:
        st = side.state
        if st is None:  # the kind has a KV cache or linear state (no encoder here)
            raise ConformanceFailure(f"prefix restore needs a persistent state ({spec.short()})")
        with side.guard("prefix cache"):
            if linear:
                st.take_snapshot(0)
            st.cache_prefix(0, tokens[:prefix])
            hit = st.match_prefix(tokens, max_tokens=prefix)
            st.add_request(1, prefix=hit)
        hits.append(hit.num_tokens)
    if hits[1] != prefix:
        raise ConformanceFailure(f"prefix cache matched {hits} tokens, expected {prefix}")
    pos[1] = prefix
    for i, step in enumerate(later):
        _bank_step(pair, bank, pos, step, f"prefix restore step {i}", record)
    _same_outputs(
        record,
        0,
        1,
        range(prefix, prefix + tail + decodes),
        pair,
        "outputs after a prefix-cache restore vs the request that computed the prefix",
    )


def check_state_precision(case: Case, session: Any, gen: torch.Generator) -> None:
    """A float32 SSM state keeps float32's precision: after a prefill, both sides continue from
    the backend's state through one decode step, whose new state must be within
    :data:`~attn_core.testing.checks.FP32_STATE_RTOL` of the reference's. The state tolerance
    of the other checks (five times the output's) is wider than a bfloat16 rounding: a backend
    that keeps a float32 pool's values in bfloat16 passed them. Decode steps only: a chunked
    prefill kernel computes each chunk's increment from 16-bit operands (fla's design), and
    after a prefill from zero that error is as large as a state rounded to 16 bits."""
    spec = case.spec
    bank = InputBank(spec, 10, case.num_layers, gen)
    steps = [Step([(0, 9), (1, 5)], add=(0, 1)), Step([(0, 1), (1, 1)])]
    pair = _pair(case, session, gen, Limits(Workload("precision", steps)))
    pos = {0: 0, 1: 0}
    record: dict[int, dict[int, torch.Tensor]] = {}
    _bank_step(pair, bank, pos, steps[0], "float32 state precision: prefill", record)
    pair.continue_reference_from_backend()
    _bank_step(pair, bank, pos, steps[1], "float32 state precision: decode", record)
    pair.compare_ssm_precision("float32 state precision: one decode step from the same state")


def check_state(case: Case, session: Any, gen: torch.Generator) -> None:
    if case.workload == "chunked_prefill":
        check_chunked_prefill(case, session, gen)
    elif case.workload == "prefix_restore":
        check_prefix_restore(case, session, gen)
    elif case.workload == "state_precision":
        check_state_precision(case, session, gen)
    else:
        raise ValueError(f"state check {case.workload!r} is unknown")


CHECK_FUNCTIONS = {
    "correctness": check_correctness,
    "lifecycle": check_lifecycle,
    "update": check_update,
    "graph": check_graph,
    "out": check_out_contract,
    "state": check_state,
}


def run_case(case: Case, session: Any, seed: int) -> None:
    """Run one battery case with inputs drawn from ``seed`` (raises on a defect)."""
    gen = torch.Generator().manual_seed(seed)
    CHECK_FUNCTIONS[case.check](case, session, gen)
