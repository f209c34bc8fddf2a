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
- mla (DeepSeek-V3, DeepSeek-V2, Kimi-Linear): absorbed form, ``q [T, H, R + P]``, latent
  ``[T, R + P]``, output ``[T, H, R]`` mapped back with ``W_UV``. Kimi-Linear's MLA has no
  positional encoding (its model has no rotary embedding): q and k go in as projected.
- linear Gated DeltaNet (Qwen3-Next, Qwen3.5): conv over q|k|v,
  ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, gated RMSNorm with ``z``.
- linear KDA (Kimi-Linear): q, k, v projections, one conv over q|k|v (``binding.conv1d``), the
  per-channel gate ``g [T, H, Dk] = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` (the module's
  ``forget_gate``), ``beta = sigmoid(b_proj)``; the sigmoid-gated RMSNorm ``o_norm`` with
  ``g_b(g_a(x))`` and ``o_proj`` after the core.
- linear Mamba2 (Bamba, Nemotron-H, Granite-4.0-H, Falcon-H1): conv over x|B|C, ``q=C, k=B,
  v=x`` plus ``dt, A_log, D, dt_bias``; gated RMSNorm with the z gate. Falcon-H1's mixer
  scales its input by ``ssm_in_multiplier`` and ``in_proj``'s output by its muP vector before
  the conv (so ``dt`` is scaled too), and gates with ``silu(z)`` alone when ``mamba_rms_norm``
  is false. A lower ``time_step_limit``
  (Nemotron-H's ``time_step_min``) is folded into ``dt`` exactly: ``softplus(dt + bias) >= lo``
  iff ``dt >= softplus^-1(lo) - bias``, so ``dt`` is raised to that bound before the binding.
- linear Mamba1 (Jamba, Falcon-Mamba, Mamba): conv over x only, then ``x_proj`` -> dt | B | C
  (Jamba's and Falcon-Mamba's RMS norms on each), ``dt = dt_proj.weight dt`` with
  ``dt_bias = dt_proj.bias``; ``q=C [T, 1, N], k=B, v=x [T, d_inner, 1]``, ``A_log [d_inner,
  N]``, ``D``; the output times ``silu(z)``, then ``out_proj``.
- linear lightning (MiniMax-01): ``act(qkv_proj)`` split into q, k, v of every head, the layer's
  ``slope_rate`` as ``slope``; RMSNorm, sigmoid output gate and ``out_proj`` after it.
- linear short conv (LFM2): ``in_proj`` -> B, C, x; ``binding.conv1d(B * x)`` with no
  activation (the whole attention core); ``C *`` and ``out_proj`` after it.

Decoder blocks: pre-norm residual (most; an MLP / MoE after the mixer), MiniMax's residual taken
after the norm and scaled by its alpha / beta factors, LFM2's ``operator_norm`` / ``ffn_norm`` /
``feed_forward`` and final ``embedding_norm``, Mamba's blocks (``norm`` -> ``mixer``, no MLP, the
residual optionally in float32) under ``backbone`` instead of ``model``. Jamba has no positional
encoding: its attention layers get q and k as projected.

Families of :data:`LAYER_FORWARD_FAMILIES` (Gemma-3, Nemotron-H, Granite-4.0-H, Falcon-H1, Qwen3.5,
Kimi-Linear, Llama-4, the Qwen2-VL / Qwen2.5-VL and Qwen3-VL language models, the generic dense
family) run each transformers decoder layer's own ``forward`` (the generic dense family and the
``gdn-hybrid`` one (Lara-Mini, Qwen4-Exp), of :data:`MODEL_FORWARD_FAMILIES`, the whole model's
``forward``: no adapter code for what a family does around its layers): norms, residuals (and their
multipliers), rotary embedding and everything else stay transformers' code, and only the attention
op is replaced, through transformers' attention function interface (an ``"attn_core"``
implementation registered with ``AttentionInterface``, switched on for the step), and the Mamba2
mixer module by its class (and the Gated DeltaNet and KDA ones). An MLA module, whose attention
function would only see keys and values already expanded from the latent, is replaced whole by the
absorbed form; its ``scaling`` is checked against the spec. The hook checks every call against the
layer's spec: the scale, sliding window, chunk size (from the config's ``layer_types``, which
transformers builds its chunked mask from), soft-cap, sinks and causality transformers asks for
must be the ones the mapping describes, and every attention layer must have been called (and every
linear layer's mixer run).

Model types whose attention modules compute attention in their own code and never call the
attention-function interface (Falcon's rotary layouts, GPT-Neo) have a module adapter
(:data:`MODULE_ADAPTERS`, keyed by ``model_type``): like an MLA module, each attention module is
replaced whole during the step by a forward that does the module's own projections (Falcon's
fused ``query_key_value`` split, its rotary from the model's ``position_embeddings``, ``dense``;
GPT-Neo's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``) and calls the layer's binding for
the attention; what the module computes (heads, scale: GPT-Neo's is 1, window: GPT-Neo's local
layers) is checked against the spec on the first call. Everything around the modules stays the
model's own ``forward``.

A parallel hybrid's layer (Falcon-H1: Mamba2 and attention side by side on the same normed
input, their outputs scaled by ``ssm_out_multiplier`` / ``attention_out_multiplier`` and
summed) holds two ops: the decoder layer's own forward runs both, the attention through the
hook (its binding ``runtime.binding(i, LayerKind.FULL)``), the Mamba2 mixer by its class
(``runtime.binding(i, LayerKind.LINEAR)``); the multipliers around them stay transformers'
code, as do the embedding multiplier and the ``lm_head_multiplier`` the adapter applies.

Llama-4's NoPE layers scale each query by ``1 + attn_scale * log1p(floor((p + 1) /
floor_scale))`` of its position ``p`` (``attn_temperature_tuning``). transformers takes ``p``
from its KV cache (``arange(T) + past``), which a flat step of several requests does not have;
during the step the modules' own scaling is switched off and the hook applies the same factor
with the step's positions, before the op (as the module does).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from attn_core.e2e.configs import lightning_slopes
from attn_core.models import ModelLayout
from attn_core.reference.ops import mla_absorb_query, mla_output_from_latent, mla_split_kv_b_proj
from attn_core.specs import LayerKind, LinearVariant, torch_dtype

__all__ = [
    "LAYER_FORWARD_FAMILIES",
    "MODEL_FORWARD_FAMILIES",
    "MODULE_ADAPTERS",
    "CausalLMAdapter",
    "ModuleAdapter",
    "layer_params_for",
]

#: Families (``ModelLayout.family``) whose decoder layers run their own transformers ``forward``
#: with the attention op hooked (see the module docstring).
LAYER_FORWARD_FAMILIES: frozenset[str] = frozenset(
    {
        "gemma-3",
        "nemotron-h",
        "granite-4.0-h",
        "falcon-h1",
        "qwen3.5",
        "dense",
        "kimi-linear",
        "gdn-hybrid",
        "llama-4",
        "qwen2-vl-text",
        "qwen3-vl-text",
    }
)
#: Families whose whole transformers ``*ForCausalLM.forward`` runs with the attention op hooked
#: (the generic dense family): everything around the decoder layers (embedding scales, a norm
#: before the first layer, the final norm, logit scales and soft-caps, an ``lm_head`` bias) is
#: the model's own code, so a new dense family needs no adapter code. The attention masks
#: transformers would build are skipped (an attention implementation it has no mask function for
#: gets none), so any mask that still reaches the hook was made by the model itself (ALiBi, a
#: bidirectional prefix) and is refused.
MODEL_FORWARD_FAMILIES: frozenset[str] = frozenset({"dense", "gdn-hybrid"})
_HOOK_NAME = "attn_core"
# The adapter whose step is running (the hook is a module-level function transformers calls).
_ACTIVE: list[CausalLMAdapter] = []


def _attention_hook(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [1, H, T, D]``, ``key`` / ``value``
    ``[1, Hkv, T, D|Dv]`` (rotary already applied) -> ``([1, T, H, Dv], None)``."""
    if not _ACTIVE:
        raise RuntimeError("the attn_core attention implementation ran outside an adapter step")
    kwargs = {**kwargs, "attention_mask": attention_mask}
    return _ACTIVE[-1]._hooked_attention(module, query, key, value, kwargs), None


def _register_hook() -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _HOOK_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_HOOK_NAME, _attention_hook)


def _temperature_tuned(module: torch.nn.Module) -> bool:
    """A Llama-4 attention module that scales its queries by position (a NoPE layer with
    ``attn_temperature_tuning``), exactly when its forward would."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(
        module, "use_rope", True
    )


def _softplus_inverse(y: float) -> float:
    """``x`` with ``softplus(x) = y`` (``y > 0``), stable for small ``y``."""
    return y + math.log(-math.expm1(-y))


def _decoder(hf_model: torch.nn.Module) -> Any:
    """The model's decoder stack, ``hf_model.model`` (``hf_model.backbone`` for Mamba and
    Falcon-Mamba; the ``language_model`` of a multimodal model such as
    Gemma3ForConditionalGeneration: text prompts run the language model only). Any to the type
    checker: its attributes (``layers``, ``embed_tokens``, ``rotary_emb``, the norms) differ by
    architecture and are resolved at run time by ``nn.Module.__getattr__``."""
    if hasattr(hf_model, "backbone"):
        return hf_model.backbone
    # the decoder under its own name (GPT-NeoX: ``gpt_neox``), as transformers' base_model finds it
    base = hf_model.model if hasattr(hf_model, "model") else hf_model.base_model
    return getattr(base, "language_model", None) or base


def _layers(base: Any) -> Any:
    """The decoder layers of a model's decoder stack: ``layers`` (most), GPT-2's ``h``, OPT's
    ``decoder.layers``."""
    for path in (("layers",), ("h",), ("decoder", "layers"), ("blocks",)):
        obj = base
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(f"{type(base).__name__}: no decoder layers found (layers, h, decoder.layers)")


def _attention_module(layer: Any) -> Any:
    """A decoder layer's attention module: ``self_attn`` (most), GPT-2's ``attn``, JetMoE's and
    Falcon's ``self_attention``, GPT-Neo's ``attn.attention``; the layer itself if none."""
    for name in ("self_attn", "attn", "self_attention"):
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            inner = getattr(module, "attention", None)  # GPT-Neo wraps its self-attention
            return inner if isinstance(inner, torch.nn.Module) else module
    return layer


def layer_params_for(hf_model: torch.nn.Module, layout: ModelLayout) -> dict[int, dict[str, Any]]:
    """Per-layer binding parameters taken from the model: gpt-oss's sinks ``[H]`` float32."""
    params: dict[int, dict[str, Any]] = {}
    for group in layout.groups:  # by group: a parallel layer has two ops, one with sinks
        if group.spec.has_sinks:
            for i in group.layer_indices:
                sinks = _attention_module(_layers(_decoder(hf_model))[i]).sinks
                params[i] = {"sinks": sinks.detach().float()}
    return params


def _mrope(config: Any) -> bool:
    """Whether the rotary embedding is Qwen2-VL's multimodal one (``mrope_section`` set)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, key, None)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return True
    return False


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _mlp_out(y: Any) -> torch.Tensor:
    """An MLP / MoE block's output (MoE blocks also return router logits)."""
    return y[0] if isinstance(y, tuple) else y


#: The layer's attention op as a module adapter calls it: ``q [T, H, D]``, ``k`` / ``v``
#: ``[T, Hkv, D]`` (rotary applied, one sequence or a flat step) -> ``[T, H, D]``.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _falcon_attention(
    at: Any, x: torch.Tensor, kwargs: dict[str, Any], attend: Attend
) -> torch.Tensor:
    """``FalconAttention.forward`` (rotary, eval: no dropout) on ``x [T, hidden]`` ->
    ``[T, hidden]``, the attention itself through ``attend``.

    ``query_key_value``'s fused output is split as ``_split_heads`` does: with the new decoder
    architecture by KV group ``[T, Hkv, H / Hkv + 2, D]`` (the group's queries, its key, its
    value: query head ``h`` reads KV head ``h // (H / Hkv)``, GQA's order); multi-query
    ``[T, H + 2, D]`` (every query, one key, one value); else ``[T, H, 3, D]`` (q, k, v per
    head). Rotary with the model's ``(cos, sin) [1, T, D]`` (``position_embeddings``) through
    its modeling module's ``apply_rotary_pos_emb``; ``dense`` after the op."""
    if kwargs.get("alibi") is not None:  # the mapping refuses ALiBi Falcons
        raise ValueError(
            f"layer {at.layer_idx} ({type(at).__name__}): ALiBi attention has no layer kind"
        )
    T, H, D = x.shape[0], at.num_heads, at.head_dim
    fused = at.query_key_value(x)
    if at.new_decoder_architecture:
        qkv = fused.view(T, -1, H // at.num_kv_heads + 2, D)
        q, k, v = qkv[:, :, :-2].reshape(T, H, D), qkv[:, :, -2], qkv[:, :, -1]
    elif at.multi_query:
        qkv = fused.view(T, H + 2, D)
        q, k, v = qkv[:, :H], qkv[:, H : H + 1], qkv[:, H + 1 :]
    else:
        q, k, v = fused.view(T, H, 3, D).unbind(2)
    cos, sin = kwargs["position_embeddings"]
    rotary = sys.modules[type(at).__module__].apply_rotary_pos_emb
    q4, k4 = rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    out = attend(q4[0].transpose(0, 1), k4[0].transpose(0, 1), v)
    return at.dense(out.reshape(T, H * D))


def _falcon_computes(at: Any) -> dict[str, Any]:
    """What ``FalconAttention`` computes: its eager scores over ``sqrt(head_dim)`` (SDPA's
    default scale too), no window, its KV heads."""
    kv = at.num_kv_heads if at.new_decoder_architecture or not at.multi_query else 1
    return {
        "query heads": at.num_heads,
        "KV heads": kv,
        "softmax scale": at.head_dim**-0.5,
        "sliding window": None,
    }


def _gpt_neo_attention(
    at: Any, x: torch.Tensor, kwargs: dict[str, Any], attend: Attend
) -> torch.Tensor:
    """``GPTNeoSelfAttention.forward`` (eval: no dropout) on ``x [T, hidden]`` ->
    ``[T, hidden]``: ``q_proj`` / ``k_proj`` / ``v_proj`` to ``[T, H, D]`` (no positional
    encoding in the module: the model adds ``wpe`` to its embeddings), the op, ``out_proj``."""
    T, H, D = x.shape[0], at.num_heads, at.head_dim
    q, k, v = (p(x).view(T, H, D) for p in (at.q_proj, at.k_proj, at.v_proj))
    out = attend(q, k, v)
    return at.resid_dropout(at.out_proj(out.reshape(T, H * D)))


def _gpt_neo_computes(at: Any) -> dict[str, Any]:
    """What ``GPTNeoSelfAttention._attn`` computes: ``q . k`` unscaled (scale 1), a local
    layer's mask ``tril(1) xor tril(1, -window_size)`` (the last ``window_size`` tokens, itself
    included: the spec's window convention)."""
    return {
        "query heads": at.num_heads,
        "KV heads": at.num_heads,
        "softmax scale": 1.0,
        "sliding window": at.config.window_size if at.attention_type == "local" else None,
    }


@dataclass(frozen=True, slots=True)
class ModuleAdapter:
    """Stands in for an attention module that computes attention in its own code.

    :param forward: ``(module, x [T, hidden], the module call's keyword arguments, attend) ->
        [T, hidden]``: the module's own projections, positional encoding and output, with
        ``attend`` for the attention.
    :param computes: ``module -> {"query heads", "KV heads", "softmax scale", "sliding
        window"}`` as the module's own code computes them; checked against the layer's spec.
    """

    forward: Callable[[Any, torch.Tensor, dict[str, Any], Attend], torch.Tensor]
    computes: Callable[[Any], dict[str, Any]]


#: ``model_type`` -> the adapter of its attention modules (each decoder layer's
#: :func:`_attention_module`), replaced during a step; ``attn_core.models.hf_config`` maps the
#: same model types (its ``_OWN_ATTENTION``).
MODULE_ADAPTERS: dict[str, ModuleAdapter] = {
    "falcon": ModuleAdapter(_falcon_attention, _falcon_computes),
    "gpt_neo": ModuleAdapter(_gpt_neo_attention, _gpt_neo_computes),
}


def _refuse_disagreement(
    i: int,
    module: Any,
    spec: Any,
    computed: Mapping[str, Any],
    described: Mapping[str, Any],
    who: str,
) -> None:
    """Refuse layer ``i`` where what ``who`` computes in ``module`` (``{what: value}``) differs
    from what its spec describes (``described``, the same keys); floats compare to 1e-6."""
    for what, got in computed.items():
        want = described[what]
        same = (
            math.isclose(got, want, rel_tol=1e-6)
            if isinstance(got, float) and isinstance(want, float)
            else got == want
        )
        if not same:
            raise ValueError(
                f"layer {i} ({type(module).__name__}): {who} computes {what} {got!r}, the "
                f"layer's spec ({spec.short()}) describes {want!r}"
            )


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
        # the decoder's own config: the text_config of a multimodal model, else the same object
        self.text_config: Any = getattr(self.config, "text_config", None) or self.config
        self.base = _decoder(hf_model)
        # the decoder's own modeling module (its rotary functions): LLaVA's language model is
        # Llama's, whose functions llava's module does not hold
        self.modeling = importlib.import_module(type(self.base).__module__)
        self.dtype = torch_dtype(layout.layer_specs[0].dtype)
        self.direct = direct
        self._mla_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slopes: dict[int, torch.Tensor] = {}  # lightning layers: slope [H] float32
        self._mixers: list[Callable[[int, Any, torch.Tensor, Any], torch.Tensor] | None] = []
        self.layer_forward = layout.family in LAYER_FORWARD_FAMILIES
        # Mamba2 mixer modules by layer index; in layer-forward mode every linear mixer module
        # (Mamba2, Gated DeltaNet) is replaced during the step by its core here.
        self._mamba_modules: dict[int, torch.nn.Module] = {}
        self._linear_modules: dict[int, tuple[Any, Callable[[int, Any, torch.Tensor], Any]]] = {}
        # MLA attention modules replaced whole in layer-forward mode (see the module docstring)
        self._mla_modules: dict[int, Any] = {}
        # attention modules of a model type with a module adapter, replaced in layer-forward
        # mode by the adapter's forward (their own code never calls the hook)
        self._module_adapter = MODULE_ADAPTERS.get(getattr(self.text_config, "model_type", ""))
        self._own_modules: dict[int, Any] = {}
        self._own_checked: set[int] = set()
        self._dt_floor: dict[int, float] = {}
        self._seen: set[int] = set()
        self._seen_linear: set[int] = set()  # layers whose replaced linear mixer ran
        self._positions: torch.Tensor | None = None  # [T] int64 of the running step
        if self.layer_forward:
            _register_hook()
        for i, layer in enumerate(_layers(self.base)):
            if i not in layout.layer_indices:
                self._mixers.append(None)
                continue
            ops = layout.groups_of(i)
            if len(ops) > 1:  # a parallel hybrid's layer: its own forward runs both ops
                self._mixers.append(None)
                self._parallel_ops(i, layer, [g.spec for g in ops])
                continue
            spec = ops[0].spec
            if spec.kind is LayerKind.MLA:
                if self.layer_forward:
                    self._mla_modules[i] = _attention_module(layer)
                self._mixers.append(self._mla)
            elif spec.kind is LayerKind.FULL:
                if self.layer_forward and self._module_adapter is not None:
                    self._own_modules[i] = _attention_module(layer)
                self._mixers.append(self._full)
            elif spec.linear_variant is LinearVariant.GATED_DELTANET:
                self._linear_modules[i] = (layer.linear_attn, self._gdn_core)
                self._mixers.append(self._gdn)
            elif spec.linear_variant is LinearVariant.KDA:
                self._linear_modules[i] = (layer.self_attn, self._kda_core)
                self._mixers.append(self._kda)
            elif spec.linear_variant is LinearVariant.LIGHTNING:
                self._mixers.append(self._lightning)
            elif spec.linear_variant is LinearVariant.SHORT_CONV:
                self._mixers.append(self._short_conv)
            elif spec.linear_variant is LinearVariant.MAMBA2:
                self._add_mamba2(i, layer)
                self._mixers.append(self._mamba2)
            elif spec.linear_variant is LinearVariant.MAMBA1:
                self._mixers.append(self._mamba1)
            else:
                raise ValueError(f"layer {i}: no mixer for {spec.short()}")

    def _add_mamba2(self, i: int, layer: Any) -> None:
        """Layer ``i``'s Mamba2 mixer module (``mamba`` or ``mixer``), run by its core."""
        mx = getattr(layer, "mamba", None) or layer.mixer
        lo, hi = tuple(getattr(mx, "time_step_limit", (0.0, float("inf"))))
        if hi != float("inf") or lo < 0:
            raise ValueError(
                f"layer {i}: time_step_limit=({lo}, {hi}); the binding's Mamba2 inputs "
                "carry no upper dt clamp, expected (lo >= 0, inf)"
            )
        if lo > 0:
            self._dt_floor[i] = _softplus_inverse(float(lo))
        self._mamba_modules[i] = mx
        self._linear_modules[i] = (mx, self._mamba2_core)

    def _parallel_ops(self, i: int, layer: Any, specs: list[Any]) -> None:
        """Layer ``i`` holds an attention op and a linear op side by side (Falcon-H1): its
        decoder layer's own forward runs them, the attention through the hook, the Mamba2
        mixer module replaced by its core; any other pair has no adapter yet."""
        if not self.layer_forward:
            raise ValueError(
                f"layer {i} holds parallel ops ({', '.join(s.short() for s in specs)}); only "
                f"families that run their decoder layers' own forward drive those "
                f"({sorted(LAYER_FORWARD_FAMILIES)}), not {self.layout.family!r}"
            )
        for spec in specs:
            if spec.kind is LayerKind.FULL:
                continue  # the decoder layer's attention module calls the hook
            if spec.linear_variant is LinearVariant.MAMBA2:
                self._add_mamba2(i, layer)
                continue
            raise ValueError(
                f"layer {i}: no adapter for the parallel op {spec.short()} (parallel layers "
                "drive full attention and Mamba2 ops)"
            )

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for the prepared batch.

        :param input_ids: ``[T]`` int64 token ids in batch order (``T = batch.padded_tokens``).
        :param positions: ``[T]`` int64 absolute positions (``batch.positions``).
        :returns: ``[T, vocab]`` logits in the model dtype.
        """
        if self.layout.family in MODEL_FORWARD_FAMILIES:
            return self._forward_model(input_ids, positions)
        if self.layer_forward:
            return self._forward_layers(input_ids, positions)
        embed = getattr(self.base, "embed_tokens", None) or self.base.embeddings
        h = embed(input_ids)[None]  # [1, T, D]
        pes = self._position_embeddings(h, positions)
        for i, layer in enumerate(self.base.layers):
            pe = pes[i]
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
            if hasattr(layer, "operator_norm"):  # LFM2; LFM3's sandwich norms after each part
                post_op = getattr(layer, "post_operator_norm", _identity)
                post_ffn = getattr(layer, "post_ffn_norm", _identity)
                h = h + post_op(mixer(i, layer, layer.operator_norm(h)[0], pe)[None])
                h = h + post_ffn(layer.feed_forward(layer.ffn_norm(h)))
                continue
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
            h = residual + _mlp_out(mlp(norm2(h)))
        norm = (
            getattr(self.base, "norm", None)
            or getattr(self.base, "final_layernorm", None)
            or getattr(self.base, "norm_f", None)  # Mamba / Falcon-Mamba
            or self.base.embedding_norm  # LFM2 names its final norm so
        )
        # a float32 residual (Mamba's residual_in_fp32) goes back to the head's dtype, as HF does
        return self.hf.lm_head(norm(h).to(self.hf.lm_head.weight.dtype))[0]

    def _position_embeddings(self, h: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        """Per layer the rotary ``(cos, sin)`` (None without a rotary embedding). A rotary
        embedding whose forward takes ``layer_type`` (Gemma-3: local and global rope) is
        evaluated once per type of the config's ``layer_types``."""
        n = len(self.base.layers)
        # LFM2-MoE names it pos_emb
        rot = getattr(self.base, "rotary_emb", None) or getattr(self.base, "pos_emb", None)
        if rot is None:
            return [None] * n
        # a rotary module with sections is M-RoPE whatever the config says: Qwen3.5's (before
        # transformers 5.24 it indexes three position rows even without mrope_section)
        if _mrope(self.text_config) or getattr(rot, "mrope_section", None):
            # Qwen2-VL's M-RoPE takes (temporal, height, width) positions [3, 1, T]; a text
            # token has all three equal to its position (transformers' get_rope_index)
            pe = rot(h, positions[None, None].expand(3, 1, -1))
            return [pe] * n
        if "layer_type" not in inspect.signature(rot.forward).parameters:
            pe = rot(h, positions[None])
            return [pe] * n
        types = list(self.text_config.layer_types)
        # a rope per attention type; a layer of another type (a conv) has none
        attention = {t for t in types if t.endswith("attention")}
        by_type = {t: rot(h, positions[None], t) for t in sorted(attention)}
        return [by_type.get(t) for t in types]

    @contextlib.contextmanager
    def _hooked(self) -> Iterator[None]:
        """Within the block the model's attention modules call :func:`_attention_hook`, its
        linear mixer modules run :meth:`_mamba2_core` / :meth:`_gdn_core` / :meth:`_kda_core`
        and its MLA modules :meth:`_mla_core` (returning transformers' ``(output, weights)``);
        afterwards the model is transformers' own again (the reference forward of the same
        module objects is eager)."""
        saved = self.text_config._attn_implementation
        _ACTIVE.append(self)
        self.text_config._attn_implementation = _HOOK_NAME  # what the attention modules read
        tuned = [m for m in self.hf.modules() if _temperature_tuned(m)]
        for m in tuned:  # the hook applies it with the step's positions (module docstring)
            m.attn_temperature_tuning = False
            m._attn_core_temperature = True
        for i, (mx, core) in self._linear_modules.items():
            # an instance attribute shadows the class's forward for nn.Module.__call__
            mx.forward = lambda hidden_states, *_a, _i=i, _mx=mx, _core=core, **_k: self._linear(
                _i, _mx, _core, hidden_states[0]
            )[None]
        for i, at in self._mla_modules.items():
            at.forward = lambda hidden_states, *_a, _i=i, _at=at, **_k: (
                self._mla_core(_i, _at, hidden_states[0], _k.get("position_embeddings"))[None],
                None,
            )
        for i, at in self._own_modules.items():
            at.forward = lambda hidden_states, *_a, _i=i, _at=at, **_k: (
                self._own_attention(_i, _at, hidden_states[0], _k)[None],
                None,
            )
        try:
            yield
        finally:
            for at in self._own_modules.values():
                del at.forward
            for m in tuned:
                m.attn_temperature_tuning = True
                del m._attn_core_temperature
            for mx, _core in self._linear_modules.values():
                del mx.forward
            for at in self._mla_modules.values():
                del at.forward
            self.text_config._attn_implementation = saved
            _ACTIVE.pop()

    def _own_attention(
        self, i: int, at: Any, x: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """A replaced attention module's call (:data:`MODULE_ADAPTERS`): ``x [T, hidden]`` ->
        ``[T, hidden]``, the op through layer ``i``'s binding; on its first call what the
        module computes is checked against the layer's spec."""
        adapter = self._module_adapter
        assert adapter is not None  # only modules of a model type with an adapter are replaced
        spec = self._attention_spec(i)
        if kwargs.get("attention_mask") is not None:  # none is built for the hook's name
            raise ValueError(
                f"layer {i} ({type(at).__name__}): the model passes an attention mask "
                f"{tuple(kwargs['attention_mask'].shape)}: no layer kind describes it"
            )
        if i not in self._own_checked:
            described = {
                "query heads": spec.num_heads,
                "KV heads": spec.num_kv_heads,
                "softmax scale": spec.scale,
                "sliding window": spec.sliding_window,
            }
            _refuse_disagreement(i, at, spec, adapter.computes(at), described, "the module")
            self._own_checked.add(i)
        self._seen.add(i)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty(*q.shape[:2], spec.head_dim_v, dtype=q.dtype, device=q.device)
            return self._attend(i, q.contiguous(), k.contiguous(), v.contiguous(), out)

        return adapter.forward(at, x, kwargs, attend)

    def _linear(self, i: int, mx: Any, core: Any, x: torch.Tensor) -> torch.Tensor:
        """A replaced linear mixer module's call: its core on ``x [T, D]``, recorded as run."""
        self._seen_linear.add(i)
        return core(i, mx, x)

    def _forward_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` through the model's own ``forward`` (hooked attention, no cache):
        ``input_ids [T]`` as one row, ``positions [T]`` as its ``position_ids``."""
        self._seen.clear()
        self._seen_linear.clear()
        self._positions = positions
        with self._hooked():
            out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        self._check_ops_ran()
        return out.logits[0]

    def _check_ops_ran(self) -> None:
        """Every attention layer of the layout called the hook, every linear mixer ran, and no
        other layer did: else the mapping does not describe the model."""
        # by group: a parallel layer is in an attention group and in a linear group
        attention = {
            i
            for g in self.layout.groups
            if g.spec.kind is not LayerKind.LINEAR
            for i in g.layer_indices
        }
        linear = {
            i
            for g in self.layout.groups
            if g.spec.kind is LayerKind.LINEAR
            for i in g.layer_indices
        }
        if self._seen != attention:
            missing = sorted(attention - self._seen)
            layers = _layers(self.base)
            modules = sorted(
                {type(_attention_module(layers[i])).__name__ for i in missing if i < len(layers)}
            )
            # the mapping refuses the model types whose modeling code never uses the interface
            # (hf_config._attention_in_own_code); this names the ones that test cannot see
            raise ValueError(
                f"layers {missing} of the attention layout did not call the attn_core attention "
                f"function (their attention modules {modules} compute attention in their own "
                f"code, not through transformers' attention-function interface, or not at all) "
                f"and layers {sorted(self._seen - attention)} called it without being attention "
                "layers of the layout; the mapping does not describe the model"
            )
        if self._seen_linear != linear:
            raise ValueError(
                f"the linear mixers of layers {sorted(linear - self._seen_linear)} of the layout "
                f"did not run (and those of layers {sorted(self._seen_linear - linear)} ran "
                "without being linear layers of the layout); the mapping does not describe "
                "the model"
            )

    def _forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` through each decoder layer's own ``forward`` (hooked attention)."""
        embed = getattr(self.base, "embed_tokens", None) or self.base.embeddings
        h = embed(input_ids)[None]  # [1, T, D]
        multiplier = getattr(self.base, "embedding_multiplier", None)
        if multiplier is not None:  # Granite: the model scales its embeddings
            h = h * multiplier
        pes = self._position_embeddings(h, positions)
        self._seen.clear()
        self._seen_linear.clear()
        self._positions = positions
        with self._hooked():
            for i, layer in enumerate(self.base.layers):
                kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions[None]}
                if pes[i] is not None:
                    kwargs["position_embeddings"] = pes[i]
                out = layer(h, **kwargs)
                h = out[0] if isinstance(out, tuple) else out
        self._check_ops_ran()
        norm = (
            getattr(self.base, "norm", None)
            or getattr(self.base, "final_layernorm", None)  # Falcon-H1
            or self.base.norm_f
        )
        logits = self.hf.lm_head(norm(h))[0]
        head_multiplier = getattr(self.base, "lm_head_multiplier", None)
        if head_multiplier is not None:  # as FalconH1ForCausalLM: logits times the multiplier
            logits = logits * head_multiplier
        # The top-level config, as the model class reads it: Gemma3ForCausalLM caps its logits,
        # Gemma3ForConditionalGeneration (whose config has no such field) does not.
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # as Gemma3ForCausalLM: tanh soft-cap on the final logits
            logits = torch.tanh(logits / cap) * cap
        scaling = getattr(self.config, "logits_scaling", None)
        if scaling is not None:  # as Granite's *ForCausalLM: logits divided by logits_scaling
            logits = logits / scaling
        return logits

    def _hooked_attention(
        self,
        module: Any,  # the transformers attention module (layer_idx, head_dim, maybe sinks)
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """The attention op of layer ``module.layer_idx`` through its binding, after checking
        that what transformers asks for is what the layer's spec describes.

        :param query: ``[1, H, T, D]``; ``key`` / ``value`` ``[1, Hkv, T, D|Dv]``.
        :returns: ``[1, T, H, Dv]``.
        """
        i = int(module.layer_idx)
        spec = self._attention_spec(i)
        mask = kwargs.get("attention_mask")
        if mask is not None:  # the adapter passes none and transformers builds none for the hook
            raise ValueError(
                f"layer {i} ({type(module).__name__}): the module passes its own attention mask "
                f"or bias {tuple(mask.shape)} (ALiBi, a prefix or bidirectional mask, ...): no "
                f"layer kind describes it"
            )
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = module.head_dim**-0.5
        config = getattr(module, "config", self.text_config)
        types = getattr(config, "layer_types", None)
        chunked = types is not None and types[i] == "chunked_attention"
        asked = {
            "softmax scale": float(scaling),
            # a module that leaves the window to its mask (Qwen2-MoE) holds it as an attribute
            "sliding window": kwargs.get("sliding_window", getattr(module, "sliding_window", None)),
            "attention chunk size": config.attention_chunk_size if chunked else None,
            "logits soft-cap": kwargs.get("softcap"),
            "sinks": getattr(module, "sinks", None) is not None,
            "dropout": float(kwargs.get("dropout") or 0.0),
            "causal mask": bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
        }
        described = {
            "softmax scale": spec.scale,
            "sliding window": spec.sliding_window,
            "attention chunk size": spec.attention_chunk_size,
            "logits soft-cap": spec.logits_soft_cap,
            "sinks": spec.has_sinks,
            "dropout": 0.0,
            "causal mask": spec.causal,
        }
        _refuse_disagreement(i, module, spec, asked, described, "transformers")
        self._seen.add(i)
        if getattr(module, "_attn_core_temperature", False):
            query = self._temperature_scaled(module, query)
        T = query.shape[2]
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        out = torch.empty(T, spec.num_heads, spec.head_dim_v, dtype=q.dtype, device=q.device)
        self._attend(i, q, k, v, out, op=spec.kind)
        return out[None]

    def _attention_spec(self, i: int) -> Any:
        """The spec of layer ``i``'s attention op (of a parallel layer: the non-linear one)."""
        groups = self.layout.groups_of(i) if i in self.layout.layer_indices else ()
        specs = [g.spec for g in groups if g.spec.kind is not LayerKind.LINEAR]
        if not specs:
            raise ValueError(f"layer {i}: transformers calls attention, the layout has none")
        return specs[0]

    def _temperature_scaled(self, module: Any, query: torch.Tensor) -> torch.Tensor:
        """``query [1, H, T, D]`` times Llama-4's NoPE-layer factor of each token's position,
        computed as ``Llama4TextAttention.forward`` does (float32, then the query dtype)."""
        if self._positions is None or self._positions.shape[0] != query.shape[2]:
            raise ValueError(
                f"layer {module.layer_idx}: the temperature-tuned query scale needs the step's "
                f"positions for {query.shape[2]} tokens"
            )
        pos = self._positions.to(query.device).float()
        scales = torch.log1p(torch.floor((pos + 1.0) / module.floor_scale)) * module.attn_scale
        return (query * (scales + 1.0).view(1, 1, -1, 1)).to(query.dtype)

    # -- attention calls: through the binding, or straight into the group's context -----------
    def _attend(self, i: int, q, k, v, out, *, op: LayerKind | None = None, **inputs):
        """Layer ``i``'s op through its binding; ``op`` picks one of a parallel layer's ops
        (its kind; None: the layer's only op)."""
        binding = self.runtime.binding(i, op)
        if self.direct:
            group = binding._group
            result = group.forward(binding, q, k, v, out, **inputs)
            if result is not out:
                out.copy_(result)
            return out
        return binding.forward(q, k, v, out=out, **inputs)

    def _conv(self, i: int, x, weight, bias, activation) -> torch.Tensor:
        binding = self.runtime.binding(i, LayerKind.LINEAR)  # only linear ops have a conv
        if self.direct:
            return binding._group.context.conv1d(binding, x, weight, bias, activation=activation)
        return binding.conv1d(x, weight, bias, activation=activation)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, pe, *, interleave: bool = False):
        """``q [T, H, D]``, ``k [T, Hk, D]`` through the modeling module's rotary function.

        ``pe`` is ``(cos, sin)``, or DeepSeek-V2's complex ``freqs_cis [1, T, D / 2]`` (its
        ``apply_rotary_emb`` rotates interleaved pairs; V2 has no ``rope_interleave`` field)."""
        if isinstance(pe, torch.Tensor):
            q4, k4 = self.modeling.apply_rotary_emb(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], pe
            )
            return q4[0].transpose(0, 1), k4[0].transpose(0, 1)
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
        if pe is not None:  # None: the model has no rotary embedding at all (Jamba)
            q, k = self._rope(q, k, pe)
        out = torch.empty(T, spec.num_heads, spec.head_dim_v, dtype=x.dtype, device=x.device)
        self._attend(i, q.contiguous(), k.contiguous(), v.contiguous(), out)
        head_gate = getattr(at, "g_proj", None)
        if head_gate is not None:  # LFM3: one sigmoid gate per head, from the layer's input
            out = out * torch.sigmoid(head_gate(x)).unsqueeze(-1)
        o = out.reshape(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return (at.o_proj if hasattr(at, "o_proj") else at.out_proj)(o)

    def _mla(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        return self._mla_core(i, layer.self_attn, x, pe)

    def _mla_core(self, i: int, at: Any, x: torch.Tensor, pe) -> torch.Tensor:
        """The MLA module ``at`` of layer ``i`` on ``x [T, D]`` -> ``[T, D]`` (absorbed form).

        ``pe`` None: the model has no rotary embedding (Kimi-Linear's NoPE MLA), the rope part
        of q and of the shared key goes in as projected."""
        spec = self.layout.spec_of(i)
        T, H = x.shape[0], spec.num_heads
        R, P, Dn = spec.mla_dims
        self._seen.add(i)
        if i not in self._mla_weights:
            scaling = getattr(at, "scaling", None)
            if scaling is not None and not math.isclose(scaling, spec.scale, rel_tol=1e-6):
                raise ValueError(
                    f"layer {i} ({type(at).__name__}): transformers computes softmax scale "
                    f"{scaling!r}, the layer's spec ({spec.short()}) describes {spec.scale!r}"
                )
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
        k_rot = k_rot.view(T, 1, P)
        if pe is not None:
            q_rot, k_rot = self._rope(
                q_rot,
                k_rot,
                pe,
                interleave=bool(getattr(self.config, "rope_interleave", False)),
            )
        q_abs = torch.cat([mla_absorb_query(q_nope, w_uk), q_rot], dim=-1)
        latent = torch.cat([c, k_rot[:, 0]], dim=-1)
        o_lat = torch.empty(T, H, R, dtype=x.dtype, device=x.device)
        self._attend(i, q_abs.contiguous(), latent.contiguous(), None, o_lat)
        return at.o_proj(mla_output_from_latent(o_lat, w_uv).reshape(T, -1))

    def _gdn(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        return self._gdn_core(i, layer.linear_attn, x)

    def _gdn_core(self, i: int, la: Any, x: torch.Tensor) -> torch.Tensor:
        """The Gated DeltaNet mixer ``la`` of layer ``i`` on ``x [T, D]`` -> ``[T, D]``.

        Qwen3-Next projects q|k|v|z and b|a per key-head group (``in_proj_qkvz``,
        ``in_proj_ba``, reordered by ``fix_query_key_value_ordering``); Qwen3.5 has one
        projection each (``in_proj_qkv`` already in conv order, ``in_proj_z``, ``_b``, ``_a``);
        OLMo-Hybrid one per q, k, v, gate, b and a, beta doubled under ``allow_neg_eigval``,
        its gated norm ``o_norm`` and ``o_proj``."""
        T = x.shape[0]
        if hasattr(la, "g_proj"):  # OLMo-Hybrid
            mixed = torch.cat([la.q_proj(x), la.k_proj(x), la.v_proj(x)], dim=-1)
            z = la.g_proj(x)
            b, a = la.b_proj(x)[None], la.a_proj(x)[None]
        elif hasattr(la, "in_proj_qkv"):
            mixed = la.in_proj_qkv(x)
            z = la.in_proj_z(x).reshape(1, T, -1, la.head_v_dim)
            b, a = la.in_proj_b(x)[None], la.in_proj_a(x)[None]
        else:
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
        if getattr(la, "allow_neg_eigval", False):  # beta in [0, 2]
            beta = beta * 2.0
        g = -la.A_log.float().exp() * F.softplus(a[0].float() + la.dt_bias)
        out = torch.empty(T, la.num_v_heads, la.head_v_dim, dtype=x.dtype, device=x.device)
        self._attend(i, q, k, v, out, g=g, beta=beta)
        norm = getattr(la, "norm", None) or la.o_norm
        o = norm(out.reshape(-1, la.head_v_dim), z.reshape(-1, la.head_v_dim))
        return (getattr(la, "out_proj", None) or la.o_proj)(o.reshape(T, -1))

    def _kda(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        return self._kda_core(i, layer.self_attn, x)

    def _kda_core(self, i: int, la: Any, x: torch.Tensor) -> torch.Tensor:
        """Kimi-Linear's KDA mixer ``la`` of layer ``i`` on ``x [T, D]`` -> ``[T, D]``.

        q, k, v ``[T, H, D]`` after the conv (silu) over q|k|v; ``g [T, H, D]`` float32 from
        the module's own ``forget_gate``; ``beta [T, H]``. The core's output ``[T, H, D]`` goes
        through ``o_norm`` (RMSNorm times ``sigmoid(g_b(g_a(x)))``) and ``o_proj``."""
        T, H, D = x.shape[0], la.num_heads, la.head_dim
        mixed = torch.cat([la.q_proj(x), la.k_proj(x), la.v_proj(x)], dim=-1)
        mixed = self._conv(i, mixed, la.conv1d.weight.squeeze(1), la.conv1d.bias, la.activation)
        q, k, v = (t.reshape(T, H, D).contiguous() for t in mixed.split(la.qkv_dim, dim=-1))
        g = la.forget_gate(x[None])[0].contiguous()  # float32, <= 0
        beta = torch.sigmoid(la.b_proj(x))
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        self._attend(i, q, k, v, out, g=g, beta=beta)
        gate = la.g_b_proj(la.g_a_proj(x)).view(T, H, D)
        return la.o_proj(la.o_norm(out, gate).reshape(T, -1))

    def _mamba2(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        return self._mamba2_core(i, self._mamba_modules[i], x)

    def _mamba2_core(self, i: int, mx: Any, x: torch.Tensor) -> torch.Tensor:
        """The Mamba2 mixer ``mx`` of layer ``i`` on ``x [T, D]`` -> ``[T, D]``."""
        T = x.shape[0]
        G, N = mx.n_groups, mx.ssm_state_size
        scale_in = getattr(mx, "ssm_in_multiplier", None)
        if scale_in is not None:  # Falcon-H1: the mixer's input scaled first
            x = x * scale_in
        projected = mx.in_proj(x)
        mup = getattr(mx, "mup_vector", None)
        if mup is not None:  # Falcon-H1: z|x|B|C|dt times the muP vector [1, 1, P]
            projected = projected * mup.reshape(-1)
        gate, xbc, dt = projected.split([mx.intermediate_size, mx.conv_dim, mx.num_heads], dim=-1)
        floor = self._dt_floor.get(i)
        if floor is not None:  # softplus(dt + dt_bias) >= time_step_limit[0], exactly
            dt = torch.maximum(dt.float(), floor - mx.dt_bias.float()).to(dt.dtype)
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
            op=LayerKind.LINEAR,
            dt=dt.contiguous(),
            A_log=mx.A_log,
            D=mx.D,
            dt_bias=mx.dt_bias,
        )
        if getattr(mx, "mamba_rms_norm", True):  # gated RMSNorm (Falcon-H1: optional)
            o = mx.norm(y.view(T, -1), gate)
        else:  # Falcon-H1 without mamba_rms_norm: the plain silu(z) gate
            o = y.view(T, -1) * F.silu(gate)
        return mx.out_proj(o.to(x.dtype))

    def _lightning(self, i: int, layer, x: torch.Tensor, pe) -> torch.Tensor:
        at = layer.self_attn
        spec = self.layout.spec_of(i)
        T, H, D = x.shape[0], spec.num_heads, spec.head_dim
        q, k, v = torch.split(at.act_fn(at.qkv_proj(x)).view(T, H, 3 * D), D, dim=-1)
        slope = self._slopes.get(i)
        if slope is None:
            # ALiBi-style per-head rates scaled by the layer's depth, from the module's own
            # function in float32 (its slope_rate buffer is rounded to the model dtype)
            slope = lightning_slopes(at, x.device).reshape(-1)
            if slope.shape[0] != H:
                # a tensor-parallel rank holds a slice of the heads and needs its slice of
                # the slopes: the module must give them (tp_shard makes get_slope_rate do so)
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
