"""transformers' own forward of the tiny models: the ground truth the runner is compared with.

transformers wraps its linear-attention / SSM torch functions in a hub-kernel decorator that
swaps in fla's or mamba_ssm's Triton kernels when those packages import; fla imports here even
without a GPU, and its kernels then fail. :func:`torch_paths` temporarily points the modeling
module's globals at the undecorated torch code, so the reference is transformers' eager torch
path on every machine.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["hf_causal_logits", "hf_vision_block_outputs", "torch_paths"]


@contextlib.contextmanager
def torch_paths(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s modeling module calls its own torch implementations."""
    module = importlib.import_module(type(model).__module__)
    saved: dict[str, Callable[..., Any]] = {}
    for name, value in vars(module).items():
        if inspect.isfunction(value) and hasattr(value, "__wrapped__"):
            inner = inspect.unwrap(value)
            if inner is not value and inner.__module__ == module.__name__:
                saved[name] = value
    try:
        for name, value in saved.items():
            setattr(module, name, inspect.unwrap(value))
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


@torch.no_grad()
def hf_causal_logits(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """transformers' eager full-sequence forward of each token sequence, one at a time.

    :param sequences: token ids per request (prompt followed by the fed generated tokens).
    :returns: per sequence ``[L, vocab]`` float32 logits (row ``t`` predicts token ``t + 1``).
    """
    device = next(model.parameters()).device
    out = []
    with torch_paths(model):
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits
            out.append(logits[0].float())
    return out


@torch.no_grad()
def hf_vision_block_outputs(
    model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """A vision tower's hidden states after every block and its output.

    :param pixel_values: Qwen2-VL / Qwen2.5-VL: ``[num_patches, C * temporal_patch * patch *
        patch]``; SigLIP: ``[num_images, C, image_size, image_size]``; Whisper's encoder: mel
        features ``[clips, num_mel_bins, 2 * max_source_positions]``.
    :param grid_thw: ``[num_images, 3]`` int64 (Qwen towers); None for SigLIP.
    :returns: (per block ``[num_patches, hidden]`` float32, in the tower's own token order
        (Qwen2.5-VL: window order; SigLIP: image after image); the output, float32: the
        Qwen towers' merged ``[num_patches / merge_unit, out_hidden]`` in image order, SigLIP's
        post-layernorm ``last_hidden_state`` as ``[num_images * patches, hidden]``), and
        Qwen3-VL's DeepStack features (``deepstack_features``: per listed block
        ``[num_patches / merge_unit, out_hidden]`` float32; empty for other towers).
    """
    captured: list[torch.Tensor] = []
    # Qwen towers keep their blocks in .blocks, SigLIP its layers in .encoder.layers,
    # WhisperEncoder in .layers
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        encoder = getattr(model, "encoder", None)
        blocks = getattr(encoder, "layers", None)
    if blocks is None:
        blocks = getattr(model, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: expected the vision tower's blocks (.blocks or "
            f".encoder.layers, .layers) as a ModuleList, got {type(blocks).__name__}"
        )
    hooks = [
        blk.register_forward_hook(
            lambda _m, _i, o: captured.append(o.detach().float().reshape(-1, o.shape[-1]))
        )
        for blk in blocks
    ]
    try:
        with torch_paths(model):
            if grid_thw is None:
                result = model(pixel_values)
                out = result.last_hidden_state
            else:
                result = model(pixel_values, grid_thw=grid_thw)
                out = result.pooler_output
    finally:
        for h in hooks:
            h.remove()
    deepstack = [f.float() for f in getattr(result, "deepstack_features", None) or []]
    return captured, out.float().reshape(-1, out.shape[-1]), deepstack
