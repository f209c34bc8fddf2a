"""Tensor parallelism check: every family's heads sharded over ranks vs TP=1 and transformers.

Run with ``torchrun --nproc_per_node 2 -m attn_core.e2e.tp_check [--model all] [--device
cuda]`` (gloo on CPU, nccl on CUDA). For each family every rank builds the same tiny model (same
seed), parses its layout with ``tp_size = world size`` (heads per rank, the same
``specs_from_hf_config`` path a server uses, so the state pools are sized per rank), keeps its
slice of every attention and linear-mixer layer (:func:`attn_core.e2e.tp_shard.shard_model`:
q / k / v and mixer heads column parallel, ``o_proj`` / ``out_proj`` row parallel with an
all-reduce) and generates greedily; MLPs and MoE blocks stay replicated (this checks attention
sharding, not MLP sharding). Each rank compares its logits of every position and its tokens
with a TP=1 run of the same requests, and rank 0 also compares the TP run with transformers'
eager forward of the unsharded model. The encoder stacks (the SigLIP and Qwen2-VL / Qwen2.5-VL
vision towers, Whisper's encoder) run one encoder pass instead (:func:`tp_encode`): every rank
compares every block's hidden states and the final output with TP=1, rank 0 with transformers'
tower (:func:`~attn_core.e2e.compare.compare_vision`). Rank 0 prints one line per family
(``--json PATH`` also writes them); the exit status is 1 when any family mismatches or fails.

``--model`` takes ``all`` (:data:`TP_FAMILIES`) or a comma list of its names. ``--dtype
bfloat16 --shapes kernel --plugins`` (on CUDA) runs the samples at head dims the GPU kernels serve
through the installed plugins; in half precision only the comparison with transformers decides
(see :func:`check_family`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attn_core.e2e.compare import compare_generation, compare_vision
from attn_core.e2e.configs import (
    ARCHITECTURES,
    ENCODER_MODELS,
    ENCODER_RUNS,
    SHAPES,
    TinyModel,
    build_tiny,
    tiny_config,
)
from attn_core.e2e.dist_run import end_group, exit_now, write_results
from attn_core.e2e.main import default_registry, encoder_runner, make_prompts, plan_for
from attn_core.e2e.runner import Engine, GenerationResult
from attn_core.e2e.tp_shard import shard_model
from attn_core.e2e.vision import VisionResult, encoder_inputs

__all__ = ["TP_FAMILIES", "TPResult", "check_family", "tp_config", "tp_encode", "tp_generate"]

_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
_QWEN3_5: dict[str, Any] = {
    "num_hidden_layers": 4,  # linear, linear, linear, full
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


def _transformers_config(cls_name: str, **fields: Any) -> dict[str, Any]:
    import transformers

    return getattr(transformers, cls_name)(**{**_SMALL, **fields}).to_dict()


_Builder = Callable[[str], tuple[str, dict[str, Any]]]  # shapes -> (architecture, config)


def _sample(name: str, **override: Any) -> _Builder:
    def build(shapes: str) -> tuple[str, dict[str, Any]]:
        return name, {**tiny_config(name, shapes), **override}

    return build


# A Qwen3-VL / Qwen3.5 tower of 4 heads (2 per rank) over 8 x 8 and 4 x 12 patch images, its
# learned position grid resampled to each.
_QWEN3_TOWER: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_heads": 4,
    "out_hidden_size": 64,
    "patch_size": 8,
    "num_position_embeddings": 64,
    "initializer_range": 0.1,
}
_QWEN3_VL_TEXT: dict[str, Any] = {
    **_SMALL,
    "num_hidden_layers": 2,
    "head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
        "rope_theta": 1e4,
    },
}


def _multimodal(
    family: str, cls_name: str, vision: dict[str, Any], text: dict[str, Any]
) -> _Builder:
    """The stack ``family`` runs of a transformers multimodal config (``vision_config`` and
    ``text_config`` given as they are)."""

    def build(shapes: str) -> tuple[str, dict[str, Any]]:  # its own sizes whatever the shapes
        import transformers

        cls = getattr(transformers, cls_name)
        return family, cls(vision_config=vision, text_config=text).to_dict()

    return build


def _config(family: str, cls_name: str, **fields: Any) -> _Builder:
    def build(shapes: str) -> tuple[str, dict[str, Any]]:  # its own sizes whatever the shapes
        return family, _transformers_config(cls_name, **fields)

    return build


# Name -> (architecture the adapter drives, config.json dict). The bundled samples' tiny
# configs, and transformers configs for the families that run from a config.json.
_BUILDERS: dict[str, _Builder] = {
    **{n: _sample(n) for n in ARCHITECTURES if n not in ENCODER_MODELS},
    # the encoder stacks' tiny samples: 4 heads, 2 per rank
    **{n: _sample(n) for n in ENCODER_MODELS},
    # 4 query heads over 1 KV head: the KV head replicated on both ranks
    "qwen3-kv1": _sample("qwen3", num_key_value_heads=1),
    # one Gated DeltaNet key head for 4 value heads: the key head replicated on both ranks
    "qwen3-next-k1": _sample("qwen3-next", linear_num_key_heads=1),
    # one Mamba2 group (as Bamba-9B): B / C replicated, the gated norm's group over both ranks
    "bamba-g1": _sample("bamba", mamba_n_groups=1),
    "deepseek-v2": _config(
        "deepseek-v3",  # the MLA adapter drives V2 as V3 (tests/e2e/test_run_families.py)
        "DeepseekV2Config",
        num_hidden_layers=2,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=None,
    ),
    "granite-4.0-h": _config(
        "granite-4.0-h",
        "GraniteMoeHybridConfig",
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        shared_intermediate_size=64,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=3.0,
        attention_multiplier=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3.5": _config("qwen3.5", "Qwen3_5TextConfig", **_QWEN3_5),
    "qwen3.5-moe": _config(
        "qwen3.5",
        "Qwen3_5MoeTextConfig",
        **_QWEN3_5,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    # Qwen3-VL's tower with DeepStack mergers after blocks 0 and 2 (their features compared
    # too), Qwen3.5's without, and Qwen3-VL's M-RoPE language model
    "qwen3-vl-vision": _multimodal(
        "qwen3-vl-vision",
        "Qwen3VLConfig",
        {**_QWEN3_TOWER, "deepstack_visual_indexes": [0, 2]},
        _QWEN3_VL_TEXT,
    ),
    "qwen3.5-vision": _multimodal(
        "qwen3.5-vision", "Qwen3_5Config", _QWEN3_TOWER, {**_SMALL, **_QWEN3_5}
    ),
    "qwen3-vl-text": _multimodal("qwen3-vl-text", "Qwen3VLConfig", _QWEN3_TOWER, _QWEN3_VL_TEXT),
    # Qwen3.5's language model inside its Qwen3_5ForConditionalGeneration
    "qwen3.5-multimodal": _multimodal(
        "qwen3.5", "Qwen3_5Config", _QWEN3_TOWER, {**_SMALL, **_QWEN3_5}
    ),
    "phi3": _config("dense", "Phi3Config", num_hidden_layers=2, partial_rotary_factor=0.5),
    "olmo2": _config("dense", "Olmo2Config", num_hidden_layers=2),  # q / k norms over all heads
    # per-layer query head counts (4 and 8: 2 and 4 per rank) over 2 KV heads, an output gate
    "laguna": _config(
        "dense",
        "LagunaConfig",
        num_hidden_layers=4,
        head_dim=16,
        num_attention_heads_per_layer=[4, 8, 4, 8],
    ),
    # the same gate per (head, channel)
    "laguna-channel-gate": _config(
        "dense", "LagunaConfig", num_hidden_layers=2, head_dim=16, gating="per-element"
    ),
    # an output gate per channel (gate_proj) and q / k norms around the op, sliding layers
    "afmoe": _config(
        "dense",
        "AfmoeConfig",
        num_hidden_layers=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=1,
        sliding_window=8,
        global_attn_every_n_layers=2,
    ),
    # a LayerNorm per head over q and k (a ModuleList: the rank keeps its heads'), views by
    # the module's own head counts
    "stablelm": _config(
        "dense", "StableLmConfig", num_hidden_layers=2, qk_layernorm=True, use_qkv_bias=True
    ),
    # layers under decoder.layers; multi-head (OPT has no num_key_value_heads: none written)
    "opt": _config(
        "dense", "OPTConfig", num_hidden_layers=2, ffn_dim=128, num_key_value_heads=None
    ),
    "phi": _config("dense", "PhiConfig", num_hidden_layers=2),  # the output projection `dense`
    "ministral": _config(
        "dense",
        "MinistralConfig",
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
#: The names ``--model`` accepts (``all``: every one), in report order.
TP_FAMILIES: tuple[str, ...] = tuple(_BUILDERS)


def tp_config(name: str, shapes: str = "tiny") -> tuple[str, dict[str, Any]]:
    """``(architecture, config.json dict)`` of the TP check's model ``name``.

    :param shapes: for the samples, ``"tiny"`` or ``"kernel"`` (head dims the GPU kernels
        serve, :func:`attn_core.e2e.configs.tiny_config`); the other configs keep their sizes.
    """
    if name not in _BUILDERS:
        raise ValueError(f"tp_check has no model {name!r}; choose 'all' or of {list(TP_FAMILIES)}")
    return _BUILDERS[name](shapes)


def _sharded(
    name: str, *, device: torch.device, dtype: str, shapes: str, tp_size: int, rank: int
) -> TinyModel:
    """Model ``name`` built (seed 0) at the per-rank layout of ``tp_size``, with seeded random
    biases on every linear and conv (a bias added on the wrong ranks shows), sharded for
    ``rank``."""
    arch, cfg = tp_config(name, shapes)
    model = build_tiny(arch, device=device, dtype=dtype, tp_size=tp_size, config=cfg)
    _random_biases(model.hf)
    if tp_size > 1:
        shard_model(model, rank, tp_size)
    return model


def tp_generate(
    name: str,
    *,
    device: torch.device,
    tp_size: int,
    rank: int,
    prompts: int,
    new_tokens: int,
    dtype: str = "float32",
    shapes: str = "tiny",
    registry: Any = None,
) -> tuple[TinyModel, GenerationResult, int]:
    """Build model ``name`` (seed 0), shard it for ``rank`` of ``tp_size``, generate greedily.

    :param dtype: the model's and the specs' dtype (``"float32"``, ``"bfloat16"``, ...).
    :param registry: the backends to select from; None: the reference backend only.
    :returns: the (sharded) model, the generation of ``prompts`` requests of ``new_tokens``
        tokens each (every rank computes the full logits ``[L, vocab]``) and the bytes of the
        engine's KV pages and linear-state slots on this rank (sized from the per-rank specs).
    """
    model = _sharded(name, device=device, dtype=dtype, shapes=shapes, tp_size=tp_size, rank=rank)
    registry = registry if registry is not None else default_registry()
    ids = make_prompts(prompts)
    max_len = max(len(p) for p in ids) + new_tokens + 1
    plan = plan_for(
        model,
        registry,
        device,
        None,
        max_batch_size=prompts,
        max_num_tokens=5 * prompts,
        max_model_len=max_len,
        graphs=False,
    )
    engine = Engine(
        model, plan, registry, device=device, max_batch_size=prompts, max_model_len=max_len
    )
    return model, engine.generate(ids, new_tokens), engine.state.nbytes


def tp_encode(
    name: str,
    *,
    device: torch.device,
    tp_size: int,
    rank: int,
    prompts: int,
    dtype: str = "float32",
    shapes: str = "tiny",
    registry: Any = None,
    **_: Any,
) -> tuple[TinyModel, VisionResult, tuple[torch.Tensor, torch.Tensor | None]]:
    """Build encoder stack ``name`` (seed 0), shard it for ``rank`` of ``tp_size``, run one
    encoder pass over ``prompts`` inputs (images of the e2e runner's grids, or Whisper clips).

    :param _: :func:`tp_generate`'s keywords an encoder has no use for (``new_tokens``).
    :returns: the (sharded) model, its :class:`~attn_core.e2e.vision.VisionResult` (every
        rank holds the full ``[tokens, hidden]`` hidden states of every block and the final
        output: the row-parallel projections all-reduce) and the inputs ``(pixel_values,
        grid_thw or None)`` for the comparison with transformers. An encoder keeps no
        persistent state (the runtime has none), so there are no state bytes to report.
    """
    model = _sharded(name, device=device, dtype=dtype, shapes=shapes, tp_size=tp_size, rank=rank)
    registry = registry if registry is not None else default_registry()
    pixels, grid_thw, tokens = encoder_inputs(model, prompts)
    result = encoder_runner(model, registry, device, None, tokens).forward(pixels, grid_thw)
    return model, result, (pixels, grid_thw)


@torch.no_grad()
def _random_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """transformers initialises biases to zero, under which a bias sharded or summed wrongly
    (added on one rank only, or once per rank) changes nothing; seeded random biases on every
    linear and conv make it count. Same seed, same values for the TP=1 run."""
    gen = torch.Generator().manual_seed(seed + 2)
    for module in model.modules():
        bias = getattr(module, "bias", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)) and bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen).to(bias) * 0.1)


@dataclass(frozen=True, slots=True)
class TPResult:
    """One family's check.

    :ivar max_abs_diff: max over ranks and positions of ``|logits(tp) - logits(tp=1)|``
        (encoder stacks: of every block's hidden states and the final output).
    :ivar tokens_equal: every rank's greedy tokens equal the TP=1 run's (encoder stacks: no
        tokens, False).
    :ivar blocks: encoder stacks: the blocks whose hidden states were compared (the final
        output too); 0 for a causal model.
    :ivar transformers: rank 0's TP run vs transformers (:class:`MatchResult.short`).
    :ivar state_bytes: rank 0's KV pages and state slots under TP; ``state_bytes_tp1``: the
        same pools at TP=1 (half of it where every layer's state splits; all of it where it is
        replicated: MLA's latent, KV heads fewer than ranks).
    :ivar error: why the family could not run (then nothing else is meaningful).
    """

    name: str
    tp: int
    ok: bool
    max_abs_diff: float = float("nan")
    tokens_equal: bool = False
    transformers: str = ""
    state_bytes: int = 0
    state_bytes_tp1: int = 0
    error: str = ""
    blocks: int = 0

    def format(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        if self.error:
            return f"tp_check {self.name}: tp={self.tp} ERROR {self.error} -> {verdict}"
        if self.blocks:
            return (
                f"tp_check {self.name}: tp={self.tp} vs tp=1 max|diff|={self.max_abs_diff:.2e} "
                f"over {self.blocks} blocks and the output, no state (encoder); vs "
                f"transformers {self.transformers} -> {verdict}"
            )
        return (
            f"tp_check {self.name}: tp={self.tp} vs tp=1 max|diff|={self.max_abs_diff:.2e} "
            f"tokens {'equal' if self.tokens_equal else 'DIFFER'}, state "
            f"{self.state_bytes} of {self.state_bytes_tp1} bytes per rank; vs transformers "
            f"{self.transformers} -> {verdict}"
        )


def check_family(name: str, *, rank: int, world: int, **run: Any) -> TPResult:
    """TP=``world`` vs TP=1 (every rank) and vs transformers (rank 0) for model ``name``.

    :param run: :func:`tp_generate`'s keywords but ``tp_size`` / ``rank``. In float32 the TP
        run must give TP=1's tokens and logits to 1e-4; in half precision the all-reduce sums
        in another order than one matmul, so only the comparison with transformers (its
        tolerance for the dtype, on the TP run's own prefixes) decides. An encoder stack's
        block outputs are held to the same (:func:`_check_encoder`).
    """
    if name in ENCODER_RUNS:
        return _check_encoder(name, rank=rank, world=world, **run)
    try:
        _, tp, tp_bytes = tp_generate(name, tp_size=world, rank=rank, **run)
        ref_model, ref, ref_bytes = tp_generate(name, tp_size=1, rank=0, **run)
    except ValueError as err:  # deterministic: every rank raises the same
        return TPResult(name, world, False, error=str(err))
    diff = max((a - b).abs().max().item() for a, b in zip(tp.logits, ref.logits, strict=True))
    same = tp.tokens == ref.tokens
    match = compare_generation(ref_model, tp) if rank == 0 else None
    # every rank's verdict: a rank whose hidden states diverge (a bias added on one rank only)
    # is wrong even when rank 0 is right
    stats = torch.tensor([diff, 0.0 if same else 1.0, 0.0 if match is None or match.ok else 1.0])
    stats = stats.to(run["device"])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    diff, differ, mismatch = (float(x) for x in stats.tolist())
    exact = run.get("dtype", "float32") == "float32"
    ok = not mismatch and (not exact or (diff < 1e-4 and not differ))
    text = match.short() if match is not None else ""
    return TPResult(name, world, ok, diff, not differ, text, tp_bytes, ref_bytes)


def _check_encoder(name: str, *, rank: int, world: int, **run: Any) -> TPResult:
    """:func:`check_family` for an encoder stack: every block's hidden states and the final
    output of TP=``world`` vs TP=1 on every rank, and vs transformers' unsharded tower on rank
    0 (every block and the output within the dtype's tolerance)."""
    try:
        _, tp, _ = tp_encode(name, tp_size=world, rank=rank, **run)
        ref_model, ref, (pixels, grid_thw) = tp_encode(name, tp_size=1, rank=0, **run)
    except ValueError as err:  # deterministic: every rank raises the same
        return TPResult(name, world, False, error=str(err))
    pairs = [
        *zip(tp.blocks, ref.blocks, strict=True),
        (tp.merged, ref.merged),
        *zip(tp.deepstack, ref.deepstack, strict=True),
    ]
    diff = max((a - b).abs().max().item() for a, b in pairs)
    match = compare_vision(ref_model, tp, pixels, grid_thw) if rank == 0 else None
    # every rank's verdict, as check_family: a rank whose hidden states diverge fails the family
    stats = torch.tensor([diff, 0.0 if match is None or match.ok else 1.0]).to(run["device"])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    diff, mismatch = (float(x) for x in stats.tolist())
    exact = run.get("dtype", "float32") == "float32"
    ok = not mismatch and (not exact or diff < 1e-4)
    text = match.short() if match is not None else ""
    return TPResult(name, world, ok, diff, False, text, 0, 0, blocks=len(tp.blocks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="qwen3", help=f"'all' or a comma list of {TP_FAMILIES}")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--json", default=None, help="write rank 0's results to this file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shapes", default="tiny", choices=list(SHAPES), help="the samples' sizes")
    parser.add_argument(
        "--plugins",
        action="store_true",
        help="select from the plugins installed (entry points), not the reference alone",
    )
    args = parser.parse_args(argv)
    names = (
        list(TP_FAMILIES)
        if args.model == "all"
        else [n.strip() for n in args.model.split(",") if n.strip()]
    )
    unknown = [n for n in names if n not in _BUILDERS]
    if unknown or not names:
        parser.error(f"--model {args.model!r}: expected 'all' or names of {list(TP_FAMILIES)}")
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    registry = None
    if args.plugins:
        from attn_core.registry import Registry

        registry = Registry.discover()
    results: list[TPResult] = []
    try:
        for name in names:
            result = check_family(
                name,
                rank=rank,
                world=world,
                device=device,
                prompts=args.prompts,
                new_tokens=args.new_tokens,
                dtype=args.dtype,
                shapes=args.shapes,
                registry=registry,
            )
            results.append(result)
            if rank == 0:
                print(result.format(), flush=True)
    finally:
        end_group()
    if rank == 0:
        write_results(args.json, results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    exit_now(main())
