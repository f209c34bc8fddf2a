"""Prefill / decode disaggregation check: a request prefilled on rank 0 decodes on rank 1.

Run with ``torchrun --nproc_per_node 2 -m attn_core.e2e.handoff_check [--model all] [--device
cuda]`` (gloo on CPU, NCCL on CUDA). For each family both ranks build the same tiny model (seed
0, float32). Rank 0 prefills every request on an engine paged by :data:`PREFILL_PAGE` tokens
(``Engine.generate(prompts, 1, release=False)``: the prompt and the first greedy token), exports
each request's state (``PersistentState.export_request``) and sends it
(:func:`attn_core.state.handoff.send_request`) with the first tokens; rank 1, whose engine
pages by :data:`DECODE_PAGE` tokens, receives and imports each one
(:func:`~attn_core.state.handoff.recv_into_state`) and decodes greedily from there
(``generate(..., generated=first_tokens)``). Both ranks also run the whole generation on one
engine (prefill and decode in one process): rank 0's prefill logits and rank 1's decode logits
must equal its rows to :data:`TOLERANCE`, and the tokens must be the same. Rank 0 prints one
line per family (``--json PATH`` also writes them); the exit status is 1 when any family
mismatches or fails (the line then says which step failed and why).

``--corrupt`` adds the refusals: rank 0 sends corrupted headers and metadata (a wrong magic,
wire or format version, metadata bytes changed on the way, a field missing, a buffer length
disagreeing with the metadata), an export of another layout and one for a request id that
exists; rank 1's receive must raise the specific error, rank 0's send must raise the receiver's
reasons, rank 1's resident request must be untouched, and a genuine export must then go through
over the same group.

``--measure`` times the hand-off of one long request without a model: a ``--tokens``-token
(default 32768) KV of ``--layers`` full-attention layers of ``--kv-heads`` x ``--head-dim`` in
``--kv-dtype`` (default Qwen3-8B: 36 x 8 x 128, bfloat16; 4.8 GB) is exported on rank 0 (page
16), sent and imported on rank 1 (page 64). It prints the GB/s of the send alone, of
export + send + import, and of the link: a plain ``dist.send`` of a tensor of the same size in
the same processes (each the best of ``--iters``, the slower rank's time), with each ratio to
the link, and checks the imported bytes equal the sent ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from attn_core.e2e.configs import ARCHITECTURES, ENCODER_MODELS, SHAPES, build_tiny
from attn_core.e2e.dist_run import end_group, exit_now, write_results
from attn_core.e2e.main import default_registry, default_shapes, make_prompts, plan_for
from attn_core.e2e.runner import Engine, GenerationResult
from attn_core.specs import ExecutionConstraints, LayerSpec, group_layers
from attn_core.state import PersistentState, RequestExport
from attn_core.state.handoff import (
    WIRE_VERSION,
    _devices,
    _send_parts,
    encode_header,
    encode_meta,
    recv_into_state,
    recv_request,
    send_request,
)
from attn_core.state.transfer import FORMAT_VERSION, ExportMeta

__all__ = [
    "DECODE_PAGE",
    "HANDOFF_FAMILIES",
    "PREFILL_PAGE",
    "REFUSALS",
    "TOLERANCE",
    "HandoffResult",
    "check_family",
    "check_refusals",
    "measure",
]

#: Every causal sample the runner drives: dense GQA (Qwen3), MLA (DeepSeek-V3), Gated DeltaNet
#: (Qwen3-Next), KDA (Kimi-Linear), Mamba2 (Bamba, Nemotron-H), Mamba1 (Jamba, Falcon-Mamba),
#: lightning (MiniMax), short conv (LFM2), sliding windows and sinks (Gemma-3, gpt-oss), chunked
#: attention (Llama-4), a parallel hybrid (Falcon-H1).
HANDOFF_FAMILIES: tuple[str, ...] = tuple(n for n in ARCHITECTURES if n not in ENCODER_MODELS)
#: Tokens per KV page of the prefill engine (rank 0) and of the decode engine (rank 1).
PREFILL_PAGE, DECODE_PAGE = 4, 16
#: Bound on ``|logits - single-process logits|`` in float32 (as tp_check's): the two runs batch
#: the same requests differently (after the hand-off decode steps hold no prefill chunks, and
#: the linear layers' chunked prefill sees other chunk splits), so sums run in another order;
#: differences seen are 0 to 1.3e-5, an error in the moved state shows as O(1).
TOLERANCE = 1e-4

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """One line of the report.

    :ivar name: the family, ``refuse <case>`` or ``measure``.
    :ivar max_abs_diff: families: max over requests of ``|decode logits (rank 1) - single run|``.
    :ivar prefill_diff: families: the same of rank 0's prefill logits.
    :ivar tokens_equal: families: every request's greedy tokens equal the single run's.
    :ivar nbytes: bytes of the exports moved (all requests of a family; the measured request).
    :ivar detail: refusals: the receiver's and the sender's errors; measure: the rates.
    :ivar gbps: measure: ``{"send": ..., "export_send_import": ..., "link": ...}`` in GB/s.
    :ivar error: why the family could not run: which step, which rank, the exception.
    """

    name: str
    ok: bool
    max_abs_diff: float = float("nan")
    prefill_diff: float = float("nan")
    tokens_equal: bool = False
    nbytes: int = 0
    detail: str = ""
    gbps: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str = ""

    def format(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        if self.error:
            return f"handoff_check {self.name}: ERROR {self.error} -> {verdict}"
        if self.detail:
            return f"handoff_check {self.name}: {self.detail} -> {verdict}"
        return (
            f"handoff_check {self.name}: page {PREFILL_PAGE} -> {DECODE_PAGE}, {self.nbytes} "
            f"bytes moved; vs one engine: decode max|diff|={self.max_abs_diff:.2e} prefill "
            f"max|diff|={self.prefill_diff:.2e} tokens "
            f"{'equal' if self.tokens_equal else 'DIFFER'} -> {verdict}"
        )


def _engine(
    name: str, page_size: int, *, device: torch.device, prompts: list[list[int]], new_tokens: int,
    shapes: str, registry: Any,
) -> Engine:  # fmt: skip
    """An engine over tiny model ``name`` (seed 0, float32) paged by ``page_size`` tokens."""
    model = build_tiny(name, device=device, shapes=shapes)
    batch = len(prompts)
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    plan = plan_for(
        model,
        registry,
        device,
        ExecutionConstraints(page_size=page_size),
        max_batch_size=batch,
        max_num_tokens=5 * batch,
        max_model_len=max_len,
        graphs=False,
    )
    return Engine(model, plan, registry, device=device, max_batch_size=batch, max_model_len=max_len)


def _attempt(step: str, fn: Callable[[], _T]) -> _T | str:
    """``fn()``, or ``"<step>: <exception>"`` if it raised (a family's failure is reported,
    the other families still run)."""
    try:
        return fn()
    except Exception as exc:
        return f"{step}: {type(exc).__name__}: {exc}"


def _error_of(step: str, fn: Callable[[], object]) -> str:
    """:func:`_attempt`'s error, or ``""`` if ``fn`` returned."""
    result = _attempt(step, fn)
    return result if isinstance(result, str) else ""


