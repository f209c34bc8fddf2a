"""A backend and the reference driven side by side through the core, on the same inputs.

Each :class:`Side` owns its own :class:`~attn_core.state.PersistentState`, batch builder and
:class:`~attn_core.runtime.AttentionRuntime`, so each backend writes (and is judged on) its own
cache. Both sides see the same sequence of state operations, so page and slot ids agree and the
whole caches can be compared after every step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from attn_core.backend import Backend
from attn_core.batch import AttentionBatch, BatchBuilder, BatchMode
from attn_core.registry import Registry
from attn_core.runtime import AttentionRuntime
from attn_core.selector import GroupChoice, PhaseChoice, Plan
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerKind,
    LayerSpec,
    LinearVariant,
    Phase,
    group_layers,
    torch_dtype,
)
from attn_core.state import LinearStateLayer, PersistentState
from attn_core.testing.checks import (
    FP32_STATE_RTOL,
    NAN_POISON,
    BackendRaised,
    ReferenceRaised,
    assert_close,
    assert_equal_state,
    ssm_state_tolerance,
    tolerance,
)
from attn_core.testing.workloads import (
    Step,
    Workload,
    conv_params,
    layer_inputs,
    scale_inputs,
    to_device,
)

__all__ = ["Limits", "Pair", "Side", "fp8_kv_scales"]


class Limits:
    """Sizes of the run: batch / token limits, pages and slots (with room for prefix copies)."""

    def __init__(
        self,
        workload: Workload | None = None,
        *,
        max_batch: int = 8,
        max_tokens: int = 64,
        max_len: int = 64,
        num_requests: int = 8,
        spec_tokens: int = 0,
    ) -> None:
        if workload is not None:
            max_batch = max(max_batch, workload.max_batch)
            max_tokens = max(max_tokens, workload.max_tokens)
            max_len = max(max_len, workload.max_len)
            num_requests = max(num_requests, workload.num_requests)
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_len = max_len + 2 * (spec_tokens + 1) + 2
        self.num_requests = num_requests
        self.spec_tokens = spec_tokens


class Side:
    """One backend run through the core.

    :param role: ``"backend"`` (errors become :class:`BackendRaised`) or ``"reference"``
        (errors become :class:`ReferenceRaised`).
    """

    def __init__(
        self,
        role: str,
        backend: Backend,
        registry: Registry,
        spec: LayerSpec,
        *,
        num_layers: int,
        limits: Limits,
        device: torch.device,
        device_caps: DeviceCapabilities,
        graph_mode: GraphMode = GraphMode.NONE,
        strategy: str | None = None,
        layer_params: dict[int, dict[str, Any]] | None = None,
        kv_scales: tuple[float, float] | None = None,
        fill: Backend | None = None,
    ) -> None:
        """:param fill: serves the phases ``backend`` does not declare (``capabilities.phases``;
        the kit passes the reference), so that a phase-limited backend is tested on the steps
        of its own phases only, as a plan would run it."""
        self.role = role
        self.spec = spec
        self.device = device
        self.num_layers = num_layers
        groups = group_layers([spec] * num_layers)
        self.group = groups[0]
        ps = spec.page_size
        pages_per_req = math.ceil(limits.max_len / ps) + 1 if spec.has_kv_cache else 0
        self.constraints = ExecutionConstraints(
            graph_mode=graph_mode,
            max_batch_size=limits.max_batch,
            max_num_tokens=limits.max_tokens,
            max_model_len=limits.max_len,
            speculative_tokens=limits.spec_tokens,
            spec_verify_strategy=strategy if limits.spec_tokens else None,
            page_size=ps if spec.has_kv_cache else None,
        )
        phases: tuple[PhaseChoice, ...] = ()
        if fill is not None and backend.capabilities.phases != frozenset(Phase):
            phases = tuple(
                PhaseChoice(p, backend if backend.serves_phase(p) else fill, (), ()) for p in Phase
            )
        first = phases[0].backend if phases else backend
        plan = Plan(
            device_caps,
            self.constraints,
            (GroupChoice(self.group, first, (), (), phases=phases),),
            ps if spec.has_kv_cache else None,
            "NHD" if spec.has_kv_cache else None,
        )
        self.state = None
        if spec.kind is not LayerKind.ENCODER:
            self.state = PersistentState(
                groups,
                num_pages=(limits.num_requests + 2) * pages_per_req * 2 + 4,
                num_slots=limits.num_requests * 2 + 4,
                device=device,
            )
            if kv_scales is not None and spec.has_kv_cache:
                for i in range(num_layers):
                    k, v = kv_scales
                    if spec.kind is LayerKind.MLA:
                        self.state.kv_cache.set_scale(i, k=k)
                    else:
                        self.state.kv_cache.set_scale(i, k=k, v=v)
        self.builder = BatchBuilder(
            self.state,
            max_batch_size=limits.max_batch,
            max_num_tokens=limits.max_tokens,
            max_pages_per_request=pages_per_req,
            device=device,
        )
        with self.guard("allocate (workspace_requirements / allocate_context / bind_forward)"):
            self.runtime = AttentionRuntime(
                plan, registry, state=self.state, device=device, layer_params=layer_params
            )
        self.batch: AttentionBatch | None = None

    # -- errors -------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self, stage: str) -> Iterator[None]:
        try:
            yield
        except (BackendRaised, ReferenceRaised):
            raise
        except Exception as exc:
            if self.role == "reference":
                raise ReferenceRaised(stage, exc) from exc
            raise BackendRaised(stage, exc) from exc

    # -- steps ----------------------------------------------------------------------------
    def build(self, step: Step) -> AttentionBatch:
        if self.state is None:  # an encoder layer: no persistent state
            return self.builder.build_encoder([n for _, n in step.requests])
        for r in step.add:
            self.state.add_request(r)
            if self.state.has_state:
                # What a slot's previous owner leaves where an engine recycles slots without
                # zeroing them (the core zeroes them): a fresh request (has_initial_state False)
                # must start from zero, never read it.
                slot = self.state.slot(r)
                for la in self.state.state_slots.layers():
                    la.conv[slot].fill_(STALE_STATE)
                    la.ssm[slot].fill_(STALE_STATE)
        return self.builder.build(
            step.requests,
            spec_tokens=step.spec_tokens,
            pad_to=step.pad_to,
            pad_tokens_to=step.pad_tokens_to,
        )

    def begin(self, step: Step, *, update_only: bool = False) -> AttentionBatch:
        """Build the step's batch and ``prepare`` it (or only ``update``, as before a replay)."""
        batch = self.build(step)
        with self.guard("update" if update_only else "prepare"):
            if update_only:
                self.runtime.update(batch)
            else:
                self.runtime.prepare(batch)
        self.batch = batch
        return batch

    def poisoned_out(self, rows: int) -> torch.Tensor:
        s = self.spec
        return torch.full(
            (rows, s.num_heads, s.head_dim_v),
            NAN_POISON,
            dtype=torch_dtype(s.dtype),
            device=self.device,
        )

    def forward(
        self,
        layer: int,
        inputs: dict[str, torch.Tensor],
        out: torch.Tensor | None,
        *,
        conv: tuple[torch.Tensor, torch.Tensor | None] | None = None,  # (weight, bias)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one layer (conv first for linear layers); returns (output, conv output)."""
        binding = self.runtime.binding(layer)
        extra = {n: t for n, t in inputs.items() if n not in ("q", "k", "v", "conv_x")}
        conv_out = None
        if self.spec.linear_variant is LinearVariant.SHORT_CONV:
            # The gated short conv's core is its conv (no activation; the gates are model side):
            # the conv output is the layer's output, written into out's one 'head'.
            if conv is None:
                raise ValueError(f"layer {layer}: a short-conv layer needs its conv weights")
            with self.guard(f"layer {layer} conv1d"):
                flat = binding.conv1d(
                    inputs["conv_x"],
                    conv[0],
                    conv[1],
                    activation=None,
                    out=None if out is None else out[:, 0],
                )
            return (flat[:, None] if out is None else out), None
        with self.guard(f"layer {layer} forward"):
            if "conv_x" in inputs and conv is not None:
                conv_out = binding.conv1d(inputs["conv_x"], conv[0], conv[1], activation="silu")
            result = binding.forward(inputs["q"], inputs["k"], inputs.get("v"), out=out, **extra)
        return result, conv_out

    def finish(self, step: Step, batch: AttentionBatch, accepted: torch.Tensor | None) -> None:
        """After the step: commit speculative tokens, advance the requests, release."""
        if self.state is None:
            return
        if step.spec_tokens:
            if accepted is None:
                raise ValueError("a verify step needs the accepted token counts to commit")
            with self.guard("commit_speculative"):
                self.runtime.commit_speculative(batch, accepted.to(self.device))
            for (r, _), a in zip(step.requests, accepted.tolist(), strict=True):
                self.state.advance(r, int(a))
        else:
            for r, n in step.requests:
                self.state.advance(r, n)
        for r in step.release:
            self.state.release(r)
            invalidate = getattr(self.builder, "invalidate", None)  # older builders cache rows
            if invalidate is not None:
                invalidate(r)


#: what :meth:`Side.build` fills a fresh request's linear-state slot with: finite (a backend
#: may zero a fresh state by multiplying), far from any state a step computes
STALE_STATE = 1000.0


def fp8_kv_scales(gen: torch.Generator) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of an fp8 KV cache: far from 1 (a backend that ignores them reads
    values 10-50x off) and one 2-4x the other, in a random order (a backend that reads them
    swapped is off by that much; drawn independently, they could come within 1 %)."""
    low = 0.02 + 0.03 * torch.rand((), generator=gen).item()
    high = low * (2.0 + 2.0 * torch.rand((), generator=gen).item())
    swap = bool(torch.rand((), generator=gen).item() < 0.5)
    return (high, low) if swap else (low, high)


class Pair:
    """The backend under test and the reference, built alike and fed alike.

    :param magnitude: the inputs :meth:`step` draws are scaled by
        :func:`~attn_core.testing.workloads.scale_inputs`; outputs and states then are
        ``magnitude`` times larger, and so are the absolute tolerances they are compared with.
    """

    def __init__(
        self,
        session: Any,
        spec: LayerSpec,
        gen: torch.Generator,
        *,
        magnitude: float = 1.0,
        layer_scales: bool = False,
        **kwargs: Any,
    ):
        self.spec = spec
        self.gen = gen
        self.magnitude = magnitude
        self.device = session.device
        num_layers = kwargs.get("num_layers", 1)
        params: dict[int, dict[str, Any]] = {i: {} for i in range(num_layers)}
        if spec.has_sinks:
            for p in params.values():
                p["sinks"] = torch.randn(spec.num_heads, generator=gen).to(self.device)
        if layer_scales:  # the first layer keeps the spec's scale, the others have their own
            for i in range(1, num_layers):
                params[i]["scale"] = spec.scale * (0.4 + 0.3 * torch.rand((), generator=gen).item())
        layer_params = {i: p for i, p in params.items() if p} or None
        kv_scales = fp8_kv_scales(gen) if spec.kv_dtype == "fp8_e4m3" else None
        common = dict(
            device=session.device,
            device_caps=session.device_caps,
            layer_params=layer_params,
            kv_scales=kv_scales,
            **kwargs,
        )
        # The reference first: if it cannot run the configuration the item is skipped.
        self.ref = Side("reference", session.reference, session.registry, spec, **common)
        self.test = Side(
            "backend", session.backend, session.registry, spec, fill=session.reference, **common
        )
        # the second layer's conv has no bias (Qwen3-Next's has none): its activation still
        # applies
        self.conv: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
        for i in range(num_layers):
            if not spec.has_conv:
                self.conv.append(None)
                continue
            weight, bias = (
                t.to(self.device, torch_dtype(spec.dtype)) for t in conv_params(spec, gen)
            )
            self.conv.append((weight, bias if i == 0 else None))
        self.atol, self.rtol = tolerance(spec)
        self.atol *= magnitude

    @property
    def sides(self) -> tuple[Side, Side]:
        return (self.ref, self.test)

    # -- comparisons ---------------------------------------------------------------------
    def compare_out(
        self, got: torch.Tensor, want: torch.Tensor, rows: int, what: str, where: str
    ) -> None:
        assert_close(
            got[:rows], want[:rows], atol=self.atol, rtol=self.rtol, what=what, where=where
        )

    def compare_state(self, where: str) -> None:
        """Whole caches / slot pools: the backend's must equal the reference's."""
        a, b = self.test.state, self.ref.state
        if a is None or b is None:  # encoder layers keep no state
            return
        fp8 = self.spec.kv_dtype == "fp8_e4m3"
        for i in a.kv_cache.layer_indices:
            ta, tb = a.kv_cache.layer(i).tensors(), b.kv_cache.layer(i).tensors()
            for name in ta:
                tol = {"atol": 2.0**-6, "rtol": 0.13} if fp8 else {}
                assert_equal_state(
                    ta[name],
                    tb[name],
                    what=f"layer {i} paged KV cache {name!r} [page, offset, ...]",
                    where=where,
                    **tol,
                )
        for i, la, lb in self._linear_layers():
            assert_equal_state(
                la.conv,
                lb.conv,
                what=f"layer {i} conv state [slot, ...]",
                where=where,
                atol=self.atol,
                rtol=self.rtol,
            )
            atol, rtol = ssm_state_tolerance(self.spec, la.ssm.dtype)
            atol *= self.magnitude
            assert_equal_state(
                la.ssm,
                lb.ssm,
                what=f"layer {i} SSM state [slot, ...]",
                where=where,
                atol=atol,
                rtol=rtol,
            )
            if la.ssm.dtype in (torch.bfloat16, torch.float16):
                # Each side rounds its own float32 state into the 16-bit pool, and a few
                # entries land one ulp apart across a rounding boundary. A later output reads
                # them times C: one ulp of a state entry of 2.6 is 0.0156, beyond the output
                # tolerance of a result near 0 whatever the backend. Where the two are at most
                # an ulp apart the reference continues from the backend's value; a larger
                # difference stays, so that a drift of a few ulps a step still adds up.
                ga, gb = la.ssm.float(), lb.ssm.float()
                ulp = torch.finfo(la.ssm.dtype).eps * torch.maximum(ga.abs(), gb.abs())
                lb.ssm.copy_(torch.where((ga - gb).abs() <= ulp, la.ssm, lb.ssm))

    def _linear_layers(self) -> Iterator[tuple[int, LinearStateLayer, LinearStateLayer]]:
        """``(layer, the backend's state slots of it, the reference's)`` of a linear spec."""
        a, b = self.test.state, self.ref.state
        if a is None or b is None or self.spec.kind is not LayerKind.LINEAR:
            return
        for i in range(self.test.num_layers):
            yield i, a.state_slots.layer(i), b.state_slots.layer(i)

    def continue_reference_from_backend(self) -> None:
        """Copy the backend's SSM pools into the reference's: the next step starts both sides
        from the same state (linear layers)."""
        for _, la, lb in self._linear_layers():
            lb.ssm.copy_(la.ssm)

    def compare_ssm_precision(self, where: str) -> None:
        """The backend's float32 SSM pools within :data:`FP32_STATE_RTOL` of the reference's."""
        for i, la, lb in self._linear_layers():
            got, want = la.ssm, lb.ssm
            for slot in range(want.shape[0]):  # the floor per slot: unused ones hold 1000.0
                scale = float(want[slot].float().abs().mean())
                assert_close(
                    got[slot],
                    want[slot],
                    atol=FP32_STATE_RTOL * scale,
                    rtol=FP32_STATE_RTOL,
                    what=f"layer {i} float32 SSM state of slot {slot} (2^-11 relative; a "
                    f"bfloat16 rounding is 2^-9)",
                    where=where,
                )

    # -- one step --------------------------------------------------------------------------
    def step(
        self,
        step: Step,
        where: str,
        *,
        inputs: list[dict[str, torch.Tensor]] | None = None,
        update_only: bool = False,
        outs: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """Run one step on both sides, compare outputs and state; returns the backend's outputs.

        :param inputs: per layer, CPU float32 inputs with ``padded_tokens`` rows (default: fresh
            random ones).
        :param update_only: the backend side only calls ``update`` (emulated graph replay).
        :param outs: per layer, the ``out`` the backend side gets (default: NaN-poisoned).
        """
        rb = self.ref.begin(step)
        tb = self.test.begin(step, update_only=update_only)
        rows = rb.num_tokens
        results = []
        for layer in range(self.test.num_layers):
            if inputs:
                raw = inputs[layer]
            else:
                raw = layer_inputs(self.spec, rb.padded_tokens, self.gen)
                raw = scale_inputs(raw, self.spec, self.magnitude)
            dev = to_device(raw, self.spec, self.device)
            want, want_conv = self.ref.forward(
                layer, dev, self.ref.poisoned_out(rb.padded_tokens), conv=self.conv[layer]
            )
            out = outs[layer] if outs is not None else self.test.poisoned_out(tb.padded_tokens)
            at = f"{where}, layer {layer}, batch mode {rb.mode.value}"
            try:
                got, got_conv = self.test.forward(layer, dev, out, conv=self.conv[layer])
            except BackendRaised as exc:  # the report names the step that raised
                raise BackendRaised(f"{exc.stage} ({at})", exc.cause) from exc.cause
            if got_conv is not None and want_conv is not None:
                self.compare_out(got_conv, want_conv, rows, "conv1d output", at)
            self.compare_out(got, want, rows, "attention output", at)
            results.append(got)
        if not step.spec_tokens:
            # A verify step's state is pending until commit_speculative: a backend may write the
            # drafts' states in place, keep them aside (native) or recompute them (replay), so
            # only the committed state is compared.
            self.compare_state(f"{where}, after the step")
        accepted = None
        if step.spec_tokens:
            accepted = torch.randint(
                1, step.spec_tokens + 2, (rb.num_reqs,), generator=self.gen, dtype=torch.int32
            )
        self.ref.finish(step, rb, accepted)
        self.test.finish(step, tb, accepted)
        if accepted is not None:  # a verify step
            self.compare_state(f"{where}, after commit_speculative({accepted.tolist()})")
        return results

    def run(self, workload: Workload, where: str) -> None:
        for i, step in enumerate(workload.steps):
            self.step(step, f"{where}, step {i} {_describe(step)}")


def _describe(step: Step) -> str:
    lens = ",".join(str(n) for _, n in step.requests)
    text = f"[new tokens {lens}]"
    if step.spec_tokens:
        text += f" verify k={step.spec_tokens}"
    if step.pad_to:
        text += f" padded to {step.pad_to}"
    return text


def is_decode(batch: AttentionBatch) -> bool:
    return batch.mode is BatchMode.DECODE
