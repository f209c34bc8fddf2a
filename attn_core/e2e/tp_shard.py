"""Shard a tiny transformers model's attention and linear mixers over tensor-parallel ranks.

Every rank builds the same model (same seed) and keeps its slice of the heads, in place, the way
a server's column / row parallel layers would hold them (Megatron / vLLM):

- column parallel (this rank's output rows): q / k / v projections (or a fused ``qkv_proj``), a
  gated query's gate, MLA's per-head ``q_b_proj`` / ``kv_b_proj``, linear mixers' input
  projections, convs, decay / gate parameters (``A_log``, ``dt_bias``, ``D``, slopes) and sinks;
- row parallel (this rank's input columns, summed over ranks by ``all_reduce``, bias added once
  after the sum): ``o_proj`` / ``out_proj`` and Mamba1's ``x_proj`` (its dt | B | C mix every
  inner channel);
- replicated: everything shared by all heads (MLA's latent projections, Mamba1's dt / B / C
  norms, MLPs and MoE blocks, embeddings, ``lm_head``).

The encoder stacks (:data:`~attn_core.e2e.configs.ENCODER_MODELS`: the SigLIP and Qwen2-VL /
Qwen2.5-VL vision towers, Whisper's encoder) shard their blocks' attention the same way
(:func:`_shard_encoder_attention`): q / k / v (Qwen-VL's fused ``qkv``) column parallel with
their biases, ``proj`` / ``out_proj`` row parallel; patch embeddings, convolutions, rotary,
norms, MLPs and mergers stay replicated.

Heads are split when there are at least ``world`` of them; KV heads, Gated DeltaNet key heads
and Mamba2 groups fewer than ``world`` are replicated, rank ``r`` keeping head
``r * heads // world``, exactly as ``specs_from_hf_config`` sizes them
(``_split_or_replicate``). A norm over all heads of a layer
(OLMo-2's q / k norms, MiniMax's lightning output norm) becomes :class:`ShardedRMSNorm`, and
Mamba2's gated norm over a group split between ranks :class:`ShardedGatedGroupRMSNorm`: their
sums of squares are all-reduced, so the math is the unsharded norm's. Anything that cannot be
split without changing the math raises ``ValueError`` naming the layer, the module, the field
and the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from attn_core.e2e.adapters import _attention_module, _decoder, _layers
from attn_core.e2e.configs import TinyModel
from attn_core.specs import LayerKind, LayerSpec, LinearVariant

__all__ = [
    "AllReduceLinear",
    "ShardedGatedGroupRMSNorm",
    "ShardedRMSNorm",
    "head_indices",
    "shard_model",
]


class AllReduceLinear(torch.nn.Module):
    """A row-parallel linear: ``x [..., in / world] @ weight.T`` summed over ranks, plus the
    full bias on every rank (after the sum, so each rank holds the same output)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class ShardedRMSNorm(torch.nn.Module):
    """An RMSNorm over a last dimension that is split over ranks: ``x [..., full / world]``
    normalised by the root mean square of the whole (unsharded) row.

    :param weight: this rank's slice of the norm's weight ``[full / world]``.
    :param full_dim: the unsharded row length (``world * local`` also when the heads are
        replicated: each rank's copy then counts once per copy, in the sum and in the length).
    :param weight_after_cast: OLMo-2 multiplies by the weight before casting back to the input
        dtype, Llama-style norms (MiniMax's) after; kept so half precision rounds alike.
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, full_dim: int, *, weight_after_cast: bool
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.variance_epsilon = eps
        self.full_dim = full_dim
        self.weight_after_cast = weight_after_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        sq = h.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(sq)
        h = h * torch.rsqrt(sq / self.full_dim + self.variance_epsilon)
        if self.weight_after_cast:
            return self.weight * h.to(dtype)
        return (self.weight * h).to(dtype)


class ShardedGatedGroupRMSNorm(torch.nn.Module):
    """Mamba2's gated RMSNorm (``x * silu(gate)``, normalised per group of ``group_size``
    channels, times the weight) when the rank holds only part of one group: fewer groups than
    ranks. Each rank's sum of squares goes into its group's entry of a ``[..., groups]``
    vector that is all-reduced, so ranks sharing a group add up exactly its channels.

    :param weight: this rank's channels of the norm's weight ``[intermediate / world]``.
    :param group: the group this rank's channels belong to; ``groups``: how many there are.
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, group_size: int, group: int, groups: int
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.variance_epsilon = eps
        self.group_size, self.group, self.groups = group_size, group, groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., C]`` (``gate`` the same shape) -> ``[..., C]`` in ``x``'s dtype."""
        dtype = x.dtype
        h = x.float()
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.float())
        sq = h.new_zeros(*h.shape[:-1], self.groups)
        sq[..., self.group] = h.pow(2).sum(-1)
        dist.all_reduce(sq)
        variance = sq[..., self.group : self.group + 1] / self.group_size
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)


