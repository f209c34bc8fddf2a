"""Vision towers and Whisper's audio encoder with every block's attention through an encoder
binding.

SigLIP and CLIP (every image the same number of patches; CLIP's class token ahead of them and a
layer norm before the first layer), Qwen2-VL (variable-length images, 2D
rotary inside the tower) and Qwen3-VL / Qwen3.5 (Qwen2-VL's pattern, a learned position grid
resampled to each image added before the blocks) run every block as bidirectional attention
within each image frame: one encoder batch. Qwen3-VL's DeepStack mergers turn the hidden
states after the blocks of ``deepstack_visual_indexes`` into extra features for the language
model; they are returned (and compared) with the merged output.
Qwen2.5-VL's tower alternates windowed blocks (attention within windows of patches) and full
blocks (attention within each image); both are bidirectional varlen attention over the same
tokens and share one layer group, so the runner keeps two encoder batches (window and image
cu-seqlens, two builders so that both stay valid) and prepares the runtime with the one each
block needs.
Whisper's encoder runs each clip's ``max_source_positions`` frames (after its two
convolutions) as one encoder sequence, every layer bidirectional attention within the clip.
Everything else (patch embedding, position grid, convolutions, window permutation, rotary,
norms, MLP, mergers) is the transformers modules' own code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from attn_core.batch import BatchBuilder
from attn_core.e2e.configs import TinyModel
from attn_core.runtime import AttentionRuntime

__all__ = [
    "IMAGE_GRIDS",
    "VisionResult",
    "VisionRunner",
    "encoder_inputs",
    "sample_images",
    "vision_inputs",
]


@dataclass
class VisionResult:
    """:ivar blocks: per block ``[num_patches, hidden]`` float32 (window order, as transformers;
        Whisper: ``[clips * max_source_positions, d_model]``, clip after clip).
    :ivar merged: ``[num_patches / merge_unit, out_hidden]`` float32 in image order (SigLIP and
        Whisper: the final layer norm's output, ``[tokens, hidden]``).
    :ivar deepstack: Qwen3-VL's DeepStack features, one ``[num_patches / merge_unit,
        out_hidden]`` float32 per ``deepstack_visual_indexes`` entry, in that order; empty for
        towers without them."""

    blocks: list[torch.Tensor]
    merged: torch.Tensor
    seconds: float = 0.0
    deepstack: list[torch.Tensor] = field(default_factory=list)


#: Towers whose every image has the config's ``image_size`` (no grid_thw): SigLIP and CLIP.
_FIXED_SIZE_TOWERS = ("siglip-vision", "clip-vision")


def sample_images(model: TinyModel, grids: list[tuple[int, int, int]], *, seed: int = 0):
    """Random pixel patches for images of ``grids`` (t, h, w patches each).

    :returns: ``(pixel_values [sum t*h*w, C*tp*p*p], grid_thw [n, 3] int64)`` on the model's
        device and dtype.
    """
    cfg: Any = model.hf.config  # a transformers config: attributes by architecture
    p = next(model.hf.parameters())
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, width, generator=gen).to(device=p.device, dtype=p.dtype)
    return pixels, torch.tensor(grids, dtype=torch.long, device=p.device)


#: (t, h, w) patches of the images an encoder run feeds the Qwen towers, taken in turn
IMAGE_GRIDS = [(1, 8, 8), (1, 4, 12), (2, 4, 4), (1, 12, 8)]


def encoder_inputs(
    model: TinyModel, count: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """:func:`vision_inputs` for ``count`` (at least one) images or clips, the grids taken in
    turn from :data:`IMAGE_GRIDS`."""
    grids = [IMAGE_GRIDS[i % len(IMAGE_GRIDS)] for i in range(max(count, 1))]
    return vision_inputs(model, grids, seed=seed)


def vision_inputs(
    model: TinyModel, grids: list[tuple[int, int, int]], *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Random inputs for ``len(grids)`` images of the tower ``model``.

    :param grids: (t, h, w) patches per image for the Qwen towers; SigLIP takes one image of
        its ``image_size`` per entry (its patch count is fixed by the config), Whisper one clip
        per entry.
    :returns: ``(pixel_values, grid_thw or None, num_patches)``: the Qwen towers' as
        :func:`sample_images`; SigLIP's ``[n, C, image_size, image_size]`` and None;
        Whisper's mel features ``[n, num_mel_bins, 2 * max_source_positions]`` and None
        (``n * max_source_positions`` tokens).
    """
    if model.name == "whisper-encoder":
        wcfg: Any = model.hf.config  # a WhisperConfig
        p = next(model.hf.parameters())
        frames = int(wcfg.max_source_positions)
        gen = torch.Generator().manual_seed(seed)
        # the encoder checks the input length: two frames per position (conv2 has stride 2)
        mel = torch.randn(len(grids), wcfg.num_mel_bins, 2 * frames, generator=gen)
        return mel.to(device=p.device, dtype=p.dtype), None, len(grids) * frames
    if model.name not in _FIXED_SIZE_TOWERS:
        pixels, grid_thw = sample_images(model, grids, seed=seed)
        return pixels, grid_thw, sum(t * h * w for t, h, w in grids)
    cfg: Any = model.hf.config  # a SiglipVisionConfig or CLIPVisionConfig
    p = next(model.hf.parameters())
    size = int(cfg.image_size)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(len(grids), cfg.num_channels, size, size, generator=gen)
    # CLIP's tokens: its class token ahead of the patches
    patches = (size // int(cfg.patch_size)) ** 2 + (model.name == "clip-vision")
    return pixels.to(device=p.device, dtype=p.dtype), None, len(grids) * patches


class VisionRunner:
    """Runs the tower block by block; ``runtime`` has the layout's single encoder group."""

    def __init__(self, model: TinyModel, runtime: AttentionRuntime, *, max_tokens: int = 4096):
        self.model = model
        self.runtime = runtime
        device = runtime.device
        self._builders = {
            key: BatchBuilder(None, max_batch_size=256, max_num_tokens=max_tokens, device=device)
            for key in ("full", "window")
        }

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None) -> VisionResult:
        """The tower on the inputs of :func:`vision_inputs` (``grid_thw`` None for SigLIP and
        Whisper, whose ``pixel_values`` are mel features)."""
        if self.model.name == "siglip-vision":
            return self._siglip(pixel_values)
        if self.model.name == "clip-vision":
            return self._clip(pixel_values)
        if self.model.name == "whisper-encoder":
            return self._whisper(pixel_values)
        if grid_thw is None:
            raise ValueError(f"{self.model.name}: grid_thw is required (the images' t, h, w)")
        if self.model.name == "qwen2-vl-vision":
            return self._qwen2_vl(pixel_values, grid_thw)
        if self.model.name in ("qwen3-vl-vision", "qwen3.5-vision"):
            return self._qwen3_vl(pixel_values, grid_thw)
        return self._qwen2_5_vl(pixel_values, grid_thw)

    def _self_attention(
        self, i: int, at: Any, x: torch.Tensor, n: int, tokens: int
    ) -> torch.Tensor:
        """Layer ``i``'s self-attention module ``at`` (separate q / k / v projections and an
        ``out_proj``: SigLIP, CLIP, Whisper) with its op through the binding.

        :param x: ``[n * tokens, width]`` normed hidden states of ``n`` inputs of ``tokens``.
        :returns: ``[n, tokens, width]``, ``out_proj``'s output (under tensor parallelism it
            all-reduces the rank's heads to the full width).
        """
        q, k, v = (
            proj(x).view(n * tokens, -1, at.head_dim) for proj in (at.q_proj, at.k_proj, at.v_proj)
        )  # -1: the rank's heads under tensor parallelism
        out = torch.empty_like(q)
        self.runtime.binding(i).forward(q, k, v, out=out)
        return at.out_proj(out.reshape(n, tokens, -1))

    def _siglip(self, pixel_values: torch.Tensor) -> VisionResult:
        vt: Any = self.model.hf  # a SiglipVisionModel
        hs = vt.embeddings(pixel_values)  # [images, patches, hidden]
        n, patches, width = hs.shape
        self.runtime.prepare(self._builders["full"].build_encoder([patches] * n))
        blocks = []
        for i, layer in enumerate(vt.encoder.layers):
            at = layer.self_attn
            x = layer.layer_norm1(hs).reshape(n * patches, width)
            hs = hs + self._self_attention(i, at, x, n, patches)
            hs = hs + layer.mlp(layer.layer_norm2(hs))
            blocks.append(hs.reshape(n * patches, width).float())
        out = vt.post_layernorm(hs).reshape(n * patches, width)
        return VisionResult(blocks, out.float())

    def _clip(self, pixel_values: torch.Tensor) -> VisionResult:
        """CLIPVisionModel.forward with each layer's attention through its binding: one
        encoder batch of the images' class token and patches.

        :param pixel_values: ``[images, C, image_size, image_size]``.
        :returns: per layer ``[images * (patches + 1), hidden]``; ``merged``: the encoder's
            ``last_hidden_state`` (before ``post_layernorm``, which transformers applies to
            the pooled class token only; LLaVA reads the hidden states).
        """
        vt: Any = self.model.hf  # a CLIPVisionModel
        hs = vt.pre_layrnorm(vt.embeddings(pixel_values))  # [images, 1 + patches, hidden]
        n, tokens, width = hs.shape
        self.runtime.prepare(self._builders["full"].build_encoder([tokens] * n))
        blocks = []
        for i, layer in enumerate(vt.encoder.layers):
            at = layer.self_attn
            x = layer.layer_norm1(hs).reshape(n * tokens, width)
            # the spec's scale is head_dim ** -0.5, CLIPAttention's ``scale``
            hs = hs + self._self_attention(i, at, x, n, tokens)
            hs = hs + layer.mlp(layer.layer_norm2(hs))
            blocks.append(hs.reshape(n * tokens, width).float())
        return VisionResult(blocks, hs.reshape(n * tokens, width).float())

    def _whisper(self, features: torch.Tensor) -> VisionResult:
        """WhisperEncoder.forward with each layer's attention through its binding.

        :param features: ``[clips, num_mel_bins, 2 * max_source_positions]`` mel features.
        """
        enc: Any = self.model.hf  # a WhisperEncoder
        x = torch.nn.functional.gelu(enc.conv1(features))
        x = torch.nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)  # [clips, frames, d_model]
        hs = x + enc.embed_positions.weight  # every clip has all max_source_positions frames
        n, frames, width = hs.shape
        self.runtime.prepare(self._builders["full"].build_encoder([frames] * n))
        blocks = []
        for i, layer in enumerate(enc.layers):
            at = layer.self_attn
            x = layer.self_attn_layer_norm(hs).reshape(n * frames, width)
            # q unscaled: the binding applies the spec's head_dim ** -0.5, where transformers
            # multiplies q by it before an op called with scale 1 (the same softmax)
            hs = hs + self._self_attention(i, at, x, n, frames)
            mlp = layer.activation_fn(layer.fc1(layer.final_layer_norm(hs)))
            hs = hs + layer.fc2(mlp)
            if hs.dtype == torch.float16:  # as WhisperEncoderLayer: keep fp16 finite
                bound = torch.finfo(hs.dtype).max - 1000
                hs = torch.clamp(hs, min=-bound, max=bound)
            blocks.append(hs.reshape(n * frames, width).float())
        out = enc.layer_norm(hs).reshape(n * frames, width)
        return VisionResult(blocks, out.float())

    def _qwen2_vl(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionResult:
        from transformers.models.qwen2_vl import modeling_qwen2_vl as mq
        from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

        vt: Any = self.model.hf  # a Qwen2VisionTransformerPretrainedModel
        position_ids = get_vision_position_ids(grid_thw, vt.spatial_merge_size, kwargs={})
        cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, vt.config, kwargs={})
        self.runtime.prepare(self._builders["full"].build_encoder(_lengths(cu_seqlens)))
        hs = vt.patch_embed(pixel_values)
        cos, sin = vt.rotary_pos_emb(hs, position_ids)
        blocks, last = [], hs
        for _, last in self._rope_blocks(vt, hs, cos, sin, mq):
            blocks.append(last.float())
        return VisionResult(blocks, vt.merger(last).float())

    def _rope_blocks(
        self, vt: Any, hs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mq: Any
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Qwen2-VL / Qwen3-VL tower blocks with each block's attention through its binding
        (the encoder batch prepared): ``(block index, hidden [num_patches, hidden])`` after
        each block; ``mq`` the tower's modeling module (its vision rotary helper)."""
        seq_len = hs.shape[0]
        for i, blk in enumerate(vt.blocks):
            at = blk.attn
            q, k, v = at.qkv(blk.norm1(hs)).reshape(seq_len, 3, at.num_heads, -1).unbind(1)
            q, k = mq.apply_rotary_pos_emb_vision(q, k, cos, sin)
            out = torch.empty_like(q)
            self.runtime.binding(i).forward(q.contiguous(), k.contiguous(), v.contiguous(), out=out)
            hs = hs + at.proj(out.reshape(seq_len, -1))
            hs = hs + blk.mlp(blk.norm2(hs))
            yield i, hs

    def _qwen3_vl(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionResult:
        """Qwen3VLVisionModel.forward (Qwen3.5's tower: the same without DeepStack) with each
        block's attention through its binding: one encoder batch of the image frames.

        :param pixel_values: ``[num_patches, C * temporal_patch * patch * patch]``.
        :param grid_thw: ``[num_images, 3]`` int64.
        """
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        vt: Any = self.model.hf  # Qwen3VLVisionModel, its MoE form, or Qwen3.5's tower
        # the tower's own modeling module: its rotary helper (the MoE forms have their copy)
        mq = importlib.import_module(type(vt).__module__)
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=vt.num_grid_per_side,
            mode=vt.interpolation_mode,
            align_corners=vt.interpolation_align_corners,
            spatial_merge_size=vt.config.spatial_merge_size,
            kwargs={},
        )
        position_ids = get_vision_position_ids(grid_thw, vt.spatial_merge_size, kwargs={})
        cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, vt.config, kwargs={})
        self.runtime.prepare(self._builders["full"].build_encoder(_lengths(cu_seqlens)))
        hs = vt.patch_embed(pixel_values)  # [num_patches, hidden]
        # the learned position grid, resampled bilinearly to each image's grid
        hs = hs + (vt.pos_embed(indices) * weights[:, :, None]).sum(1).to(hs.dtype)
        cos, sin = vt.rotary_pos_emb(hs, position_ids)
        # Qwen3.5's tower has no DeepStack mergers (its class deletes them)
        indexes = list(getattr(vt, "deepstack_visual_indexes", ()))
        blocks, deepstack, last = [], [], hs
        for i, last in self._rope_blocks(vt, hs, cos, sin, mq):
            blocks.append(last.float())
            if i in indexes:
                deepstack.append(vt.deepstack_merger_list[indexes.index(i)](last).float())
        return VisionResult(blocks, vt.merger(last).float(), deepstack=deepstack)

    def _qwen2_5_vl(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionResult:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mq
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_position_ids,
            get_vision_window_index,
        )

        # the transformers vision tower: its attributes are resolved at run time
        vt: Any = self.model.hf
        layout = self.model.layout
        position_ids = get_vision_position_ids(grid_thw, vt.spatial_merge_size, kwargs={})
        cu_seqlens, _ = get_vision_attention_seqlens(grid_thw, vt.config, kwargs={})
        window_index, cu_window = get_vision_window_index(
            grid_thw,
            spatial_merge_size=vt.spatial_merge_size,
            window_size=vt.window_size,
            patch_size=vt.patch_size,
            kwargs={},
        )
        batches = {
            "full": self._builders["full"].build_encoder(_lengths(cu_seqlens)),
            "window": self._builders["window"].build_encoder(_lengths(cu_window)),
        }
        hs = vt.patch_embed(pixel_values)
        seq_len = hs.shape[0]
        hs = vt.permute_input_for_window_attn(hs, window_index, seq_len=seq_len)
        cos, sin = (
            vt.permute_input_for_window_attn(f, window_index, seq_len=seq_len)
            for f in vt.rotary_pos_emb(hs, position_ids)
        )
        full_blocks = set(layout.encoder_full_attention_layers)
        current = None
        blocks = []
        for i, blk in enumerate(vt.blocks):
            key = "full" if i in full_blocks else "window"
            if key != current:
                self.runtime.prepare(batches[key])
                current = key
            at = blk.attn
            x = blk.norm1(hs)
            q, k, v = at.qkv(x).reshape(seq_len, 3, at.num_heads, -1).unbind(1)
            q, k = mq.apply_rotary_pos_emb_vision(q, k, cos, sin)
            out = torch.empty_like(q)
            self.runtime.binding(i).forward(q.contiguous(), k.contiguous(), v.contiguous(), out=out)
            hs = hs + at.proj(out.reshape(seq_len, -1))
            hs = hs + blk.mlp(blk.norm2(hs))
            blocks.append(hs.float())
        merged = vt.merger(hs)[torch.argsort(window_index)]
        return VisionResult(blocks, merged.float())


def _lengths(cu: Any) -> list[int]:
    """Segment lengths from cu-seqlens, dropping the empty windows transformers may keep."""
    cu = torch.unique_consecutive(torch.as_tensor(cu).cpu())
    return [int(x) for x in (cu[1:] - cu[:-1]).tolist() if x > 0]
