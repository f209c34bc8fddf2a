"""The reference backend: pure PyTorch for every layer kind, on CPU and GPU.

It is the numerical ground truth of every test and registers through the same hooks as any
third-party plugin (entry point ``attn_core = reference``). Prefill and mixed steps run the ragged
reference ops of :mod:`attn_core.reference.ops`; pure decode steps run the fixed-shape functions of
:mod:`attn_core.reference.decode`, which never read lengths back to the host and so can be
captured in a CUDA graph (graph mode ``decode``).

Option ``decode_path`` (``--option reference.decode_path=ragged``): ``fixed`` (the default) runs
pure decode steps of full and MLA groups through the fixed-shape functions above; ``ragged`` runs
them through the ragged ops prefill uses, to tell a wrong result of one path from the other
(not capturable: refused with graph mode ``decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from attn_core.backend import Backend, BackendCapabilities
from attn_core.batch import AttentionBatch, BatchMode
from attn_core.errors import BackendInputError
from attn_core.hookspecs import hookimpl
from attn_core.options import OptionSpec
from attn_core.reference import decode as dec
from attn_core.reference import ops
from attn_core.specs import (
    LINEAR_LAYER_INPUTS,
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerGroup,
    LayerKind,
    LinearVariant,
)

if TYPE_CHECKING:
    from attn_core.binding import LayerAttentionBinding
    from attn_core.context import AttentionContext
    from attn_core.state.manager import PersistentState
    from attn_core.state.slots import LinearStateLayer
    from attn_core.workspace import Workspace

ATTN_CORE_API_VERSION = "1.1"
BACKEND_NAME = "reference"
MAX_SPECULATIVE_TOKENS = 8
OPTION_SCHEMA = {
    "decode_path": OptionSpec(
        str,
        "fixed",
        "pure decode steps of full / MLA groups: 'fixed' (fixed-shape, capturable) or 'ragged' "
        "(the prefill ops; a cross-check of the two paths, not capturable)",
        choices=("fixed", "ragged"),
    ),
}

CAPABILITIES = BackendCapabilities(
    kinds={"full", "mla", "linear", "encoder"},
    linear_variants={"gated_deltanet", "kda", "mamba2", "mamba1", "lightning", "short_conv"},
    device_types={"cpu", "cuda"},
    dtypes={"float32", "bfloat16", "float16"},
    kv_dtypes={"float32", "bfloat16", "float16", "fp8_e4m3"},
    state_dtypes={"float32", "bfloat16"},
    head_dims=None,
    page_sizes=None,
    kv_layouts={"NHD"},
    graph_modes={GraphMode.NONE, GraphMode.DECODE},
    max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
    causal=True,
    non_causal=True,
    sliding_window=True,
    chunked_attention=True,
    logits_soft_cap=True,
    sinks=True,
    distinct_value_head_dim=True,
    deterministic=True,
    spec_verify_strategies={"native"},
)


@hookimpl
def attn_core_register_backends(register: Callable[[Backend], None]) -> None:
    register(
        Backend(
            name=BACKEND_NAME,
            capabilities=CAPABILITIES,
            priority=0,  # unused for ranking: the selector ranks the reference last (the fallback)
            description="pure PyTorch reference for every layer kind (ground truth, slow)",
            option_schema=OPTION_SCHEMA,
        )
    )


@hookimpl
def attn_core_allocate_context(
    backend: Backend,
    group: LayerGroup,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
    state: PersistentState | None,
    workspace: Workspace,
) -> _Context:
    kind = group.spec.kind
    if backend.option("decode_path") == "ragged" and constraints.graph_mode is not GraphMode.NONE:
        raise ValueError(
            f"option decode_path='ragged' of backend {backend.qualified_name!r} reads lengths on "
            f"the host and cannot be captured; graph mode {constraints.graph_mode.value} needs "
            "decode_path='fixed'"
        )
    if kind is LayerKind.FULL:
        return FullContext(backend, group)
    if kind is LayerKind.MLA:
        return MLAContext(backend, group)
    if kind is LayerKind.ENCODER:
        return EncoderContext(backend, group)
    return LinearContext(backend, group, state)


class _Context:
    """Shared life cycle: prepare / update only record the batch (the metadata tensors live in
    the BatchBuilder's persistent buffers, so a captured graph already reads the new values)."""

    def __init__(self, backend: Backend, group: LayerGroup) -> None:
        self.backend = backend
        self.group = group
        self.spec = group.spec
        self.batch: AttentionBatch | None = None
        #: pure decode steps through the fixed-shape functions (option decode_path, default)
        self.fixed_decode = backend.option("decode_path", "fixed") != "ragged"

    def prepare(self, batch: AttentionBatch) -> None:
        self.batch = batch

    def update(self, batch: AttentionBatch) -> None:
        self.batch = batch

    def _bad(self, what: str, expected: object, got: object) -> NoReturn:
        raise BackendInputError(
            group=self.group.group_id,
            backend=self.backend.qualified_name,
            what=what,
            expected=expected,
            got=got,
        )

    def _batch(self) -> AttentionBatch:
        """The prepared batch (the core prepares one before any forward)."""
        batch = self.batch
        if batch is None:
            raise RuntimeError(f"group {self.group.group_id!r}: forward before prepare(batch)")
        return batch

    def _paged(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_table, slot_mapping)`` of a batch over paged KV."""
        page_table, slot_mapping = batch.page_table, batch.slot_mapping
        if page_table is None or slot_mapping is None:
            self._bad("batch page table and slot mapping", "a batch over paged KV", None)
        return page_table, slot_mapping

    def _slots(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(state_indices, has_initial_state)`` of a batch over linear-state slots."""
        indices, initial = batch.state_indices, batch.has_initial_state
        if indices is None or initial is None:
            self._bad("batch state indices", "a batch over linear-state slots", None)
        return indices, initial

    def _finish(self, result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``result`` (the real tokens' rows, or every padded row) into ``out``, or as a new
        ``[padded_tokens, ...]`` tensor when ``out`` is None: the binding's contract holds for
        a padded step too (its padding rows are zeros here; they are garbage by contract)."""
        rows = result.shape[0]
        if out is not None:
            out[:rows].copy_(result)
            return out
        padded = self._batch().padded_tokens
        if rows == padded:
            return result
        full = result.new_zeros((padded, *result.shape[1:]))
        full[:rows].copy_(result)
        return full


class FullContext(_Context):
    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the binding passes k and v for this kind
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        # A cache of any dtype it declares serves any compute dtype (mixed_kv_dtypes): writes
        # round K/V to the cache's dtype, reads dequantise to float32 for the math.
        kv = layer.kv
        page_table, slot_mapping = self._paged(batch)
        ops.write_paged_kv(k, v, kv.k, kv.v, slot_mapping, k_scale=kv.k_scale, v_scale=kv.v_scale)
        common = dict(
            scale=layer.scale,
            sliding_window=spec.sliding_window,
            attention_chunk_size=spec.attention_chunk_size,
            logits_soft_cap=spec.logits_soft_cap,
            sinks=layer.sinks,
            k_scale=kv.k_scale,
            v_scale=kv.v_scale,
        )
        if batch.mode is BatchMode.DECODE and self.fixed_decode:
            result = dec.decode_full_attention(
                q, kv.k, kv.v, page_table, batch.seq_lens, **common
            ).to(q.dtype)
        else:
            n = batch.num_reqs
            result = ops.paged_attention(
                q[: batch.num_tokens],
                kv.k,
                kv.v,
                page_table[:n],
                batch.query_start_loc[: n + 1],
                batch.seq_lens[:n],
                causal=spec.causal,
                **common,
            )
        return self._finish(result, out)


class MLAContext(_Context):
    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the new latent (the binding passes it); v is None
        v: torch.Tensor | None,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        kv = layer.kv
        page_table, slot_mapping = self._paged(batch)
        rank = spec.mla_dims[0]
        ops.write_paged_latent(k, kv.latent, slot_mapping, scale=kv.k_scale)
        if batch.mode is BatchMode.DECODE and self.fixed_decode:
            result = dec.decode_mla_attention(
                q,
                kv.latent,
                page_table,
                batch.seq_lens,
                kv_lora_rank=rank,
                scale=layer.scale,
                latent_scale=kv.k_scale,
            ).to(q.dtype)
        else:
            n = batch.num_reqs
            result = ops.mla_paged_attention(
                q[: batch.num_tokens],
                kv.latent,
                page_table[:n],
                batch.query_start_loc[: n + 1],
                batch.seq_lens[:n],
                kv_lora_rank=rank,
                scale=layer.scale,
                causal=spec.causal,
                latent_scale=kv.k_scale,
            )
        return self._finish(result, out)


class EncoderContext(_Context):
    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the binding passes k and v for this kind
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        result = ops.varlen_attention(
            q,
            k,
            v,
            batch.query_start_loc,
            scale=layer.scale,
            causal=spec.causal,
            sliding_window=spec.sliding_window,
            attention_chunk_size=spec.attention_chunk_size,
            logits_soft_cap=spec.logits_soft_cap,
        )
        return self._finish(result, out)


class LinearContext(_Context):
    """Gated DeltaNet, KDA, Mamba2 and Mamba1 with conv state, lightning attention (no conv) and
    the gated short conv (conv only: ``conv1d`` is its whole core, ``forward`` is refused);
    speculative verify keeps per-token states ("native" strategy) and
    :meth:`commit_speculative` keeps the accepted prefix's state."""

    def __init__(self, backend: Backend, group: LayerGroup, state: PersistentState | None) -> None:
        super().__init__(backend, group)
        self.state = state
        variant = group.spec.linear_variant
        if variant is None:  # LayerSpec refuses a linear layer without one
            raise ValueError(f"group {group.group_id!r}: a linear layer without a linear_variant")
        self.variant = variant
        # verify steps: per layer, the per-token states and the conv inputs to roll back to
        self._verify_states: dict[int, torch.Tensor] = {}
        self._verify_conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, batch: AttentionBatch) -> None:
        self.batch = batch
        self._verify_states.clear()
        self._verify_conv.clear()

    def conv1d(
        self,
        layer: LayerAttentionBinding,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        activation: str | None = "silu",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = self._batch()
        indices, initial = self._slots(batch)
        conv_state = layer.linear_state.conv
        if batch.mode is BatchMode.DECODE:
            result = dec.decode_conv1d(x, weight, bias, conv_state, indices, activation=activation)
        else:
            n, t = batch.num_reqs, batch.num_tokens
            if batch.mode is BatchMode.VERIFY:
                idx = indices[:n].long()
                self._verify_conv[layer.layer_index] = (conv_state[idx].clone(), x[:t].clone())
            result = ops.causal_conv1d(
                x[:t],
                weight,
                bias,
                conv_state,
                batch.query_start_loc[: n + 1],
                indices[:n],
                initial[:n],
                activation=activation,
            )
        return self._finish(result, out)

    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,  # the binding passes k and v for this kind
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        batch = self._batch()
        spec = self.spec
        ssm = layer.linear_state.ssm
        variant = self.variant
        if variant is LinearVariant.SHORT_CONV:
            self._bad(
                f"layer {layer.layer_index}: forward of a short-conv layer",
                "binding.conv1d only (the gated short conv has no recurrent state)",
                "a forward call",
            )
        indices, initial = self._slots(batch)
        self._check_inputs(layer.layer_index, q, v, inputs)
        if batch.mode is BatchMode.DECODE:
            result = dec.decode_linear_step(
                variant.value,
                q,
                k,
                v,
                ssm,
                indices,
                scale=layer.scale,
                use_qk_l2norm=spec.qk_l2norm,
                **inputs,
            )
            return self._finish(result, out)
        n, t = batch.num_reqs, batch.num_tokens
        intermediate = None
        if batch.mode is BatchMode.VERIFY:
            k1 = batch.spec_tokens + 1
            intermediate = torch.empty(
                (n, k1, *spec.ssm_state_shape), dtype=torch.float32, device=q.device
            )
            self._verify_states[layer.layer_index] = intermediate
        meta = (batch.query_start_loc[: n + 1], indices[:n], initial[:n])
        # the per-token inputs cut to the real tokens, by name: a per-layer constant ([H])
        # may have as many rows as the step has padded tokens
        tok = {
            name: value if name in LINEAR_LAYER_INPUTS else value[:t]
            for name, value in inputs.items()
        }
        if variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
            scan = ops.mamba2_ssd if variant is LinearVariant.MAMBA2 else ops.mamba1_selective_scan
            result = scan(
                v[:t],
                tok["dt"],
                tok["A_log"],
                k[:t],
                q[:t],
                tok["D"],
                tok["dt_bias"],
                ssm,
                *meta,
                intermediate_states=intermediate,
            )
        elif variant is LinearVariant.LIGHTNING:
            result = ops.lightning_attention(
                q[:t],
                k[:t],
                v[:t],
                inputs["slope"],  # [H]: a per-layer constant, never cut to the tokens
                ssm,
                *meta,
                scale=layer.scale,
                intermediate_states=intermediate,
            )
        else:
            fn = ops.gated_delta_rule if variant is LinearVariant.GATED_DELTANET else ops.kda
            result = fn(
                q[:t],
                k[:t],
                v[:t],
                tok["g"],
                tok["beta"],
                ssm,
                *meta,
                scale=layer.scale,
                use_qk_l2norm=spec.qk_l2norm,
                intermediate_states=intermediate,
            )
        return self._finish(result, out)

    def _check_inputs(
        self, layer: int, q: torch.Tensor, v: torch.Tensor, inputs: dict[str, Any]
    ) -> None:
        """The variant's own inputs, present and shaped for this step (``v [T, H, Dv]``,
        ``q [T, Hk, Dk]``), in every mode: a decode step's broadcasting would otherwise spread
        one request's gate or step size over the others' states."""
        T, H, Dk = v.shape[0], v.shape[1], q.shape[2]
        shapes: dict[str, tuple[int, ...]] = {"g": (T, H), "beta": (T, H)}
        if self.variant is LinearVariant.KDA:
            shapes["g"] = (T, H, Dk)
        if self.variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
            a_log = (H, Dk) if self.variant is LinearVariant.MAMBA1 else (H,)
            shapes = {"dt": (T, H), "A_log": a_log, "D": (H,), "dt_bias": (H,)}
        elif self.variant is LinearVariant.LIGHTNING:
            shapes = {"slope": (H,)}
        where = f"layer {layer}: {self.variant.value}"
        missing = [n for n in shapes if inputs.get(n) is None]
        if missing:
            self._bad(f"{where} inputs", list(shapes), f"missing {missing}")
        unknown = sorted(set(inputs) - set(shapes))
        if unknown:
            self._bad(f"{where} inputs", list(shapes), f"also {unknown}, which it does not take")
        for name, want in shapes.items():
            got = tuple(inputs[name].shape)
            if got != want:
                self._bad(f"{where} input {name} shape", list(want), list(got))

    def commit_speculative(self, batch: AttentionBatch, num_accepted: torch.Tensor) -> None:
        """Write the state after each request's accepted tokens into its slot."""
        if batch.mode is not BatchMode.VERIFY:
            return
        n = batch.num_reqs
        indices, _ = self._slots(batch)
        acc = num_accepted[:n].long().to(indices.device)
        k1 = batch.spec_tokens + 1
        if ((acc < 1) | (acc > k1)).any():
            self._bad("num_accepted", f"values in 1..{k1}", num_accepted[:n].tolist())
        slots = indices[:n].long()
        rows = torch.arange(n, device=slots.device)
        for layer_index, states in self._verify_states.items():
            ssm = self._layer_state(layer_index).ssm
            ssm.index_copy_(0, slots, states[rows, acc - 1].to(ssm.dtype))
        for layer_index, (old_conv, x) in self._verify_conv.items():
            conv = self._layer_state(layer_index).conv
            km1 = conv.shape[-1]
            for b in range(n):
                a = int(acc[b])
                seq = torch.cat([old_conv[b], x[b * k1 : b * k1 + a].T.to(conv.dtype)], dim=-1)
                conv[slots[b]] = seq[:, -km1:]
        self._verify_states.clear()
        self._verify_conv.clear()

    def _layer_state(self, layer_index: int) -> LinearStateLayer:
        if self.state is None:
            raise RuntimeError(
                f"group {self.group.group_id!r}: the context was allocated without the "
                "persistent state; it holds no state slots to commit to"
            )
        return self.state.state_slots.layer(layer_index)


@hookimpl
def attn_core_bind_forward(
    backend: Backend, context: AttentionContext
) -> Callable[..., torch.Tensor]:
    return context.forward
