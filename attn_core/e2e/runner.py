"""A small continuous-batching engine over the attention runtime.

One :class:`Engine` serves one tiny model: it owns the core's :class:`PersistentState`, a
:class:`BatchBuilder` and an :class:`AttentionRuntime`, and runs greedy generation for several
requests at once::

    step:  admit waiting requests (one per step, so batches mix),
           schedule every active request: a prefill chunk (<= chunk_size prompt tokens) or one
           decode token,
           build the batch -> runtime.prepare -> adapter.forward -> logits,
           advance the state, pick the next token (argmax) of requests whose prompt is done,
           release finished requests.

Pure-decode steps can run as CUDA graphs: one graph per padded batch size, captured on an
all-padding batch (padding rows write no KV and touch no linear state, so capture leaves the
state untouched); before each replay the real batch is built into the same buffers and
``runtime.update(batch)`` refreshes the contexts in place.

Under graph mode ``full`` (``graphs="full"``, where the plan grants it: every group's prefill
backend declares ``full``) prefill and mixed steps run as one more graph, captured on an
all-padding batch of ``max_batch_size`` requests and ``max_num_tokens`` tokens
(``BatchBuilder.build(pad_to=..., pad_tokens_to=...)``) and replayed for every split of prefill
chunks and decodes; pure-decode steps keep their per-size decode graphs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attn_core.batch import BatchBuilder
from attn_core.e2e.adapters import CausalLMAdapter, layer_params_for
from attn_core.e2e.configs import TinyModel
from attn_core.runtime import AttentionRuntime
from attn_core.specs import GraphMode
from attn_core.state import PersistentState

__all__ = ["Engine", "GenerationResult", "graph_mode_of"]


def graph_mode_of(graphs: bool | str | GraphMode | None) -> GraphMode:
    """The graph mode a run's ``graphs`` argument asks for: False / None / ``"none"`` ->
    ``none``, True / ``"decode"`` -> ``decode`` (pure-decode steps), ``"full"`` -> ``full``
    (mixed steps too)."""
    if graphs is None or graphs is False:
        return GraphMode.NONE
    if graphs is True:
        return GraphMode.DECODE
    return GraphMode(graphs)


_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class GenerationResult:
    """What :meth:`Engine.generate` produced.

    :ivar prompts: the prompt token ids per request.
    :ivar tokens: the greedy tokens generated per request.
    :ivar logits: per request ``[len(prompt) + len(tokens) - 1, vocab]`` float32 on the CPU: the
        logits of every fed position (row ``t`` predicts token ``t + 1``).
    :ivar step_modes: the batch mode of every step (``prefill`` / ``mixed`` / ``decode``).
    """

    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]
    step_modes: list[str] = field(default_factory=list)
    graph_replays: int = 0
    #: prefill / mixed steps replayed in the captured mixed-step graph (graph mode full)
    mixed_graph_replays: int = 0
    graph_note: str = ""
    total_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    total_tokens: int = 0

    @property
    def steps(self) -> int:
        return len(self.step_modes)

    def mode_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self.step_modes:
            counts[m] = counts.get(m, 0) + 1
        return counts

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass(eq=False)
class _Request:
    rid: int
    prompt: list[int]
    fed: int = 0
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)


class Engine:
    """Continuous batching with chunked prefill and greedy decode for one tiny causal LM.

    :param model: the tiny model and its layout.
    :param plan: the selector's plan for ``model.layout.groups``.
    :param registry: the registry the plan came from.
    :param device: where the model lives.
    :param chunk_size: most prompt tokens of one request per step.
    :param max_batch_size: most requests per step (graph padding included).
    :param max_model_len: most tokens per request.
    :param graphs: the graph mode (:func:`graph_mode_of`): True / ``"decode"`` captures
        pure-decode steps, ``"full"`` mixed steps too where the plan grants graph mode full
        (CUDA only).
    :param direct: the adapter calls contexts directly instead of bindings (overhead studies).
    """

    def __init__(
        self,
        model: TinyModel,
        plan: Any,
        registry: Any,
        *,
        device: torch.device | str = "cpu",
        chunk_size: int = 5,
        max_batch_size: int = 8,
        max_model_len: int = 256,
        graphs: bool | str = False,
        direct: bool = False,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: expected >= 1")
        self.model = model
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        layout = model.layout
        page_size = plan.page_size or 16
        pages_per_req = math.ceil(max_model_len / page_size)
        self.state = PersistentState.from_plan(
            plan,
            num_pages=max_batch_size * pages_per_req + 1,
            num_slots=max_batch_size,
            device=self.device,
        )
        self.runtime = AttentionRuntime(
            plan,
            registry,
            state=self.state,
            device=self.device,
            layer_params=layer_params_for(model.hf, layout),
        )
        self.max_num_tokens = max(max_batch_size * chunk_size, max_batch_size)
        self.builder = BatchBuilder(
            self.state,
            max_batch_size=max_batch_size,
            max_num_tokens=self.max_num_tokens,
            max_pages_per_request=pages_per_req,
            device=self.device,
        )
        self.adapter = CausalLMAdapter(model.hf, layout, self.runtime, direct=direct)
        mode = graph_mode_of(graphs)
        cuda = self.device.type == "cuda"
        self.graphs = mode is not GraphMode.NONE and cuda
        self.graph_note = (
            "CUDA graphs need a CUDA device" if mode is not GraphMode.NONE and not cuda else ""
        )
        # mixed steps are captured only where the plan grants full (the selector may have
        # lowered it: a group whose prefill backends capture no mixed step)
        granted = plan.constraints.graph_mode
        self.full_graphs = mode is GraphMode.FULL and cuda and granted is GraphMode.FULL
        if mode is GraphMode.FULL and cuda and granted is not GraphMode.FULL:
            self.graph_note = (
                f"graph mode full was lowered to {granted.value} by the plan (a group has no "
                "backend that captures mixed steps): prefill and mixed steps run eagerly"
            )
        self.last_step_graph = False
        self.capture_seconds = 0.0  # time spent capturing CUDA graphs (warm-up included)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._full: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------------------------
    def step(
        self,
        schedule: Sequence[tuple[int, list[int]]],
        *,
        use_graph: bool = False,
        use_full_graph: bool = False,
    ):
        """Run one step: ``schedule`` is ``(request id, token ids fed this step)`` per request.

        ``use_graph``: replay a pure-decode step's graph (of its padded batch size);
        ``use_full_graph``: replay the captured mixed step (graph mode full), whatever the
        step's split.

        :returns: ``([num_tokens, vocab]`` logits of the real tokens, the batch).
        """
        ids = [t for _, toks in schedule for t in toks]
        reqs = [(rid, len(toks)) for rid, toks in schedule]
        P, T = self.max_batch_size, self.max_num_tokens

        def replay(entry, batch):
            graph, static_ids, static_logits = entry
            self.runtime.update(batch)
            static_ids.zero_()
            static_ids[: len(ids)].copy_(torch.tensor(ids, dtype=torch.long))
            graph.replay()
            self.last_step_graph = True
            return static_logits[: len(ids)], batch

        if use_full_graph and len(ids) + P - len(reqs) <= T:
            entry = self._full or self._capture(None)
            if entry is not None:
                return replay(entry, self.builder.build(reqs, pad_to=P, pad_tokens_to=T))
        if use_graph:
            size = next((s for s in _GRAPH_SIZES if s >= len(reqs)), None)
            if size is not None and size <= self.max_batch_size:
                entry = self._graphs.get(size) or self._capture(size)
                if entry is not None:
                    return replay(entry, self.builder.build(reqs, pad_to=size))
        self.last_step_graph = False
        batch = self.builder.build(reqs)
        self.runtime.prepare(batch)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.adapter.forward(input_ids, batch.positions), batch

    def _capture(self, size: int | None):
        """Capture the decode step for ``size`` padded requests on an all-padding batch, or
        (``size`` None) the mixed step of graph mode full at ``max_batch_size`` requests and
        ``max_num_tokens`` tokens."""
        t0 = time.perf_counter()
        try:
            return self._capture_timed(size)
        finally:
            self.capture_seconds += time.perf_counter() - t0

    def _capture_timed(self, size: int | None):
        try:
            if size is None:
                dummy = self.builder.build(
                    [], pad_to=self.max_batch_size, pad_tokens_to=self.max_num_tokens
                )
            else:
                dummy = self.builder.build([], pad_to=size)
            self.runtime.prepare(dummy)
            static_ids = torch.zeros(dummy.padded_tokens, dtype=torch.long, device=self.device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits and allocator pools outside the graph
                    self.adapter.forward(static_ids, dummy.positions)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = self.adapter.forward(static_ids, dummy.positions)
        except Exception as exc:  # e.g. a MoE block that syncs on data-dependent shapes
            torch.cuda.synchronize()
            if size is None:
                self.full_graphs = False
                self.graph_note = (
                    "mixed-step graph capture failed, prefill and mixed steps run eagerly: "
                    f"{type(exc).__name__}: {exc}"
                )
                return None
            self.graphs = False
            self.graph_note = (
                f"graph capture failed, decode runs eagerly: {type(exc).__name__}: {exc}"
            )
            return None
        if size is None:
            self._full = (graph, static_ids, static_logits)
            return self._full
        self._graphs[size] = (graph, static_ids, static_logits)
        return self._graphs[size]

    # ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        admit_per_step: int = 1,
        progress: Any = None,
        release: bool = True,
        generated: Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Greedy generation of ``max_new_tokens`` for every prompt, continuously batched.

        Request ``i`` is ``self.state``'s request id ``i``. A prefill / decode hand-off splits
        one generation over two engines: ``generate(prompts, 1, release=False)`` prefills and
        keeps each request's state for ``state.export_request(i)``; the other engine imports
        it as request ``i`` and calls ``generate(prompts, n, generated=first_tokens)``.

        :param prompts: token ids per request (each at least one token).
        :param admit_per_step: new requests admitted per step (fewer than all: mixed batches).
        :param progress: optional callable ``(done_requests, total_requests, step)``.
        :param release: release each request's state when it finishes; False keeps it in
            ``self.state`` (to export it; the caller releases it).
        :param generated: per request the tokens already generated elsewhere (at least one,
            fewer than ``max_new_tokens``): the request is in ``self.state`` already (imported)
            with its prompt and all but the last of them written, and goes on decoding from
            there; ``max_new_tokens`` counts them. Its :attr:`GenerationResult.logits` rows are
            then only those computed here (``[max_new_tokens - len(generated[i]), vocab]``) and
            its ``tokens`` all of them.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
        reqs = [_Request(i, list(p)) for i, p in enumerate(prompts)]
        for r in reqs:
            if not r.prompt or len(r.prompt) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {r.rid}: {len(r.prompt)} tokens + {max_new_tokens} new must be in "
                    f"1..max_model_len={self.max_model_len}"
                )
        waiting = deque(reqs)
        active: list[_Request] = []
        if generated is not None:
            active = list(self._resumed(reqs, generated, max_new_tokens))
            waiting.clear()
        result = GenerationResult([r.prompt for r in reqs], [], [])
        done = 0
        t_start = time.perf_counter()
        while waiting or active:
            for _ in range(admit_per_step):
                if waiting and len(active) < self.max_batch_size:
                    r = waiting.popleft()
                    self.state.add_request(r.rid)
                    active.append(r)
            schedule, budget = [], self.max_num_tokens
            for r in active:
                if r.fed < len(r.prompt):
                    n = min(self.chunk_size, len(r.prompt) - r.fed, budget - 1)
                    toks = r.prompt[r.fed : r.fed + n]
                else:
                    toks = [r.tokens[-1]]
                budget -= len(toks)
                schedule.append((r, toks))
            is_decode = all(r.fed >= len(r.prompt) for r, _ in schedule)
            t0 = time.perf_counter()
            logits, batch = self.step(
                [(r.rid, toks) for r, toks in schedule],
                use_graph=self.graphs and is_decode,
                use_full_graph=self.full_graphs and not is_decode,
            )
            logits = logits.float().cpu()  # one sync per step: greedy sampling needs it
            if is_decode:
                result.decode_seconds += time.perf_counter() - t0
                result.decode_tokens += len(schedule)
                result.graph_replays += int(self.last_step_graph)
            else:
                result.mixed_graph_replays += int(self.last_step_graph)
            result.total_tokens += batch.num_tokens
            # a captured mixed step's batch is MIXED whatever its split: count the real one
            qlens = np.array([len(toks) for _, toks in schedule])
            mode = BatchBuilder.step_mode(qlens) if batch.full_graph else batch.mode
            result.step_modes.append(mode.value)
            off = 0
            for r, toks in schedule:
                n = len(toks)
                rows = logits[off : off + n]
                off += n
                r.rows.append(rows)
                self.state.advance(r.rid, n)
                r.fed += n
                if r.fed >= len(r.prompt):
                    r.tokens.append(int(rows[-1].argmax()))
            for r in [r for r in active if len(r.tokens) >= max_new_tokens]:
                active.remove(r)
                if release:
                    self.state.release(r.rid)
                self.builder.invalidate(r.rid)
                done += 1
            if progress is not None:
                progress(done, len(reqs), len(result.step_modes))
        result.total_seconds = time.perf_counter() - t_start
        result.tokens = [r.tokens for r in reqs]
        result.logits = [torch.cat(r.rows) for r in reqs]
        result.graph_note = self.graph_note
        return result

    def _resumed(
        self, reqs: list[_Request], generated: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[_Request]:
        """``reqs`` set up to go on decoding after ``generated`` tokens each (imported state)."""
        if len(generated) != len(reqs):
            raise ValueError(f"generated: {len(generated)} token lists for {len(reqs)} prompts")
        if len(reqs) > self.max_batch_size:
            raise ValueError(
                f"{len(reqs)} handed-off requests exceed max_batch_size={self.max_batch_size}"
            )
        for r, toks in zip(reqs, generated, strict=True):
            toks = list(toks)
            if not 0 < len(toks) < max_new_tokens:
                raise ValueError(
                    f"request {r.rid}: {len(toks)} tokens generated already, expected "
                    f"1..{max_new_tokens - 1} (max_new_tokens={max_new_tokens} leaves one to "
                    "decode here)"
                )
            want = len(r.prompt) + len(toks) - 1
            have = self.state.num_tokens(r.rid) if r.rid in self.state else None
            if have != want:
                raise ValueError(
                    f"request {r.rid}: the state holds {have} tokens, expected {want} (its "
                    f"{len(r.prompt)}-token prompt and all but the last of {len(toks)} "
                    "generated tokens: import it first)"
                )
            r.fed, r.tokens = len(r.prompt), toks
        return reqs
