"""Tensor parallelism check: Qwen3's attention heads sharded over ranks vs the unsharded run.

Run with ``torchrun --nproc_per_node 2 -m attn_core.e2e.tp_check [--device cuda]`` (gloo on CPU,
nccl on CUDA). Every rank builds the same tiny model (same seed), parses its layout with
``tp_size = world size`` (heads per rank, the same ``specs_from_hf_config`` path a server uses),
keeps its slice of q/k/v heads and of ``o_proj``'s input columns, and all-reduces the attention
output; the MLP stays replicated (this checks attention sharding, not MLP sharding). Logits of
every position are compared with a TP=1 run of the same requests; rank 0 prints the result and
the exit status is 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from attn_core.e2e.configs import TinyModel, build_tiny
from attn_core.e2e.main import default_registry, make_prompts, plan_for
from attn_core.e2e.runner import Engine, GenerationResult

__all__ = ["AllReduceLinear", "shard_attention", "tp_generate"]


class AllReduceLinear(torch.nn.Module):
    """A row-parallel linear: this rank's input columns, summed over ranks (bias added once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:stop])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:stop])
    return out


@torch.no_grad()
def shard_attention(model: TinyModel, rank: int, world: int) -> None:
    """Keep rank ``rank``'s heads of every full-attention layer (in place)."""
    for i in model.layout.layer_indices:
        spec = model.layout.spec_of(i)
        hf: Any = model.hf  # a transformers model: attributes by architecture
        at = hf.model.layers[i].self_attn
        D, Dv, H, Hkv = spec.head_dim, spec.head_dim_v, spec.num_heads, spec.num_kv_heads
        at.q_proj = _rows(at.q_proj, rank * H * D, (rank + 1) * H * D)
        at.k_proj = _rows(at.k_proj, rank * Hkv * D, (rank + 1) * Hkv * D)
        at.v_proj = _rows(at.v_proj, rank * Hkv * Dv, (rank + 1) * Hkv * Dv)
        w = at.o_proj.weight[:, rank * H * Dv : (rank + 1) * H * Dv]
        at.o_proj = AllReduceLinear(w, at.o_proj.bias if rank == 0 else None)


def tp_generate(
    name: str, *, device: torch.device, tp_size: int, rank: int, prompts: int, new_tokens: int
) -> GenerationResult:
    model = build_tiny(name, device=device, tp_size=tp_size)
    if tp_size > 1:
        shard_attention(model, rank, tp_size)
    registry = default_registry()
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
    return engine.generate(ids, new_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    if args.model != "qwen3":
        raise SystemExit("tp_check shards dense GQA attention only: --model qwen3")
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        tp = tp_generate(
            args.model,
            device=device,
            tp_size=world,
            rank=rank,
            prompts=args.prompts,
            new_tokens=args.new_tokens,
        )
        ref = tp_generate(
            args.model,
            device=device,
            tp_size=1,
            rank=0,
            prompts=args.prompts,
            new_tokens=args.new_tokens,
        )
        diff = max((a - b).abs().max().item() for a, b in zip(tp.logits, ref.logits, strict=True))
        same = tp.tokens == ref.tokens
        ok = diff < 1e-4 and same
        if rank == 0:
            print(
                f"tp_check {args.model}: tp={world} vs tp=1 max|diff|={diff:.2e} "
                f"tokens {'equal' if same else 'DIFFER'} -> {'OK' if ok else 'MISMATCH'}"
            )
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