def _agree(errors: list[str], *, rank: int) -> str:
    """Every rank's errors joined (empty: none failed), so that all ranks take the same branch."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, f"rank {rank} " + "; ".join(errors) if errors else "")
    return "; ".join(e for e in gathered if e)


def _max_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


def check_family(
    name: str, *, rank: int, device: torch.device, prompts: int, new_tokens: int, shapes: str,
    registry: Any = None,
) -> HandoffResult:  # fmt: skip
    """Prefill on rank 0, hand off, decode on rank 1; both against one engine's whole run.

    :param new_tokens: greedy tokens per request (>= 2: the first comes from the prefill).
    """
    registry = registry if registry is not None else default_registry()
    ids = make_prompts(prompts)
    page = PREFILL_PAGE if rank == 0 else DECODE_PAGE

    def engine_of(page_size: int) -> Engine:
        return _engine(
            name, page_size, device=device, prompts=ids, new_tokens=new_tokens, shapes=shapes,
            registry=registry,
        )  # fmt: skip

    ref = _attempt("single engine", lambda: engine_of(DECODE_PAGE).generate(ids, new_tokens))
    engine = _attempt(f"engine (page {page})", lambda: engine_of(page))
    pre = None
    if rank == 0 and isinstance(engine, Engine):
        pre = _attempt("prefill", lambda: engine.generate(ids, 1, release=False))
    error = _agree([r for r in (ref, engine, pre) if isinstance(r, str)], rank=rank)
    if error:
        return HandoffResult(name, False, error=error)
    assert isinstance(ref, GenerationResult) and isinstance(engine, Engine)
    _, wire = _devices(None, device)
    nbytes, errors = 0, []
    if rank == 0:
        assert isinstance(pre, GenerationResult)
        firsts = torch.tensor([t[0] for t in pre.tokens], dtype=torch.int64)
        dist.send(firsts.to(wire), 1)
        for i in range(len(ids)):
            export = _attempt(f"export {i}", partial(engine.state.export_request, i, device=wire))
            if isinstance(export, str):  # still send one, refused, so that rank 1 stays in step
                errors.append(export)
                export = RequestExport(_EMPTY, _NO_BYTES)
            nbytes += export.meta.nbytes
            sent = _attempt(f"send {i}", partial(send_request, export, 1))
            errors += [sent] if isinstance(sent, str) else []
            engine.state.release(i)
    else:
        got = torch.empty(len(ids), dtype=torch.int64, device=wire)
        dist.recv(got, 0)
        firsts = got.cpu()
        for i in range(len(ids)):
            meta = _attempt(f"import {i}", partial(recv_into_state, engine.state, i, 0))
            if isinstance(meta, str):
                errors.append(meta)
            else:
                nbytes += meta.nbytes
    dec = None
    if rank == 1 and not errors:
        generated = [[int(t)] for t in firsts.tolist()]
        dec = _attempt("decode", lambda: engine.generate(ids, new_tokens, generated=generated))
        errors += [dec] if isinstance(dec, str) else []
    error = _agree(errors, rank=rank)
    if error:
        return HandoffResult(name, False, nbytes=nbytes, error=error)
    diff = prefill = 0.0
    if rank == 0:
        assert isinstance(pre, GenerationResult)
        prefill = _max_diff(pre.logits, [r[: len(p)] for r, p in zip(ref.logits, ids, strict=True)])
        same = [t[:1] for t in ref.tokens] == pre.tokens
    else:
        assert isinstance(dec, GenerationResult)
        diff = _max_diff(dec.logits, [r[len(p) :] for r, p in zip(ref.logits, ids, strict=True)])
        same = dec.tokens == ref.tokens
    stats = torch.tensor([diff, prefill, 0.0 if same else 1.0]).to(wire)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    diff, prefill, differ = (float(x) for x in stats.tolist())
    ok = diff <= TOLERANCE and prefill <= TOLERANCE and not differ
    return HandoffResult(name, ok, diff, prefill, not differ, nbytes)


#: What rank 0 sends when an export failed: refused at the header (format version -1), so both
#: ranks stay in step and report the failure.
_EMPTY = ExportMeta(num_tokens=0, page_size=1, num_pages=0, layers=(), nbytes=0, version=-1)
_NO_BYTES = torch.zeros(0, dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------
def _layers(head_dim: int = 8, page_size: int = 4) -> list[Any]:
    """A small hybrid: layer 0 KDA (a conv and a recurrent state), 1 full attention, 2 MLA."""
    full = LayerSpec("full", 4, 2, head_dim, page_size=page_size, dtype="float32")
    mla = LayerSpec(
        "mla", 2, 1, 10, head_dim_v=8, kv_lora_rank=8, qk_rope_head_dim=2, qk_nope_head_dim=4,
        page_size=page_size, dtype="float32",
    )  # fmt: skip
    lin = LayerSpec(
        "linear", 2, 1, 4, head_dim_v=3, linear_variant="kda", conv_kernel_size=3,
        conv_channels=5,
    )  # fmt: skip
    return group_layers([lin, full, mla])


def _filled(state: PersistentState, rid: Any, n: int, seed: int) -> None:
    """Request ``rid`` with ``n`` tokens of seeded random KV bytes and random linear state."""
    g = torch.Generator().manual_seed(seed)
    state.add_request(rid)
    state.ensure_capacity(rid, n)
    for i in state.kv_cache.layer_indices:
        for rows in state.kv_cache.token_rows(i).values():
            idx = torch.tensor(state.slot_mapping(rid, 0, n), dtype=torch.long)
            rows[idx.to(rows.device)] = torch.randint(
                0, 256, (n, rows.shape[1]), generator=g, dtype=torch.uint8
            ).to(rows.device)
    for layer in state.state_slots.layers():
        for t in layer.tensors().values():
            t[state.slot(rid)] = torch.randn(t.shape[1:], generator=g).to(t.dtype).to(t.device)
    state.advance(rid, n)


def _corrupt(case: str, export: RequestExport) -> tuple[torch.Tensor, bytes]:
    """The header and metadata bytes of ``export`` corrupted as ``case`` says."""
    meta_bytes = encode_meta(export.meta)
    header = encode_header(export.meta, meta_bytes)
    if case == "magic":
        header[0] ^= 1
    elif case == "wire-version":
        header[1] = WIRE_VERSION + 1
    elif case == "format-version":
        header[2] = FORMAT_VERSION + 1
    elif case == "meta-bytes":  # changed on the way: the CRC in the header no longer matches
        flipped = bytearray(meta_bytes)
        flipped[len(flipped) // 2] ^= 0x20
        meta_bytes = bytes(flipped)
    elif case == "meta-field":  # well-formed JSON, consistent header, a field missing
        obj = json.loads(meta_bytes)
        del obj["layers"][1]["tensors"][0]["offset"]
        meta_bytes = json.dumps(obj).encode()
        header = encode_header(export.meta, meta_bytes)
    elif case == "meta-nbytes":
        header[4] += 16
    return header, meta_bytes


#: Case -> (what the receiver's error says, what the sender's error says).
REFUSALS: dict[str, tuple[str, str]] = {
    "magic": ("header: magic: got", "refused the export's header: magic"),
    "wire-version": (
        f"wire version: sender {WIRE_VERSION + 1}, here {WIRE_VERSION}",
        "refused the export's header: wire version",
    ),
    "format-version": (
        f"format version: export {FORMAT_VERSION + 1}, here {FORMAT_VERSION}",
        "refused the export's header: format version",
    ),
    "meta-bytes": ("meta: crc32", "refused the export's meta: meta: crc32"),
    "meta-field": (
        "meta: layers[1].tensors[0].: TensorEntry fields missing ['offset']",
        "refused the export's meta",
    ),
    "meta-nbytes": ("meta.nbytes says", "refused the export's meta"),
    "layout": ("layer 1: k shape: export [2, 16], here [2, 8]", "refused the export's meta"),
    "exists": ("request 'resident' already exists here", "refused the export's meta"),
}


def check_refusals(*, rank: int, device: torch.device) -> list[HandoffResult]:
    """Every :data:`REFUSALS` case from rank 0 to rank 1, then a genuine export."""
    _, wire = _devices(None, device)
    results = []
    if rank == 0:
        src = PersistentState(_layers(), num_pages=8, num_slots=2, device=device)
        _filled(src, "a", 11, seed=1)
        export = src.export_request("a", device=wire)
        wide = PersistentState(_layers(head_dim=16), num_pages=8, num_slots=2, device=device)
        _filled(wide, "a", 11, seed=1)
        wide_export = wide.export_request("a", device=wire)
        for case in REFUSALS:
            if case == "layout":
                header, meta_bytes, buf = *_corrupt("", wide_export), wide_export.buffer
            else:
                header, meta_bytes, buf = *_corrupt(case, export), export.buffer
            error = _error_of("send", partial(_send_parts, header, meta_bytes, buf, 1, None))
            results.append((case, error))
        error = _error_of("send", partial(send_request, export, 1))
        # what the import must reproduce, sent plainly
        dist.send(torch.tensor([export.meta.nbytes]).to(wire), 1)
        dist.send(export.buffer.to(wire), 1)
        results.append(("genuine", error))
    else:
        dst = PersistentState(_layers(page_size=16), num_pages=4, num_slots=3, device=device)
        _filled(dst, "resident", 5, seed=2)
        before = dst.export_request("resident").buffer
        free = (dst.num_free_pages, dst.num_free_slots)
        for case in REFUSALS:
            rid = "resident" if case == "exists" else "a"
            error = _error_of("receive", partial(recv_into_state, dst, rid, 0))
            intact = (
                torch.equal(dst.export_request("resident").buffer, before)
                and (dst.num_free_pages, dst.num_free_slots) == free
                and "a" not in dst
            )
            dst.check_invariants()
            results.append((case, error + ("" if intact else "; the resident request CHANGED")))
        # the same group, in step after every refusal: a genuine export imports
        error = _error_of("receive", partial(recv_into_state, dst, "a", 0))
        size = torch.zeros(1, dtype=torch.int64, device=wire)
        dist.recv(size, 0)
        sent = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
        dist.recv(sent, 0)
        if not error and not torch.equal(dst.export_request("a", device=wire).buffer, sent):
            error = "the imported request's bytes differ from the sent export's"
        results.append(("genuine", error))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    out = []
    for (case, sender), (_, receiver) in zip(gathered[0], gathered[1], strict=True):
        if case == "genuine":
            ok = not sender and not receiver
            detail = "a genuine export after the refusals imports bitwise (page 4 -> 16)"
            error = "; ".join(e for e in (sender, receiver) if e)
            out.append(HandoffResult("after refusals", ok, detail=detail, error=error))
            continue
        want_recv, want_send = REFUSALS[case]
        ok = (
            want_recv in receiver
            and "HandoffError" in receiver
            and want_send in sender
            and "CHANGED" not in receiver
        )
        kept = "CHANGED" if "CHANGED" in receiver else "intact"
        detail = f"receiver {receiver} | sender {sender} | resident request {kept}"
        out.append(HandoffResult(f"refuse {case}", ok, detail=detail))
    return out


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds from a barrier to ``fn`` done on the slower of the two ranks."""
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    _, wire = _devices(None, device)
    elapsed = elapsed.to(wire)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure(
    *, rank: int, device: torch.device, tokens: int = 32768, layers: int = 36,
    kv_heads: int = 8, head_dim: int = 128, kv_dtype: str = "bfloat16", iters: int = 5,
) -> HandoffResult:  # fmt: skip
    """Hand-off rates of one ``tokens``-token request of ``layers`` full-attention layers.

    Rank 0 holds it paged by 16, rank 1 imports it paged by 64. Timed (each the best of
    ``iters`` after one untimed round, each time the slower rank's): the link (a plain
    ``dist.send`` of a ``uint8`` tensor of the export's size), the send alone
    (``send_request`` of a ready export / ``recv_request``) and export + send + import.
    """
    page = 16 if rank == 0 else 64
    spec = LayerSpec(
        "full", max(kv_heads, 1) * 4, kv_heads, head_dim, dtype=kv_dtype, page_size=page
    )
    groups = group_layers([spec] * layers)
    num_pages = -(-tokens // page) + 1
    state = PersistentState(groups, num_pages=num_pages, num_slots=1, device=device)
    _, wire = _devices(None, device)
    if rank == 0:
        state.add_request("r")
        state.ensure_capacity("r", tokens)
        for layer in state.kv_cache.layers():
            for t in layer.tensors().values():
                t.view(torch.uint8).random_(0, 256)
        state.advance("r", tokens)
        export = state.export_request("r", device=wire)
        nbytes = export.meta.nbytes
    else:
        export = None
        nbytes = 0
    size = torch.tensor([nbytes], dtype=torch.int64).to(wire)
    dist.broadcast(size, 0)
    nbytes = int(size.item())
    plain = (
        export.buffer if export is not None else torch.empty(nbytes, dtype=torch.uint8, device=wire)
    )
    imported: list[RequestExport] = []

    def link() -> None:
        if rank == 0:
            dist.send(plain, 1)
        else:
            dist.recv(plain, 0)

    def send_only() -> None:
        if rank == 0:
            assert export is not None
            send_request(export, 1)
        else:
            imported[:] = [recv_request(0, wire)]

    def end_to_end() -> None:
        if rank == 0:
            send_request(state.export_request("r", device=wire), 1)
        else:
            if "r" in state:
                state.release("r")
            recv_into_state(state, "r", 0)

    times: dict[str, list[float]] = {"link": [], "send": [], "export_send_import": []}
    for it in range(iters + 1):
        for key, fn in (("link", link), ("send", send_only), ("export_send_import", end_to_end)):
            seconds = _timed(fn, device)
            if it:  # the first round warms up (NCCL's point-to-point channels, allocations)
                times[key].append(seconds)
    # rank 1 holds the last import (paged by 64) and the link's copy of rank 0's export
    equal = True
    if rank == 1:
        equal = torch.equal(state.export_request("r", device=wire).buffer, plain)
        equal = equal and bool(imported) and torch.equal(imported[0].buffer.to(wire), plain)
    flag = torch.tensor([0.0 if equal else 1.0]).to(wire)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    ok = not float(flag.item())
    gbps = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
    median = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    link_rate = gbps["link"]
    detail = (
        f"{tokens} tokens x {layers} layers ({kv_heads} KV heads x {head_dim}, {kv_dtype}), "
        f"{nbytes / 1e9:.3g} GB, page 16 -> 64, {dist.get_backend()} on {wire.type}: send "
        f"{gbps['send']:.3g} GB/s ({gbps['send'] / link_rate:.2f} of the link), export+send+"
        f"import {gbps['export_send_import']:.3g} GB/s "
        f"({gbps['export_send_import'] / link_rate:.2f}), link (plain send) {link_rate:.3g} "
        f"GB/s; medians {median['send']:.3g} / {median['export_send_import']:.3g} / "
        f"{median['link']:.3g}; best of {iters}; bytes "
        f"{'equal' if ok else 'DIFFER'}"
    )
    return HandoffResult("measure", ok, nbytes=nbytes, detail=detail, gbps=gbps)


# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model",
        default=None,
        help=f"'all', 'none' or a comma list of {HANDOFF_FAMILIES} (default: all, or none "
        "with --corrupt / --measure)",
    )
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--shapes", default=None, choices=list(SHAPES), help="the samples' sizes")
    parser.add_argument("--json", default=None, help="write rank 0's results to this file")
    parser.add_argument("--corrupt", action="store_true", help="also check the refusals")
    parser.add_argument("--measure", action="store_true", help="also time one long request")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds a rank waits for the other one"
    )
    args = parser.parse_args(argv)
    model = args.model or ("none" if args.corrupt or args.measure else "all")
    names = (
        list(HANDOFF_FAMILIES)
        if model == "all"
        else []
        if model == "none"
        else [n.strip() for n in model.split(",") if n.strip()]
    )
    unknown = [n for n in names if n not in HANDOFF_FAMILIES]
    if unknown or not (names or args.corrupt or args.measure):
        parser.error(f"--model {model!r}: expected 'all', 'none' or names of {HANDOFF_FAMILIES}")
    if args.iters < 1 or args.tokens < 1 or args.layers < 1:
        parser.error("--iters, --tokens and --layers: expected >= 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens: expected >= 2 (the first token comes from the prefill)")
    cuda = args.device.startswith("cuda")
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        parser.error(f"handoff_check runs on 2 ranks (prefill, decode), got {world}")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    shapes = default_shapes(device, args.shapes)
    results: list[HandoffResult] = []

    def report(result: HandoffResult) -> None:
        results.append(result)
        if rank == 0:
            print(result.format(), flush=True)

    try:
        for name in names:
            report(
                check_family(
                    name,
                    rank=rank,
                    device=device,
                    prompts=args.prompts,
                    new_tokens=args.new_tokens,
                    shapes=shapes,
                )
            )
        if args.corrupt:
            for result in check_refusals(rank=rank, device=device):
                report(result)
        if args.measure:
            report(
                measure(
                    rank=rank,
                    device=device,
                    tokens=args.tokens,
                    layers=args.layers,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    kv_dtype=args.kv_dtype,
                    iters=args.iters,
                )
            )
    except BaseException:
        # printed before the barrier below, which waits for the other rank (until --timeout)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        end_group()
    if rank == 0:
        write_results(args.json, results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    exit_now(main())