class _RankConfig:
    """A module's config with some fields per rank (Phi-3's attention splits its fused
    ``qkv_proj`` at ``config.num_attention_heads * head_dim``); every other attribute reads
    through to the shared config, live (the adapter switches its attention implementation)."""

    def __init__(self, base: Any, **override: Any) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_override", override)

    def __getattr__(self, name: str) -> Any:
        override = object.__getattribute__(self, "_override")
        if name in override:
            return override[name]
        return getattr(object.__getattribute__(self, "_base"), name)


def head_indices(
    segments: Sequence[tuple[int, int]], rank: int, world: int, *, where: str
) -> torch.Tensor:
    """The indices rank ``rank`` keeps of a dimension made of consecutive segments.

    :param segments: ``(size, heads)`` per segment, in order (e.g. q, k, v of a fused
        projection); a segment is ``heads`` equal blocks of ``size / heads``.
    :returns: ``[kept]`` int64: the rank's ``heads / world`` consecutive blocks of every
        segment, or, with fewer heads than ranks, block ``rank * heads // world`` (replicated).
    :raises ValueError: a head count that neither splits nor replicates evenly (``where``
        names the layer, module and field).
    """
    parts: list[torch.Tensor] = []
    offset = 0
    for size, heads in segments:
        if heads <= 0 or size % heads:
            raise ValueError(f"{where}: {size} rows are not {heads} equal heads")
        if heads >= world and heads % world:
            raise ValueError(f"{where}: {heads} heads do not split over tp {world}")
        if heads < world and world % heads:
            raise ValueError(
                f"{where}: {heads} heads are fewer than tp {world} and do not replicate evenly"
            )
        block = size // heads
        count = max(heads // world, 1)
        start = rank * heads // world if heads < world else rank * count
        parts.append(torch.arange(offset + start * block, offset + (start + count) * block))
        offset += size
    return torch.cat(parts)


def _rows(linear: torch.nn.Linear, idx: torch.Tensor) -> torch.nn.Linear:
    """Column parallel: ``linear`` keeping output rows ``idx``."""
    w = linear.weight
    out = torch.nn.Linear(linear.in_features, idx.numel(), bias=linear.bias is not None)
    out = out.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w.index_select(0, idx.to(w.device)))
        if linear.bias is not None:
            out.bias.copy_(linear.bias.index_select(0, idx.to(w.device)))
    return out


def _columns(linear: torch.nn.Linear, idx: torch.Tensor) -> AllReduceLinear:
    """Row parallel: ``linear`` keeping input columns ``idx``, outputs summed over ranks."""
    w = linear.weight
    return AllReduceLinear(w.index_select(1, idx.to(w.device)), linear.bias)


