"""Run a transformers decoder layer by layer with every attention core replaced by a binding.

The adapter reuses the transformers modules' weights and code for everything that is not the
attention core: embedding, norms, projections, rotary embedding (the model's ``rotary_emb`` and
its module's ``apply_rotary_pos_emb``), q/k norms, output gates, MLP / MoE blocks, gated RMSNorm,
``lm_head``. What changes is the attention itself: ``runtime.binding(i).forward(...)`` for every
kind, and ``binding.conv1d`` for the causal conv of linear layers.

All tensors of one step are flat over the step's tokens: ``T`` = ``batch.padded_tokens`` rows in
batch order (``query_start_loc``), positions from ``batch.positions``.

Mixers by layer kind:

- full (Qwen3, Qwen3-Next gated, Bamba, gpt-oss with sinks / window): q, k, v ``[T, H|Hkv, D]``.
- mla (DeepSeek-V3): absorbed form, ``q [T, H, R + P]``, latent ``[T, R + P]``, output
  ``[T, H, R]`` mapped back with ``W_UV``.
- linear Gated DeltaNet (Qwen3-Next): conv over q|k|v, ``g = -exp(A_log) softplus(a + dt_bias)``,
  ``beta = sigmoid(b)``, gated RMSNorm with ``z``.
- linear Mamba2 (Bamba): conv over x|B|C, ``q=C, k=B, v=x`` plus ``dt, A_log, D, dt_bias``;
  gated RMSNorm with the z gate.
- linear lightning (MiniMax-01): ``act(qkv_proj)`` split into q, k, v of every head, the layer's
  ``slope_rate`` as ``slope``; RMSNorm, sigmoid output gate and ``out_proj`` after it.
- linear short conv (LFM2): ``in_proj`` -> B, C, x; ``binding.conv1d(B * x)`` with no
  activation (the whole attention core); ``C *`` and ``out_proj`` after it.

Decoder blocks: pre-norm residual (most), MiniMax's residual taken after the norm and scaled by
its alpha / beta factors, LFM2's ``operator_norm`` / ``ffn_norm`` / ``feed_forward`` and final
``embedding_norm``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attn_core.models import ModelLayout
from attn_core.reference.ops import mla_absorb_query, mla_output_from_latent, mla_split_kv_b_proj
from attn_core.specs import LayerKind, LinearVariant, torch_dtype

__all__ = ["CausalLMAdapter", "layer_params_for"]


def _decoder(hf_model: torch.nn.Module) -> Any:
    """The model's decoder stack, ``hf_model.model``. Any to the type checker: its attributes
    (``layers``, ``embed_tokens``, ``rotary_emb``, the norms) differ by architecture and are
    resolved at run time by ``nn.Module.__getattr__``."""
    return hf_model.model


def layer_params_for(hf_model: torch.nn.Module, layout: ModelLayout) -> dict[int, dict[str, Any]]:
    """Per-layer binding parameters taken from the model: gpt-oss's sinks ``[H]`` float32."""
    params: dict[int, dict[str, Any]] = {}
    for i in layout.layer_indices:
        if layout.spec_of(i).has_sinks:
            sinks = _decoder(hf_model).layers[i].self_attn.sinks
            params[i] = {"sinks": sinks.detach().float()}
    return params


def _mlp_out(y: Any) -> torch.Tensor:
    """An MLP / MoE block's output (MoE blocks also return router logits)."""
    return y[0] if isinstance(y, tuple) else y


