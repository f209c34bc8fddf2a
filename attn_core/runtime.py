"""AttentionRuntime: from a plan to allocated contexts and one binding per layer.

This is the cold path a server runs once at start-up::

    registry = Registry.discover()
    layout = specs_from_hf_config("qwen3-next")
    plan = select(layout.groups, registry, DeviceCapabilities.detect(), constraints)
    state = PersistentState.from_plan(plan, num_pages=..., num_slots=...)
    runtime = AttentionRuntime(plan, registry, state=state, device=device)

and the hot path it runs per step::

    batch = builder.build(requests)
    runtime.prepare(batch)                 # once per step: every group plans
    out = runtime.binding(i).forward(q, k, v, out=out, **inputs)   # per layer

A plan may choose a different backend per phase of a group (prefill / mixed, decode, verify):
the runtime allocates one context per distinct backend of a group, all over the group's one
persistent state, and ``prepare`` / ``update`` switch each group to the backend of the batch's
phase (``AttentionBatch.phase``) before its context plans the step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from attn_core.batch import BatchMode
from attn_core.binding import GroupRuntime, LayerAttentionBinding
from attn_core.errors import BackendInputError, PluginError
from attn_core.local_attention import LocalVirtualBatcher
from attn_core.selector import constraints_for_phases, step_size
from attn_core.specs import ExecutionConstraints, GraphMode, LayerKind, Phase, layer_ops
from attn_core.workspace import Workspace

if TYPE_CHECKING:
    from attn_core.batch import AttentionBatch
    from attn_core.registry import Registry
    from attn_core.selector import Plan

__all__ = ["AttentionRuntime"]


class AttentionRuntime:
    """Contexts for every group of a plan and a :class:`LayerAttentionBinding` per layer (per
    op of a layer that holds two: a parallel hybrid's attention and linear ops).

    :param plan: the selector's plan.
    :param registry: the registry the plan's backends come from.
    :param state: the core's persistent state (None when the model has only encoder layers).
    :param device: the torch device to run on.
    :param layer_params: per layer index, optional ``scale`` and ``sinks`` overrides.
    """

    def __init__(
        self,
        plan: Plan,
        registry: Registry,
        *,
        state: Any = None,
        device: torch.device | str = "cpu",
        layer_params: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        _refuse_unloadable(plan)
        _refuse_shared_layers(plan)
        if state is not None:
            problems = state.plan_differences(plan)
            if problems:
                raise ValueError(
                    "the persistent state does not match the plan: "
                    + "; ".join(problems)
                    + " (build it with PersistentState.from_plan(plan, ...))"
                )
        elif any(c.group.spec.kind is not LayerKind.ENCODER for c in plan.choices):
            raise ValueError(
                "the plan has layers that keep persistent state (KV pages, conv / SSM slots) "
                "but no state was given: pass state=PersistentState.from_plan(plan, ...)"
            )
        check_finite = _finite_check_source(plan)
        self.plan = plan
        self.registry = registry
        self.state = state
        self.device = torch.device(device)
        self.groups: dict[str, GroupRuntime] = {}
        #: each group's layer indices (a verify step commits once every one of them ran)
        self._group_layers: dict[str, tuple[int, ...]] = {}
        self.workspaces: dict[str, Workspace] = {}
        #: the verify batch prepared last, until commit_speculative: its per-token states live
        #: in the linear groups' contexts until the commit, so no other step may be prepared
        self._uncommitted: AttentionBatch | None = None
        #: the binding of each layer that holds one op (most layers)
        self.bindings: dict[int, LayerAttentionBinding] = {}
        #: every binding of each layer, by op kind: a parallel hybrid's layer (Falcon-H1) has
        #: an attention op and a linear op, each bound to its own group
        self.layer_bindings: dict[int, dict[LayerKind, LayerAttentionBinding]] = {}
        #: per chunked group (``attention_chunk_size`` set): its local virtual batches, given to
        #: the backends that declare ``chunked_virtual_batches`` (and no native chunk mask)
        self.local_batchers: dict[str, LocalVirtualBatcher] = {}
        layer_params = layer_params or {}
        #: per (group id, backend qualified name): the workspace of that backend's context
        self.backend_workspaces: dict[tuple[str, str], Workspace] = {}
        for choice in plan.choices:
            group = choice.group
            group_state = state if group.spec.kind.value != "encoder" else None
            targets: dict[str, tuple[Any, Any, Any]] = {}
            for backend in choice.backends:  # the prefill backend first
                # a backend is allocated for the demands of the phases it serves (no graph mode
                # for one that serves only eager prefill steps, no draft tokens for one that
                # verifies none), as the selector admitted it
                served = choice.phases_served_by(backend.qualified_name)
                cons = constraints_for_phases(plan.constraints, served)
                common: dict[str, Any] = dict(
                    backend=backend,
                    group=group,
                    device=plan.device,
                    constraints=cons,
                )
                reqs = registry.call_owner("attn_core_workspace_requirements", **common) or ()
                try:
                    workspace = Workspace(reqs, self.device)
                except (TypeError, ValueError) as exc:
                    raise PluginError(backend.plugin, backend.name, "workspace", exc) from exc
                ctx = registry.call_owner(
                    "attn_core_allocate_context",
                    **common,
                    state=group_state,
                    workspace=workspace,
                )
                if ctx is None:
                    raise PluginError(
                        backend.plugin,
                        backend.name,
                        "attn_core_allocate_context",
                        RuntimeError(f"returned no context for group {group.group_id!r}"),
                    )
                fwd = registry.call_owner("attn_core_bind_forward", backend=backend, context=ctx)
                _check_context(ctx, fwd, group, backend, cons)
                targets[backend.qualified_name] = (backend, ctx, fwd or ctx.forward)
                self.backend_workspaces[(group.group_id, backend.qualified_name)] = workspace
            backend, ctx, fwd = targets[choice.backend.qualified_name]
            runtime = GroupRuntime(
                group.group_id,
                group.spec,
                backend,
                ctx,
                fwd,
                state=group_state,
                device=self.device,
                check_finite=check_finite,
            )
            if len(targets) > 1:
                runtime.phase_targets = {
                    phase: targets[choice.backend_for_phase(phase).qualified_name]
                    for phase in Phase
                }
                for pc in choice.phases:
                    if pc.by_step_size:
                        runtime.phase_buckets[pc.phase] = tuple(
                            (bound, targets[b.qualified_name]) for bound, b in pc.by_step_size
                        )
                    if pc.by_requests:
                        runtime.request_rules = tuple(
                            (above, at_most, r, targets[b.qualified_name])
                            for above, at_most, r, b in pc.by_requests
                        )
            self.workspaces[group.group_id] = self.backend_workspaces[
                (group.group_id, choice.backend.qualified_name)
            ]
            self.groups[group.group_id] = runtime
            if group.spec.attention_chunk_size is not None and any(
                b.capabilities.chunked_virtual_batches and not b.capabilities.chunked_attention
                for b in choice.backends
            ):
                chunk = group.spec.attention_chunk_size
                if plan.page_size is not None and chunk % plan.page_size:
                    raise ValueError(
                        f"layer group {group.group_id!r}: local virtual batches need "
                        f"attention_chunk_size ({chunk}) to be a multiple of the page size, "
                        f"got page size {plan.page_size} (plan with a page size dividing {chunk})"
                    )
                self.local_batchers[group.group_id] = LocalVirtualBatcher(chunk)
            self._group_layers[group.group_id] = tuple(group.layer_indices)
            for index in group.layer_indices:
                params = layer_params.get(index, {})
                if group.spec.kind is LayerKind.LINEAR:
                    # scale and sinks are attention parameters: a parallel layer's linear op
                    # takes none of them
                    params = {}
                self.layer_bindings.setdefault(index, {})[group.spec.kind] = LayerAttentionBinding(
                    index,
                    runtime,
                    scale=params.get("scale"),
                    sinks=params.get("sinks"),
                    kv=_kv_view(state, index) if group.spec.has_kv_cache else None,
                    linear_state=_state_view(state, index)
                    if group.spec.has_recurrent_state
                    else None,
                )
        for index, ops in self.layer_bindings.items():
            if len(ops) == 1:
                self.bindings[index] = next(iter(ops.values()))

    def binding(self, layer_index: int, kind: LayerKind | None = None) -> LayerAttentionBinding:
        """The binding of layer ``layer_index``.

        :param kind: the op's kind; needed for a layer with parallel ops (an attention op and
            a linear op), optional otherwise (then it must match the layer's op).
        :raises KeyError: the layer has no binding, or none of ``kind``, or parallel ops and
            no ``kind``.
        """
        ops = self.layer_bindings.get(layer_index)
        if ops is None:
            raise KeyError(
                f"layer {layer_index} has no attention binding; bound layers: "
                f"{sorted(self.layer_bindings)}"
            )
        if kind is None:
            if len(ops) > 1:
                raise KeyError(
                    f"layer {layer_index} holds parallel ops "
                    f"({', '.join(f'{k.value} in group {b.group_id!r}' for k, b in ops.items())}); "
                    "pass kind= to pick one"
                )
            return next(iter(ops.values()))
        try:
            return ops[kind]
        except KeyError:
            raise KeyError(
                f"layer {layer_index} has no {kind.value} op; its ops: "
                f"{', '.join(k.value for k in ops)}"
            ) from None

    def prepare(self, batch: AttentionBatch) -> None:
        """Plan ``batch`` in every group (once per step, before the first layer runs), each by
        the backend the plan chose for the batch's phase.

        :raises BackendInputError: a verify step of a model with linear layers was prepared
            and not committed (``commit_speculative``): preparing another step would drop its
            per-token states, leaving the slots with every draft or none accepted.
        """
        self._refuse_uncommitted(batch, "prepare")
        self._refuse_undeclared_drafts(batch, "prepare")
        phase, size = batch.phase, step_size(batch.phase, batch.padded_reqs, batch.padded_tokens)
        for g in self.groups.values():
            g.use_phase(phase, size, batch.padded_reqs)
            view = self._view(g, batch)  # the core's own step: its errors are not the plugin's
            try:
                g.context.prepare(view)
            except BackendInputError:
                raise
            except Exception as exc:
                raise g.plugin_error("prepare", exc, None) from exc
            g.batch = batch
            if g.records_ops:
                g.ran.clear()
        self._note_verify(batch)

    def update(self, batch: AttentionBatch) -> None:
        """Copy ``batch``'s metadata in place into every group's captured buffers (those of the
        backend of the batch's phase, the one its graph was captured with)."""
        self._refuse_uncommitted(batch, "update")
        self._refuse_undeclared_drafts(batch, "update")
        phase, size = batch.phase, step_size(batch.phase, batch.padded_reqs, batch.padded_tokens)
        for g in self.groups.values():
            g.use_phase(phase, size, batch.padded_reqs)
            update = getattr(g.context, "update", None)
            if update is None:
                raise g.plugin_error(
                    "update",
                    AttributeError(
                        f"{type(g.context).__name__} has no update(batch): the backend cannot "
                        "replay a captured graph"
                    ),
                    None,
                )
            view = self._view(g, batch)
            try:
                update(view)
            except BackendInputError:
                raise
            except Exception as exc:
                raise g.plugin_error("update", exc, None) from exc
            g.batch = batch
            if g.records_ops:  # a graph replay runs every captured layer, no forward in Python
                op = g.last_op()
                g.ran = {(i, op) for i in self._group_layers[g.group_id]}
        self._note_verify(batch)

    def _refuse_undeclared_drafts(self, batch: AttentionBatch, call: str) -> None:
        """A verify step of more drafts than the plan's ``speculative_tokens``: the backends
        were chosen (and verify workspaces sized) for that many."""
        declared = self.plan.constraints.speculative_tokens
        if batch.spec_tokens > declared and self.groups:
            g = next(iter(self.groups.values()))
            raise BackendInputError(
                group=g.group_id,
                backend=g.backend.qualified_name,
                what=f"{call}: a verify step of more draft tokens than the plan was made for "
                "(plan with ExecutionConstraints(speculative_tokens=k))",
                expected=f"at most {declared} draft tokens (the plan's speculative_tokens)",
                got=f"{batch.spec_tokens} draft tokens",
            )

    def _committing(self) -> list[tuple[GroupRuntime, Any]]:
        """``(group, its context's commit_speculative)`` for every group that commits verify
        steps (linear groups); none in a model of attention layers only."""
        return [
            (g, commit)
            for g in self.groups.values()
            if (commit := getattr(g.context, "commit_speculative", None)) is not None
        ]

    def _note_verify(self, batch: AttentionBatch) -> None:
        """Remember a verify batch that some group must commit."""
        if batch.mode is BatchMode.VERIFY and self._committing():
            self._uncommitted = batch

    def _refuse_uncommitted(self, batch: AttentionBatch, call: str) -> None:
        pending = self._uncommitted
        if pending is None or pending is batch:
            return
        if self.state is not None and pending.state_epoch != self.state.epoch:
            # stale: requests were released, offloaded or restored since (the remedy for a step
            # that failed part-way), so no commit can take it any more
            self._uncommitted = None
            return
        g = self._committing()[0][0]
        raise BackendInputError(
            group=g.group_id,
            backend=g.backend.qualified_name,
            what=f"{call}: the verify step before it is not committed",
            expected=(
                f"commit_speculative(batch, num_accepted) of the verify batch (step "
                f"{pending.step}, {pending.num_reqs} requests) first: its per-token states "
                "would be dropped"
            ),
            got=f"a batch of step {batch.step}, {batch.num_reqs} requests",
        )

    def _view(self, g: GroupRuntime, batch: AttentionBatch) -> AttentionBatch:
        """The batch ``g``'s current backend plans: the step itself, or for a chunked group
        served through local virtual batches, the step's virtual batch (same tokens and slot
        mapping, requests cut at chunk boundaries). The group keeps the real batch."""
        batcher = self.local_batchers.get(g.group_id)
        if batcher is None:
            return batch
        caps = g.backend.capabilities
        if caps.chunked_attention or not caps.chunked_virtual_batches:
            return batch  # a native chunk mask (the reference) reads the real batch
        return batcher(batch)

    def commit_speculative(self, batch: AttentionBatch, num_accepted: torch.Tensor) -> None:
        """After a verify step: keep the state of the accepted prefix in every linear group.

        :param batch: the verify batch that ran, the one the runtime last prepared (its
            per-token states are dropped when the next batch is prepared).
        :param num_accepted: ``[num_reqs]`` (or longer: the rest is ignored) int32 / int64,
            tokens accepted per request (1..k+1).

        Refused before any group commits: another batch than the one prepared (the same
        requests in another order would swap their states), and a ``num_accepted`` that is
        not one integer per request (a shorter one would broadcast one request's count).
        """
        commits = self._committing()
        for g, _ in commits:
            g.check_fresh(batch, "commit_speculative")
            if g.batch is not batch:
                prepared = g.batch
                raise BackendInputError(
                    group=g.group_id,
                    backend=g.backend.qualified_name,
                    what="commit_speculative: not the batch the runtime last prepared (commit "
                    "the verify batch that ran, before preparing the next step)",
                    expected="the prepared verify batch"
                    + (
                        f" (step {prepared.step}, {prepared.num_reqs} requests)" if prepared else ""
                    ),
                    got=f"a batch of step {batch.step}, {batch.num_reqs} requests",
                )
        if commits and not (
            isinstance(num_accepted, torch.Tensor)
            and num_accepted.dim() == 1
            and num_accepted.shape[0] >= batch.num_reqs
            and num_accepted.dtype in (torch.int32, torch.int64)
        ):
            g = commits[0][0]
            got = (
                f"{list(num_accepted.shape)} {str(num_accepted.dtype).removeprefix('torch.')}"
                if isinstance(num_accepted, torch.Tensor)
                else type(num_accepted).__name__
            )
            raise BackendInputError(
                group=g.group_id,
                backend=g.backend.qualified_name,
                what="commit_speculative: num_accepted, one count per request",
                expected=f"[>= {batch.num_reqs}] int32 or int64",
                got=got,
            )
        for g, _ in commits:
            op = g.last_op()
            layers = self._group_layers[g.group_id]
            missing = [i for i in layers if (i, op) not in g.ran]
            if missing:
                raise BackendInputError(
                    group=g.group_id,
                    backend=g.backend.qualified_name,
                    what=f"commit_speculative: layer {missing[0]} did not run this verify step "
                    f"(its {op} was refused or not called; committing would move the other "
                    "layers' slots and not its own: run the step again, its slots have not "
                    "moved, then commit)",
                    expected=f"{op} of layers {list(layers)}",
                    got=f"{op} of layers {sorted(i for i, o in g.ran if o == op)}",
                )
        for g, commit in commits:
            try:
                commit(batch, num_accepted)
            except BackendInputError:
                raise
            except Exception as exc:
                raise g.plugin_error("commit", exc, None) from exc
        self._uncommitted = None


#: Turns the finite check on for every runtime built while it is set (see check_finite).
ENV_CHECK_FINITE = "ATTN_CORE_CHECK_FINITE"


def _refuse_shared_layers(plan: Plan) -> None:
    """One op of each role per layer index (:func:`attn_core.specs.layer_ops`: a parallel
    hybrid's layer holds an attention op and a linear op). A multi-stack layout's stacks (a
    vision tower and a language model) each number their layers from 0, so one runtime serves
    one stack: two stacks in one plan give a layer two attention ops, refused here."""
    try:
        layer_ops(c.group for c in plan.choices)
    except ValueError as err:
        raise ValueError(
            f"{err}; a runtime binds each layer's ops once: plan one stack at a time "
            "(select(layout.stack_layout(name).groups, ...))"
        ) from None


def _finite_check_source(plan: Plan) -> str | None:
    """What asked for the NaN / inf check (named in its error), or None when it is off."""
    if plan.constraints.check_finite:
        return "ExecutionConstraints(check_finite=True)"
    value = os.environ.get(ENV_CHECK_FINITE, "").strip()
    if value.lower() in ("1", "true", "yes", "on"):
        return f"{ENV_CHECK_FINITE}={value}"
    if value and value.lower() not in ("0", "false", "no", "off"):
        raise ValueError(f"{ENV_CHECK_FINITE}={value!r}: expected 1 or 0 (true / false)")
    return None


def _refuse_unloadable(plan: Plan) -> None:
    """An offline plan (made for a target, not this machine) may choose a backend that cannot
    be loaded here; running it would fail at the first call, so it is refused up front."""
    for choice in plan.choices:
        for backend in choice.backends:
            if backend.available:
                continue
            made = (
                f"this is an offline plan for {plan.device.short()}, made for a target rather "
                "than this machine: it shows what that machine would choose"
                if not plan.local
                else f"the plan was made for {plan.device.short()}"
            )
            raise ValueError(
                f"layer group {choice.group.group_id!r}: the plan chooses "
                f"{backend.qualified_name}, "
                f"which is not loadable here: {backend.unavailable_reason}; {made}. To run here, "
                "plan for this machine: select(..., DeviceCapabilities.detect(), ...)"
            )


def _check_context(
    ctx: Any, bound: Any, group: Any, backend: Any, constraints: ExecutionConstraints
) -> None:
    """Refuse a context that lacks a method the runtime will call, when it is allocated
    rather than in the middle of a step."""
    needed = ["prepare"]
    if bound is None:
        needed.append("forward")
    if constraints.graph_mode is not GraphMode.NONE:
        needed.append("update")
    if group.spec.kind is LayerKind.LINEAR:
        needed.append("conv1d")
        if constraints.speculative_tokens:  # else the drafts' states stay in the slots
            needed.append("commit_speculative")
    missing = [m for m in needed if not callable(getattr(ctx, m, None))]
    if missing:
        raise PluginError(
            backend.plugin,
            backend.name,
            "attn_core_allocate_context",
            TypeError(
                f"the context {type(ctx).__name__} has no {', '.join(missing)}; a context needs "
                f"{', '.join(needed)} here (see attn_core.context.AttentionContext)"
            ),
            group=group.group_id,
        )


def _kv_view(state: Any, layer_index: int) -> Any:
    if state is None:
        return None
    return state.kv_cache.layer(layer_index)


def _state_view(state: Any, layer_index: int) -> Any:
    if state is None:
        return None
    return state.state_slots.layer(layer_index)