def _param(p: torch.Tensor, idx: torch.Tensor, dim: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(p.index_select(dim, idx.to(p.device)).contiguous(), False)


def _conv(conv: torch.nn.Conv1d, idx: torch.Tensor) -> None:
    """A depthwise conv keeping channels ``idx`` (in place)."""
    conv.weight = _param(conv.weight, idx)
    if conv.bias is not None:
        conv.bias = _param(conv.bias, idx)
    conv.in_channels = conv.out_channels = conv.groups = idx.numel()


def _segments(heads: int, block: int) -> list[tuple[int, int]]:
    return [(heads * block, heads)]


@torch.no_grad()
def shard_model(model: TinyModel, rank: int, world: int) -> None:
    """Keep rank ``rank``'s heads of every attention and linear-mixer layer (in place).

    ``model.layout`` must have been parsed with ``tp_size=world``: its specs give the heads
    per rank, the module weights the totals.

    :raises ValueError: a layer kind that has no sharding, or heads that do not split
        (the message names the layer, the module and the sizes).
    """
    if model.layout.tp_size != world:
        raise ValueError(
            f"{model.name}: the layout is for tp {model.layout.tp_size}, sharding for {world}"
        )
    if model.is_encoder:
        _shard_encoder(model, rank, world)
        return
    layers = _layers(_decoder(model.hf))  # most: layers; GPT-2: h; OPT: decoder.layers
    # op by op: a parallel hybrid's layer (Falcon-H1) holds an attention and a linear op
    ops = sorted(
        ((i, g.spec) for g in model.layout.groups for i in g.layer_indices), key=lambda o: o[0]
    )
    for i, spec in ops:
        layer = layers[i]
        where = f"{model.name} layer {i}"
        if spec.kind is LayerKind.FULL:
            # Nemotron-H's blocks hold every mixer, attention too, as .mixer
            at = getattr(layer, "mixer", None) or _attention_module(layer)
            _shard_full(at, spec, rank, world, where)
        elif spec.kind is LayerKind.MLA:
            _shard_mla(layer.self_attn, spec, rank, world, where)
        elif spec.linear_variant is LinearVariant.GATED_DELTANET:
            _shard_gdn(layer.linear_attn, rank, world, where)
        elif spec.linear_variant is LinearVariant.KDA:
            _shard_kda(layer.self_attn, rank, world, where)
        elif spec.linear_variant is LinearVariant.MAMBA2:
            _shard_mamba2(getattr(layer, "mamba", None) or layer.mixer, rank, world, where)
        elif spec.linear_variant is LinearVariant.MAMBA1:
            _shard_mamba1(getattr(layer, "mixer", None) or layer.mamba, rank, world, where)
        elif spec.linear_variant is LinearVariant.LIGHTNING:
            _shard_lightning(layer.self_attn, spec, rank, world, where)
        elif spec.linear_variant is LinearVariant.SHORT_CONV:
            _shard_short_conv(layer.conv, rank, world, where)
        else:
            raise ValueError(f"{where}: no tensor-parallel sharding for {spec.short()}")


def _encoder_attentions(model: TinyModel) -> list[Any]:
    """Every block's attention module of an encoder stack, in block order: the Qwen towers'
    ``blocks[i].attn``, SigLIP's ``encoder.layers[i].self_attn``, Whisper's
    ``layers[i].self_attn`` (the modules :class:`~attn_core.e2e.vision.VisionRunner` calls)."""
    hf: Any = model.hf  # a transformers tower: attributes by architecture
    blocks = getattr(hf, "blocks", None)
    if blocks is not None:
        return [blk.attn for blk in blocks]
    encoder = getattr(hf, "encoder", None)  # SigLIP; Whisper's encoder holds .layers itself
    layers: Any = hf.layers if encoder is None else encoder.layers
    return [layer.self_attn for layer in layers]


def _shard_encoder(model: TinyModel, rank: int, world: int) -> None:
    """An encoder stack's blocks: every layer of the layout's encoder group is one block whose
    attention :func:`_shard_encoder_attention` shards."""
    attentions = _encoder_attentions(model)
    for group in model.layout.groups:
        for i in group.layer_indices:
            spec = group.spec
            where = f"{model.name} layer {i}"
            if spec.kind is not LayerKind.ENCODER:
                raise ValueError(f"{where}: no tensor-parallel sharding for {spec.short()}")
            _shard_encoder_attention(attentions[i], spec, rank, world, where)


def _shard_encoder_attention(at: Any, spec: LayerSpec, rank: int, world: int, where: str) -> None:
    """A bidirectional encoder block's attention (``num_heads`` of ``head_dim``, as many K / V
    heads as query heads): the Qwen-VL towers' fused ``qkv`` (``[3 * H * D]`` rows, q | k | v,
    with a bias) keeps this rank's heads of each third, SigLIP's and Whisper's ``q_proj`` /
    ``k_proj`` / ``v_proj`` theirs (biases with them; Whisper's ``k_proj`` has none), and the
    output projection (``proj`` / ``out_proj``) is row parallel, its bias added once after the
    all-reduce (:class:`AllReduceLinear`). ``num_heads`` / ``embed_dim`` become the rank's, the
    sizes the runner views q / k / v with."""
    H, D = spec.num_heads * world, spec.head_dim
    where = f"{where} ({type(at).__name__}) num_heads"
    if at.num_heads != H or at.head_dim != D:
        raise ValueError(
            f"{where}: the layout's {H} heads of {D} (tp {world}), the module has "
            f"{at.num_heads} heads of {at.head_dim}"
        )
    heads = head_indices(_segments(H, D), rank, world, where=where)
    if hasattr(at, "qkv"):  # Qwen2-VL / Qwen2.5-VL: one projection, q | k | v
        at.qkv = _rows(at.qkv, head_indices(_segments(H, D) * 3, rank, world, where=where))
        at.proj = _columns(at.proj, heads)
    else:  # SigLIP, Whisper
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(at, name, _rows(getattr(at, name), heads))
        at.out_proj = _columns(at.out_proj, heads)
        at.embed_dim = spec.num_heads * D
    if hasattr(at, "dim"):
        at.dim = spec.num_heads * D
    at.num_heads = spec.num_heads


def _shard_full(at: Any, spec: LayerSpec, rank: int, world: int, where: str) -> None:
    """q / k / v (fused or not; Qwen3-Next's query carries its gate per head) and an output
    gate projection (``g_proj``: Laguna, LFM3; ``gate_proj``: AFMoE) column parallel, the
    output projection (``o_proj``, ``out_proj`` or ``dense``) row parallel, sinks,
    whole-projection q / k norms and StableLM's per-head norm modules per head, and the
    module's own head counts set to the rank's; any other projection layout is refused."""
    D, Dv, H = spec.head_dim, spec.head_dim_v, spec.num_heads * world
    where = f"{where} ({type(at).__name__})"
    if hasattr(at, "qkv_proj"):  # Phi-3: one projection, q | k | v
        q_rows = H * D
        kv_rows = (at.qkv_proj.out_features - q_rows) // 2
        Hkv = kv_rows // D
        segs = [(q_rows, H), (kv_rows, Hkv), (kv_rows * Dv // D, Hkv)]
        qkv_where = f"{where} qkv_proj heads"
        at.qkv_proj = _rows(at.qkv_proj, head_indices(segs, rank, world, where=qkv_where))
    elif all(isinstance(getattr(at, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj")):
        q_rows = at.q_proj.out_features  # Qwen3-Next: [q | gate] per head, 2 * D rows each
        Hkv = at.k_proj.out_features // D
        q_where = f"{where} num_attention_heads"
        at.q_proj = _rows(at.q_proj, head_indices([(q_rows, H)], rank, world, where=q_where))
        kv = head_indices(_segments(Hkv, D), rank, world, where=f"{where} num_key_value_heads")
        at.k_proj = _rows(at.k_proj, kv)
        vv = head_indices(_segments(Hkv, Dv), rank, world, where=f"{where} num_key_value_heads")
        at.v_proj = _rows(at.v_proj, vv)
    else:  # GPT-2's Conv1D c_attn, GPT-NeoX's interleaved query_key_value, JetMoE's experts
        raise ValueError(
            f"{where}: no tensor-parallel sharding for this attention module (expected "
            "q_proj / k_proj / v_proj or a fused qkv_proj)"
        )
    local_kv = max(Hkv // world, 1)
    if hasattr(at, "qkv_proj"):  # Phi-3 splits its fused output by the config's head counts
        at.config = _RankConfig(
            at.config, num_attention_heads=spec.num_heads, num_key_value_heads=local_kv
        )
    for name, heads in (("q_norm", H), ("k_norm", Hkv)):
        norm = getattr(at, name, None)
        weight = getattr(norm, "weight", None)
        if norm is None or weight is None or weight.numel() == D:
            continue  # per head (Qwen3, Gemma-3) or none (Llama-4's weightless L2 norm)
        if weight.numel() != heads * D:
            raise ValueError(
                f"{where}: {name} has {weight.numel()} weights, expected {D} or {heads} heads * {D}"
            )
        idx = head_indices(_segments(heads, D), rank, world, where=f"{where} {name}")
        local = idx.numel()
        setattr(
            at,
            name,
            ShardedRMSNorm(
                weight[idx], norm.variance_epsilon, local * world, weight_after_cast=False
            ),
        )
    if getattr(at, "sinks", None) is not None:  # gpt-oss: one sink logit per query head
        at.sinks = _param(at.sinks, head_indices([(H, H)], rank, world, where=f"{where} sinks"))
    for name in ("g_proj", "gate_proj"):  # an output gate after the op, from the layer's input
        gate = getattr(at, name, None)  # Laguna, LFM3: one per head; AFMoE: one per channel
        if not isinstance(gate, torch.nn.Linear):
            continue
        if gate.out_features not in (H, H * Dv):
            raise ValueError(
                f"{where}: {name} has {gate.out_features} outputs, expected {H} heads or "
                f"{H} heads * {Dv}"
            )
        per = _segments(H, gate.out_features // H)
        setattr(at, name, _rows(gate, head_indices(per, rank, world, where=f"{where} {name}")))
    # modules that view their projections by their own head counts (StableLM) get the rank's
    for attr, local in (("num_heads", spec.num_heads), ("num_key_value_heads", local_kv)):
        if isinstance(getattr(at, attr, None), int):
            setattr(at, attr, local)
    for name, heads in (("q_layernorm", H), ("k_layernorm", Hkv)):  # StableLM: a norm per head
        norms = getattr(getattr(at, name, None), "norms", None)
        if isinstance(norms, torch.nn.ModuleList) and len(norms) == heads:
            keep = head_indices([(heads, heads)], rank, world, where=f"{where} {name}")
            per_head = getattr(at, name)
            per_head.norms = torch.nn.ModuleList(norms[int(h)] for h in keep)
            per_head.num_heads = len(per_head.norms)
    out_name = next((n for n in ("o_proj", "out_proj", "dense") if hasattr(at, n)), None)
    if out_name is None:
        raise ValueError(f"{where}: no output projection (o_proj, out_proj or dense) to split")
    out = getattr(at, out_name)
    cols = head_indices(_segments(H, Dv), rank, world, where=f"{where} {out_name}")
    setattr(at, out_name, _columns(out, cols))


def _shard_mla(at: Any, spec: LayerSpec, rank: int, world: int, where: str) -> None:
    """MLA: the per-head query and ``kv_b_proj`` rows, ``o_proj`` columns; the latent
    projections (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) are shared."""
    _, P, Dn = spec.mla_dims
    H, Dv = spec.num_heads * world, at.v_head_dim
    where = f"{where} ({type(at).__name__}) num_attention_heads"
    q_name = "q_proj" if at.q_lora_rank is None else "q_b_proj"
    q_idx = head_indices(_segments(H, Dn + P), rank, world, where=where)
    setattr(at, q_name, _rows(getattr(at, q_name), q_idx))
    at.kv_b_proj = _rows(
        at.kv_b_proj, head_indices(_segments(H, Dn + Dv), rank, world, where=where)
    )
    at.o_proj = _columns(at.o_proj, head_indices(_segments(H, Dv), rank, world, where=where))
    if hasattr(at, "num_heads"):
        at.num_heads = spec.num_heads


def _grouped_rows(
    Hk: int,
    Hv: int,
    k_parts: Sequence[int],
    v_parts: Sequence[int],
    rank: int,
    world: int,
    where: str,
) -> torch.Tensor:
    """Rows rank ``rank`` keeps of Qwen3-Next's key-head-grouped projections.

    Each of the ``Hk`` blocks holds its key head's parts (``k_parts``: q, k rows) once, then,
    per value part (``v_parts``: v, z rows, or b, a), that part of each of its ``Hv / Hk``
    value heads. The rank keeps, in that order, its key heads' parts and its value heads'
    (a key head shared by ranks, fewer key heads than ranks, is kept by each of them), which
    is the layout ``fix_query_key_value_ordering`` reads with the rank's head counts.
    """
    r = Hv // Hk
    keys = head_indices([(Hk, Hk)], rank, world, where=f"{where} linear_num_key_heads").tolist()
    values = head_indices([(Hv, Hv)], rank, world, where=f"{where} linear_num_value_heads")
    block = sum(k_parts) + r * sum(v_parts)
    rows: list[int] = []
    for g in keys:
        offset = g * block
        for p in k_parts:
            rows.extend(range(offset, offset + p))
            offset += p
        mine = [j - g * r for j in values.tolist() if j // r == g]
        for p in v_parts:
            for local in mine:
                rows.extend(range(offset + local * p, offset + (local + 1) * p))
            offset += r * p
    return torch.tensor(rows)


def _shard_gdn(la: Any, rank: int, world: int, where: str) -> None:
    """Gated DeltaNet: value heads split; key heads split, or replicated below ``world`` (a
    value head ``j`` reads key head ``j // (Hv / Hk)``, on the same rank). Qwen3-Next's
    ``in_proj_qkvz`` / ``in_proj_ba`` are grouped by key head (:func:`_grouped_rows`);
    Qwen3.5's separate projections and every conv split by their own heads."""
    Hk, Hv, Dk, Dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    where = f"{where} ({type(la).__name__})"
    k_where = f"{where} linear_num_key_heads"
    v_where = f"{where} linear_num_value_heads"
    if Hv % Hk:
        raise ValueError(f"{where}: {Hv} value heads are not a multiple of {Hk} key heads")
    conv = [(Hk * Dk, Hk), (Hk * Dk, Hk), (Hv * Dv, Hv)]
    if hasattr(la, "in_proj_qkv"):  # Qwen3.5
        la.in_proj_qkv = _rows(la.in_proj_qkv, head_indices(conv, rank, world, where=k_where))
        la.in_proj_z = _rows(
            la.in_proj_z, head_indices(_segments(Hv, Dv), rank, world, where=v_where)
        )
        heads = head_indices([(Hv, Hv)], rank, world, where=v_where)
        la.in_proj_b, la.in_proj_a = _rows(la.in_proj_b, heads), _rows(la.in_proj_a, heads)
    else:  # Qwen3-Next: one block per key head
        qkvz = _grouped_rows(Hk, Hv, [Dk, Dk], [Dv, Dv], rank, world, where)
        la.in_proj_qkvz = _rows(la.in_proj_qkvz, qkvz)
        la.in_proj_ba = _rows(la.in_proj_ba, _grouped_rows(Hk, Hv, [], [1, 1], rank, world, where))
    _conv(la.conv1d, head_indices(conv, rank, world, where=k_where))
    heads = head_indices([(Hv, Hv)], rank, world, where=v_where)
    la.A_log, la.dt_bias = _param(la.A_log, heads), _param(la.dt_bias, heads)
    la.out_proj = _columns(la.out_proj, head_indices(_segments(Hv, Dv), rank, world, where=v_where))
    la.num_k_heads, la.num_v_heads = max(Hk // world, 1), Hv // world
    la.key_dim, la.value_dim = la.num_k_heads * Dk, la.num_v_heads * Dv
    la.conv_dim = 2 * la.key_dim + la.value_dim


def _shard_kda(la: Any, rank: int, world: int, where: str) -> None:
    """Kimi-Linear's KDA: q / k / v, ``b_proj``, the forget gate's ``f_b_proj`` / ``dt_bias``
    / ``A_log`` and the output gate's ``g_b_proj`` per head; the low-rank ``f_a_proj`` /
    ``g_a_proj`` are shared; ``o_proj`` row parallel."""
    H, D = la.num_heads, la.head_dim
    where = f"{where} ({type(la).__name__}) linear_attn_config.num_heads"
    hd = head_indices(_segments(H, D), rank, world, where=where)
    for name in ("q_proj", "k_proj", "v_proj", "g_b_proj"):
        setattr(la, name, _rows(getattr(la, name), hd))
    la.b_proj = _rows(la.b_proj, head_indices([(H, H)], rank, world, where=where))
    _conv(la.conv1d, head_indices(_segments(H, D) * 3, rank, world, where=where))
    fg = la.forget_gate
    fg.f_b_proj = _rows(fg.f_b_proj, hd)
    fg.dt_bias = _param(fg.dt_bias, hd)
    fg.A_log = _param(fg.A_log, head_indices([(H, H)], rank, world, where=where), dim=2)
    la.o_proj = _columns(la.o_proj, hd)
    la.num_heads = fg.num_heads = H // world
    la.qkv_dim = fg.qkv_dim = la.num_heads * D


def _shard_mamba2(mx: Any, rank: int, world: int, where: str) -> None:
    """Mamba2: ``in_proj`` rows ``[z | x | B | C | dt]`` and the conv's ``[x | B | C]``
    channels by head (B, C by group, replicated below ``world`` groups), ``A_log`` / ``D`` /
    ``dt_bias`` per head, the gated norm's weight, ``out_proj`` row parallel. The gated norm
    normalises each group's channels: with fewer groups than ranks a group's channels span
    ranks, and the norm becomes :class:`ShardedGatedGroupRMSNorm`."""
    nh, hd, G, N = mx.num_heads, mx.head_dim, mx.n_groups, mx.ssm_state_size
    where = f"{where} ({type(mx).__name__})"
    h_where, g_where = f"{where} num_heads", f"{where} n_groups"
    inner = nh * hd
    head_idx = head_indices(_segments(nh, hd), rank, world, where=h_where)
    xbc = [(inner, nh), (G * N, G), (G * N, G)]
    xbc_idx = head_indices(xbc, rank, world, where=g_where)
    dt_idx = head_indices([(nh, nh)], rank, world, where=h_where)
    rows = torch.cat([head_idx, inner + xbc_idx, inner + mx.conv_dim + dt_idx])
    mx.in_proj = _rows(mx.in_proj, rows)
    mup = getattr(mx, "mup_vector", None)
    if mup is not None:  # Falcon-H1: in_proj's output times a muP vector [1, 1, P], row by row
        mx.mup_vector = mup.reshape(-1)[rows.to(mup.device)].reshape(1, 1, -1).contiguous()
    _conv(mx.conv1d, xbc_idx)
    mx.A_log, mx.D, mx.dt_bias = (_param(p, dt_idx) for p in (mx.A_log, mx.D, mx.dt_bias))
    # Falcon-H1 without mamba_rms_norm gates with silu(z) and holds an Identity: nothing to split
    norm = getattr(mx, "norm", None)
    if norm is not None and not isinstance(norm, torch.nn.Identity):
        size = getattr(norm, "group_size", None)
        groups = G
        if size is None and not hasattr(norm, "n_groups"):
            # Bamba's and Granite-4.0-H's norm before transformers 5.23 has no groups: it
            # normalises over all intermediate channels, whatever n_groups says (one group)
            size, groups = inner, 1
        elif size != inner // G:
            raise ValueError(
                f"{where}: the gated norm's group_size {size}, expected "
                f"intermediate_size {inner} / n_groups {G}"
            )
        if world > groups:  # this rank holds part of a group (B, C replicated)
            mx.norm = ShardedGatedGroupRMSNorm(
                norm.weight[head_idx],
                norm.variance_epsilon,
                size,
                rank * groups // world,
                groups,
            )
        else:  # whole groups on each rank: the module's own norm on its slice
            norm.weight = _param(norm.weight, head_idx)
    mx.out_proj = _columns(mx.out_proj, head_idx)
    mx.num_heads, mx.n_groups = nh // world, max(G // world, 1)
    mx.intermediate_size = mx.num_heads * hd
    mx.conv_dim = mx.intermediate_size + 2 * mx.n_groups * N


def _shard_mamba1(mx: Any, rank: int, world: int, where: str) -> None:
    """Mamba1: the inner channels split (``in_proj``'s x and z rows, conv, ``dt_proj`` rows,
    ``A_log`` / ``D`` rows); ``x_proj`` reads every inner channel, so it is row parallel (dt,
    B, C summed over ranks, then the shared dt / B / C norms), as is ``out_proj``."""
    inner = mx.intermediate_size
    where = f"{where} ({type(mx).__name__}) intermediate_size"
    idx = head_indices([(inner, inner)], rank, world, where=where)
    mx.in_proj = _rows(mx.in_proj, head_indices([(inner, inner)] * 2, rank, world, where=where))
    _conv(mx.conv1d, idx)
    mx.x_proj = _columns(mx.x_proj, idx)
    mx.dt_proj = _rows(mx.dt_proj, idx)
    mx.A_log, mx.D = _param(mx.A_log, idx), _param(mx.D, idx)
    mx.out_proj = _columns(mx.out_proj, idx)
    mx.intermediate_size = inner // world


def _shard_lightning(at: Any, spec: LayerSpec, rank: int, world: int, where: str) -> None:
    """MiniMax's lightning attention: ``qkv_proj`` (q | k | v per head) and ``output_gate``
    per head, the rank's slopes, the output norm over all heads as :class:`ShardedRMSNorm`,
    ``out_proj`` row parallel."""
    H, D = spec.num_heads * world, spec.head_dim
    where = f"{where} ({type(at).__name__}) num_attention_heads"
    hd = head_indices(_segments(H, D), rank, world, where=where)
    heads = head_indices([(H, H)], rank, world, where=where)
    at.qkv_proj = _rows(at.qkv_proj, head_indices(_segments(H, 3 * D), rank, world, where=where))
    at.output_gate = _rows(at.output_gate, hd)
    norm = at.norm
    at.norm = ShardedRMSNorm(norm.weight[hd], norm.variance_epsilon, H * D, weight_after_cast=True)
    at.out_proj = _columns(at.out_proj, hd)
    # the class's rates of all H heads, computed before num_attention_heads becomes this
    # rank's (the class derives the rates from it)
    slopes = at.get_slope_rate().reshape(-1).float()[heads]

    def rank_slopes(device: Any = None) -> torch.Tensor:
        return slopes.to(device)

    at.get_slope_rate = rank_slopes  # what the adapter reads; one rate per head of this rank
    at.num_attention_heads = spec.num_heads


def _shard_short_conv(cv: Any, rank: int, world: int, where: str) -> None:
    """LFM2's gated short conv: ``in_proj``'s B, C, x rows and the conv per channel (the
    channels are independent), ``out_proj`` row parallel."""
    h = cv.out_proj.in_features
    where = f"{where} ({type(cv).__name__}) hidden_size"
    idx = head_indices([(h, h)], rank, world, where=where)
    cv.in_proj = _rows(cv.in_proj, head_indices([(h, h)] * 3, rank, world, where=where))
    _conv(cv.conv, idx)
    cv.out_proj = _columns(cv.out_proj, idx)
