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
- linear Mamba1 (Jamba, Falcon-Mamba, Mamba): conv over x only, then ``x_proj`` -> dt | B | C
  (Jamba's and Falcon-Mamba's RMS norms on each), ``dt = dt_proj.weight dt`` with
  ``dt_bias = dt_proj.bias``; ``q=C [T, 1, N], k=B, v=x [T, d_inner, 1]``, ``A_log [d_inner,
  N]``, ``D``; the output times ``silu(z)``, then ``out_proj``.

Decoder layouts: pre-norm blocks with an MLP / MoE after the mixer (``input_layernorm`` and
``post_attention_layernorm`` / ``pre_ff_layernorm``), or Mamba's blocks (``norm`` -> ``mixer``,
no MLP, the residual optionally in float32) under ``backbone`` instead of ``model``. Jamba has
no positional encoding: its attention layers get q and k as projected.
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
    """The model's decoder stack, ``hf_model.model`` (``hf_model.backbone`` for Mamba and
    Falcon-Mamba). Any to the type checker: its attributes (``layers``, ``embed_tokens``,
    ``rotary_emb``, the norms) differ by architecture and are resolved at run time by
    ``nn.Module.__getattr__``."""
    if hasattr(hf_model, "backbone"):
        return hf_model.backbone
    return hf_model.model


def layer_params_for(hf_model: torch.nn.Module, layout: ModelLayout) -> dict[int, dict[str, Any]]:
    """Per-layer binding parameters taken from the model: gpt-oss's sinks ``[H]`` float32."""
    params: dict[int, dict[str, Any]] = {}
    for i in layout.layer_indices:
        if layout.spec_of(i).has_sinks:
            sinks = _decoder(hf_model).layers[i].self_attn.sinks
            params[i] = {"sinks": sinks.detach().float()}
    return params


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
            elif spec.linear_variant is LinearVariant.MAMBA2:
                limit = tuple(getattr(layer.mamba, "time_step_limit", (0.0, float("inf"))))
                if limit != (0.0, float("inf")):
                    raise ValueError(
                        f"layer {i}: time_step_limit={limit}; the binding's Mamba2 inputs carry "
                        "no dt clamp, expected (0.0, inf)"
                    )
                self._mixers.append(self._mamba2)
            elif spec.linear_variant is LinearVariant.MAMBA1:
                self._mixers.append(self._mamba1)
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
        embed = getattr(self.base, "embed_tokens", None) or self.base.embeddings
        h = embed(input_ids)[None]  # [1, T, D]
        pe = self.base.rotary_emb(h, positions[None]) if hasattr(self.base, "rotary_emb") else None
        for i, layer in enumerate(self.base.layers):
            mixer = self._mixers[i]
            if mixer is None:
                raise ValueError(f"layer {i} is not in the attention layout; nothing to run it")
            if hasattr(layer, "mixer"):  # Mamba's block: norm, mixer, residual; no MLP
                residual = h.float() if layer.residual_in_fp32 else h
                x = layer.norm(h.to(layer.norm.weight.dtype))
                h = residual + mixer(i, layer, x[0], pe)[None]
                continue
            residual = h
            x = layer.input_layernorm(h)
            h = residual + mixer(i, layer, x[0], pe)[None]
            residual = h
            norm2 = getattr(layer, "post_attention_layernorm", None) or layer.pre_ff_layernorm
            mlp = getattr(layer, "mlp", None) or layer.feed_forward
            y = mlp(norm2(h))
            if isinstance(y, tuple):  # MoE blocks also return router logits
                y = y[0]
            h = residual + y
        norm = (
            getattr(self.base, "norm", None)
            or getattr(self.base, "final_layernorm", None)
            or self.base.norm_f
        )
        # a float32 residual (Mamba's residual_in_fp32) goes back to the head's dtype, as HF does
        return self.hf.lm_head(norm(h).to(self.hf.lm_head.weight.dtype))[0]

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
        if pe is not None:  # None: the model has no rotary embedding at all (Jamba)
            q, k = self._rope(q, k, pe)
        out = torch.empty(T, spec.num_heads, spec.head_dim_v, dtype=x.dtype, device=x.device)
        self._attend(i, q.contiguous(), k.contiguous(), v.contiguous(), out)
        o = out.view(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return at.o_proj(o)

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

    def _mamba1(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        mx = layer.mixer if hasattr(layer, "mixer") else layer.mamba
        T, C_in = x.shape[0], mx.intermediate_size
        N = mx.ssm_state_size
        xs, gate = mx.in_proj(x).chunk(2, dim=-1)  # [T, d_inner] each
        xs = self._conv(
            i, xs.contiguous(), mx.conv1d.weight.squeeze(1), mx.conv1d.bias, mx.activation
        )
        step, B, C = torch.split(mx.x_proj(xs), [mx.time_step_rank, N, N], dim=-1)
        if hasattr(mx, "b_layernorm"):  # Jamba (weighted) and Falcon-Mamba (weightless)
            step, B, C = mx.dt_layernorm(step), mx.b_layernorm(B), mx.c_layernorm(C)
        y = torch.empty(T, C_in, 1, dtype=x.dtype, device=x.device)
        self._attend(
            i,
            C.reshape(T, 1, N).contiguous(),
            B.reshape(T, 1, N).contiguous(),
            xs.reshape(T, C_in, 1),
            y,
            # dt_proj's weight only: its bias is the scan's dt_bias (softplus(dt + bias))
            dt=F.linear(step, mx.dt_proj.weight).contiguous(),
            A_log=mx.A_log.float(),
            D=mx.D.float(),
            dt_bias=mx.dt_proj.bias.float(),
        )
        return mx.out_proj((y[..., 0] * F.silu(gate)).to(x.dtype))
