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
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["check_hf_forward", "hf_causal_logits", "hf_vision_block_outputs", "torch_paths"]


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


@torch.no_grad()
def check_hf_forward(model: torch.nn.Module, layout: Any, ids: Sequence[int]) -> None:
    """Run transformers' own forward of ``model`` once over ``ids`` (a few tokens), before the
    runner's first step: a config transformers itself cannot run (a null field its code reads,
    sizes that contradict each other) is refused here, naming the layer, its group in
    ``layout``, the failing module, and what its code expected where that can be told from the
    config, instead of failing in the middle of a step or of the comparison.

    :raises ValueError: transformers' forward raised; the original is chained.
    """
    stack: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    modules = dict(model.named_modules())

    def enter(mod: torch.nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def leave(_mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    hooks = [
        h
        for m in modules.values()
        for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
    ]
    try:
        hf_causal_logits(model, [list(ids)])
    except Exception as err:  # transformers' own code failed: say where and why
        raise ValueError(_forward_failure(model, layout, stack, modules, err)) from err
    finally:
        for h in hooks:
            h.remove()


def _forward_failure(
    model: torch.nn.Module,
    layout: Any,
    stack: Sequence[str],
    modules: dict[str, torch.nn.Module],
    err: Exception,
) -> str:
    """The refusal of :func:`check_hf_forward`: where transformers' forward failed and why."""
    config: Any = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    path = next((p for p in reversed(stack) if p), "")
    where = "outside the decoder layers"
    layer = re.search(r"\.(\d+)(?:\.|$)", path)
    if layer is not None:
        i = int(layer.group(1))
        groups = layout.groups_of(i) if i in layout.layer_indices else ()
        group = ", ".join(repr(g.group_id) for g in groups) or "none"
        chain = [
            type(modules[p]).__name__ for p in stack if p and p.startswith(path[: layer.end()])
        ]
        where = f"in layer {i} (group {group}, module {path}: {' > '.join(chain)})"
    elif path:
        where = f"in module {path} ({type(modules[path]).__name__})"
    hints = _config_contradictions(text_config)
    if path and text_config is not None:
        nulls = _null_fields_read(type(modules[path]), text_config)
        if nulls:
            hints.append(f"null fields its code reads: {', '.join(nulls)}")
    return (
        f"transformers' own forward of {type(model).__name__} fails on this config {where}: "
        f"{type(err).__name__}: {err}"
        + (f"; {'; '.join(hints)}" if hints else "")
        + "; attn run compares every logit with that forward, so it cannot run this config "
        "(attn explain maps it): fix the config"
    )


def _config_contradictions(config: Any) -> list[str]:
    """Sizes in ``config`` that transformers' modules cannot run together, each as expected
    against given."""
    if config is None:
        return []
    out = []
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if getattr(config, "kv_lora_rank", None) is not None and heads and kv and kv != heads:
        # MLA's keys come out of kv_b_proj per query head; the eager attention function then
        # repeats them num_attention_heads // num_key_value_heads times again
        out.append(
            f"multi-head latent attention expands its keys to every query head and the "
            f"attention function repeats them num_attention_heads // num_key_value_heads more "
            f"times: expected num_key_value_heads = num_attention_heads = {heads}, got {kv}"
        )
    rotary = getattr(config, "rotary_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if isinstance(rotary, int) and heads and hidden and rotary > hidden // heads:
        out.append(
            f"rotary_dim={rotary} is wider than the head (hidden_size {hidden} / "
            f"num_attention_heads {heads}): expected rotary_dim <= {hidden // heads}, "
            f"got {rotary}"
        )
    return out


def _null_fields_read(cls: type, config: Any) -> list[str]:
    """The ``config.<field>`` names the source of ``cls`` reads that are None in ``config``
    (DeepseekV2TopkRouter's ``num_experts_per_tok`` at DeepseekV2Config's default), in the
    order the source reads them."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return []
    read = dict.fromkeys(re.findall(r"\bconfig\.(\w+)", source))
    missing = object()
    return [n for n in read if getattr(config, n, missing) is None]