class CausalLMAdapter:
    """A transformers ``*ForCausalLM`` driven step by step through an attention runtime.

    :param hf_model: the transformers model (eval mode, the dtype of the layout's specs).
    :param layout: its attention layout (``specs_from_hf_config``).
    :param runtime: an :class:`attn_core.runtime.AttentionRuntime` over ``layout.groups``.
    :param direct: call each group's ``context.forward`` / ``context.conv1d`` directly instead
        of going through the binding (used to measure the binding's overhead only).
    """

    def __init__(
        self,
        hf_model: torch.nn.Module,
        layout: ModelLayout,
        runtime: Any,
        *,
        direct: bool = False,
    ) -> None:
        # transformers modules: their attributes differ by architecture (see _decoder)
        self.hf: Any = hf_model
        self.layout = layout
        self.runtime = runtime
        self.config: Any = hf_model.config
        self.base = _decoder(hf_model)
        self.modeling = importlib.import_module(type(hf_model).__module__)
        self.dtype = torch_dtype(layout.layer_specs[0].dtype)
        self.direct = direct
        self._mla_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slopes: dict[int, torch.Tensor] = {}  # lightning layers: slope [H] float32
        self._mixers: list[Callable[[int, Any, torch.Tensor, Any], torch.Tensor] | None] = []
        for i, layer in enumerate(self.base.layers):
            if i not in layout.layer_indices:
                self._mixers.append(None)
                continue
            spec = layout.spec_of(i)
            if spec.kind is LayerKind.MLA:
                self._mixers.append(self._mla)
            elif spec.kind is LayerKind.FULL:
                self._mixers.append(self._full)
            elif spec.linear_variant is LinearVariant.GATED_DELTANET:
                self._mixers.append(self._gdn)
            elif spec.linear_variant is LinearVariant.LIGHTNING:
                self._mixers.append(self._lightning)
            elif spec.linear_variant is LinearVariant.SHORT_CONV:
                self._mixers.append(self._short_conv)
            elif spec.linear_variant is LinearVariant.MAMBA2:
                limit = tuple(getattr(layer.mamba, "time_step_limit", (0.0, float("inf"))))
                if limit != (0.0, float("inf")):
                    raise ValueError(
                        f"layer {i}: time_step_limit={limit}; the binding's Mamba2 inputs carry "
                        "no dt clamp, expected (0.0, inf)"
                    )
                self._mixers.append(self._mamba2)
            else:
                raise ValueError(f"layer {i}: no mixer for {spec.short()}")

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for the prepared batch.

        :param input_ids: ``[T]`` int64 token ids in batch order (``T = batch.padded_tokens``).
        :param positions: ``[T]`` int64 absolute positions (``batch.positions``).
        :returns: ``[T, vocab]`` logits in the model dtype.
        """
        h = self.base.embed_tokens(input_ids)[None]  # [1, T, D]
        pe = self.base.rotary_emb(h, positions[None]) if hasattr(self.base, "rotary_emb") else None
        for i, layer in enumerate(self.base.layers):
            mixer = self._mixers[i]
            if mixer is None:
                raise ValueError(f"layer {i} is not in the attention layout; nothing to run it")
            if hasattr(layer, "attn_alpha_factor"):  # MiniMax: residual after the norm, scaled
                h = layer.input_layernorm(h)
                h = h * layer.attn_alpha_factor + mixer(i, layer, h[0], pe)[None] * (
                    layer.attn_beta_factor
                )
                h = layer.post_attention_layernorm(h)
                h = h * layer.mlp_alpha_factor + _mlp_out(layer.mlp(h)) * layer.mlp_beta_factor
                continue
            if hasattr(layer, "operator_norm"):  # LFM2
                h = h + mixer(i, layer, layer.operator_norm(h)[0], pe)[None]
                h = h + layer.feed_forward(layer.ffn_norm(h))
                continue
            residual = h
            x = layer.input_layernorm(h)
            h = residual + mixer(i, layer, x[0], pe)[None]
            residual = h
            norm2 = getattr(layer, "post_attention_layernorm", None) or layer.pre_ff_layernorm
            mlp = getattr(layer, "mlp", None) or layer.feed_forward
            h = residual + _mlp_out(mlp(norm2(h)))
        norm = (
            getattr(self.base, "norm", None)
            or getattr(self.base, "final_layernorm", None)
            or self.base.embedding_norm  # LFM2 names its final norm so
        )
        return self.hf.lm_head(norm(h))[0]

    # -- attention calls: through the binding, or straight into the group's context -----------
    def _attend(self, i: int, q, k, v, out, **inputs) -> torch.Tensor:
        binding = self.runtime.binding(i)
        if self.direct:
            group = binding._group
            result = group.forward(binding, q, k, v, out, **inputs)
            if result is not out:
                out.copy_(result)
            return out
        return binding.forward(q, k, v, out=out, **inputs)

    def _conv(self, i: int, x, weight, bias, activation) -> torch.Tensor:
        binding = self.runtime.binding(i)
        if self.direct:
            return binding._group.context.conv1d(binding, x, weight, bias, activation=activation)
        return binding.conv1d(x, weight, bias, activation=activation)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, pe, *, interleave: bool = False):
        """``q [T, H, D]``, ``k [T, Hk, D]`` through the modeling module's rotary function."""
        cos, sin = pe
        fn = (
            self.modeling.apply_rotary_pos_emb_interleave
            if interleave
            else self.modeling.apply_rotary_pos_emb
        )
        q4, k4 = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q4[0].transpose(0, 1), k4[0].transpose(0, 1)

    # -- mixers: (layer index, decoder layer, x [T, D] normed, position embeddings) -> [T, D] ---
    def _full(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        at = layer.self_attn
        spec = self.layout.spec_of(i)
        T, D = x.shape[0], spec.head_dim
        gate = None
        if type(at).__name__.startswith("Qwen3Next"):  # q_proj emits q and an output gate
            q, gate = torch.chunk(at.q_proj(x).view(T, -1, 2 * D), 2, dim=-1)
            gate = gate.reshape(T, -1)
        else:
            q = at.q_proj(x).view(T, -1, D)
        k = at.k_proj(x).view(T, -1, D)
        v = at.v_proj(x).view(T, -1, spec.head_dim_v)
        if hasattr(at, "q_norm"):
            q, k = at.q_norm(q), at.k_norm(k)
        elif hasattr(at, "q_layernorm"):  # LFM2
            q, k = at.q_layernorm(q), at.k_layernorm(k)
        q, k = self._rope(q, k, pe)
        out = torch.empty(T, spec.num_heads, spec.head_dim_v, dtype=x.dtype, device=x.device)
        self._attend(i, q.contiguous(), k.contiguous(), v.contiguous(), out)
        o = out.view(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return (at.o_proj if hasattr(at, "o_proj") else at.out_proj)(o)

    def _mla(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        at = layer.self_attn
        spec = self.layout.spec_of(i)
        T, H = x.shape[0], spec.num_heads
        R, P, Dn = spec.mla_dims
        if i not in self._mla_weights:
            self._mla_weights[i] = mla_split_kv_b_proj(
                at.kv_b_proj.weight, num_heads=H, qk_nope_head_dim=Dn, v_head_dim=at.v_head_dim
            )
        w_uk, w_uv = self._mla_weights[i]
        if at.q_lora_rank is None:
            q = at.q_proj(x)
        else:
            q = at.q_b_proj(at.q_a_layernorm(at.q_a_proj(x)))
        q_nope, q_rot = torch.split(q.view(T, H, Dn + P), [Dn, P], dim=-1)
        c, k_rot = torch.split(at.kv_a_proj_with_mqa(x), [R, P], dim=-1)
        c = at.kv_a_layernorm(c)
        q_rot, k_rot = self._rope(
            q_rot, k_rot.view(T, 1, P), pe, interleave=bool(self.config.rope_interleave)
        )
        q_abs = torch.cat([mla_absorb_query(q_nope, w_uk), q_rot], dim=-1)
        latent = torch.cat([c, k_rot[:, 0]], dim=-1)
        o_lat = torch.empty(T, H, R, dtype=x.dtype, device=x.device)
        self._attend(i, q_abs.contiguous(), latent.contiguous(), None, o_lat)
        return at.o_proj(mla_output_from_latent(o_lat, w_uv).reshape(T, -1))

    def _gdn(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        la = layer.linear_attn
        T = x.shape[0]
        q, k, v, z, b, a = la.fix_query_key_value_ordering(
            la.in_proj_qkvz(x[None]), la.in_proj_ba(x[None])
        )
        mixed = torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=-1)
        mixed = self._conv(i, mixed, la.conv1d.weight.squeeze(1), la.conv1d.bias, la.activation)
        q, k, v = torch.split(mixed, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(T, -1, la.head_k_dim).contiguous()
        k = k.reshape(T, -1, la.head_k_dim).contiguous()
        v = v.reshape(T, -1, la.head_v_dim).contiguous()
        beta = b[0].sigmoid()
        g = -la.A_log.float().exp() * F.softplus(a[0].float() + la.dt_bias)
        out = torch.empty(T, la.num_v_heads, la.head_v_dim, dtype=x.dtype, device=x.device)
        self._attend(i, q, k, v, out, g=g, beta=beta)
        o = la.norm(out.reshape(-1, la.head_v_dim), z.reshape(-1, la.head_v_dim))
        return la.out_proj(o.reshape(T, -1))

    def _mamba2(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        mx = layer.mamba
        T = x.shape[0]
        G, N = mx.n_groups, mx.ssm_state_size
        gate, xbc, dt = mx.in_proj(x).split(
            [mx.intermediate_size, mx.conv_dim, mx.num_heads], dim=-1
        )
        xbc = self._conv(
            i, xbc.contiguous(), mx.conv1d.weight.squeeze(1), mx.conv1d.bias, mx.activation
        )
        hs, B, C = torch.split(xbc, [mx.intermediate_size, G * N, G * N], dim=-1)
        y = torch.empty(T, mx.num_heads, mx.head_dim, dtype=x.dtype, device=x.device)
        self._attend(
            i,
            C.reshape(T, G, N).contiguous(),
            B.reshape(T, G, N).contiguous(),
            hs.reshape(T, mx.num_heads, mx.head_dim).contiguous(),
            y,
            dt=dt.contiguous(),
            A_log=mx.A_log,
            D=mx.D,
            dt_bias=mx.dt_bias,
        )
        return mx.out_proj(mx.norm(y.view(T, -1), gate).to(x.dtype))

    def _lightning(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        at = layer.self_attn
        spec = self.layout.spec_of(i)
        T, H, D = x.shape[0], spec.num_heads, spec.head_dim
        q, k, v = torch.split(at.act_fn(at.qkv_proj(x)).view(T, H, 3 * D), D, dim=-1)
        slope = self._slopes.get(i)
        if slope is None:
            # ALiBi-style per-head rates scaled by the layer's depth, from the module's own
            # function in float32 (its slope_rate buffer is rounded to the model dtype)
            slope = at.get_slope_rate(device=x.device).reshape(-1).float()
            if slope.shape[0] != H:
                # a tensor-parallel rank holds a slice of the heads: it needs its slice of
                # the slopes, which this adapter (it shards nothing) cannot pick
                raise ValueError(
                    f"layer {i}: the module has slopes for {slope.shape[0]} lightning heads, "
                    f"the layer spec {H}; expected one slope per head of this rank"
                )
            self._slopes[i] = slope
        out = torch.empty(T, H, spec.head_dim_v, dtype=x.dtype, device=x.device)
        self._attend(i, q.contiguous(), k.contiguous(), v.contiguous(), out, slope=slope)
        o = at.norm(out.view(T, -1))
        return at.out_proj(torch.sigmoid(at.output_gate(x)) * o)

    def _short_conv(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        cv = layer.conv
        b, c, xs = cv.in_proj(x).chunk(3, dim=-1)
        y = self._conv(i, (b * xs).contiguous(), cv.conv.weight.squeeze(1), cv.conv.bias, None)
        return cv.out_proj(c * y)
