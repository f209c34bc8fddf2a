"""Framework overhead: a model decode step through bindings vs the same kernels called directly.

Both paths run the same adapter code on the same prepared decode batch; the only difference is
how the attention core is reached: ``binding.forward`` / ``binding.conv1d`` (input checks, the
``out`` contract, error wrapping) versus the group's bound ``forward`` / ``context.conv1d``
called straight. The step is repeated on an unchanged batch (no state advance), alternating the
two paths so that drift affects both alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attn_core.e2e.adapters import CausalLMAdapter
from attn_core.e2e.configs import TinyModel, build_tiny
from attn_core.e2e.main import default_registry, default_shapes, plan_for, resolve_models
from attn_core.e2e.runner import Engine
from attn_core.specs import ExecutionConstraints

__all__ = ["OverheadReport", "measure_overhead"]


@dataclass(frozen=True, slots=True)
class OverheadReport:
    """Median decode-step times (milliseconds) through bindings and direct, and their ratio.

    :ivar attention_layers: the binding calls of one step: one per op, so a parallel
        hybrid's layer (Falcon-H1: attention and Mamba2) counts twice.
    :ivar per_layer_us: ``(binding - direct) / attention_layers``, microseconds per call.
    """

    model: str
    device: str
    dtype: str
    batch_size: int
    context_len: int
    attention_layers: int
    binding_ms: float
    direct_ms: float
    ratio: float
    per_layer_us: float
    iters: int

    def format(self) -> str:
        return (
            f"{self.model} on {self.device} ({self.dtype}), decode batch {self.batch_size}, "
            f"context {self.context_len}: binding {self.binding_ms:.3f} ms/step, direct "
            f"{self.direct_ms:.3f} ms/step, ratio {self.ratio:.3f} "
            f"({self.per_layer_us:+.1f} us per attention layer, {self.iters} iters)"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_overhead(
    model: str,
    device: str = "cpu",
    *,
    dtype: str | None = None,
    batch_size: int = 8,
    context_len: int = 32,
    iters: int = 20,
    warmup: int = 3,
    registry: Any = None,
    constraints: ExecutionConstraints | None = None,
    shapes: str | None = None,
    model_obj: TinyModel | None = None,
) -> OverheadReport:
    """Time one decode step of the tiny ``model`` through bindings and directly.

    :param model: a decoder architecture name (``qwen3``, ``qwen3-next``, ``deepseek-v3``,
        ``bamba``, ``gpt-oss``); the vision tower has no decode step.
    :param dtype: default bfloat16 on CUDA, float32 on CPU.
    :param batch_size: decode requests in the step.
    :param context_len: tokens already cached per request (prefilled first).
    :param shapes: ``"tiny"`` or ``"kernel"`` model shapes (default: kernel on CUDA).
    :param model_obj: an already built model to measure (``attn run --overhead``: the run's
        own, e.g. at real sizes); ``model`` then only names it and ``shapes`` is unused.
    """
    dev = torch.device(device)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    registry = registry if registry is not None else default_registry()
    if model_obj is not None:
        name, tiny = model, model_obj
    else:
        (name,) = resolve_models(model)
        tiny = build_tiny(name, device=dev, dtype=dtype, shapes=default_shapes(dev, shapes))
    if tiny.is_encoder:
        raise ValueError(f"model {name!r} is an encoder: it has no decode step to measure")
    chunk = max(context_len, 1)
    max_len = context_len + 2
    plan = plan_for(
        tiny,
        registry,
        dev,
        constraints,
        max_batch_size=batch_size,
        max_num_tokens=batch_size * chunk,
        max_model_len=max_len,
        graphs=False,
    )
    engine = Engine(
        tiny,
        plan,
        registry,
        device=dev,
        chunk_size=chunk,
        max_batch_size=batch_size,
        max_model_len=max_len,
    )
    gen = torch.Generator().manual_seed(0)
    hf: Any = tiny.hf  # a transformers PreTrainedModel (get_input_embeddings)
    vocab = int(hf.get_input_embeddings().weight.shape[0])
    ctx = torch.randint(3, min(vocab, 256), (batch_size, context_len + 1), generator=gen).tolist()
    for rid in range(batch_size):
        engine.state.add_request(rid)
    if context_len:
        engine.step([(rid, ctx[rid][:context_len]) for rid in range(batch_size)])
        for rid in range(batch_size):
            engine.state.advance(rid, context_len)
    batch = engine.builder.build([(rid, 1) for rid in range(batch_size)])
    engine.runtime.prepare(batch)
    ids = torch.tensor([c[-1] for c in ctx], dtype=torch.long, device=dev)
    paths = {
        "binding": engine.adapter,
        "direct": CausalLMAdapter(tiny.hf, tiny.layout, engine.runtime, direct=True),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(warmup + iters):
        for key, adapter in paths.items():
            _sync(dev)
            t0 = time.perf_counter()
            adapter.forward(ids, batch.positions)
            _sync(dev)
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
    b = statistics.median(times["binding"]) * 1e3
    d = statistics.median(times["direct"]) * 1e3
    n_layers = len(tiny.layout.layer_indices)  # ops: a parallel layer's index once per op
    return OverheadReport(
        model=name,
        device=str(dev),
        dtype=dtype,
        batch_size=batch_size,
        context_len=context_len,
        attention_layers=n_layers,
        binding_ms=b,
        direct_ms=d,
        ratio=b / d if d else float("nan"),
        per_layer_us=(b - d) * 1e3 / max(n_layers, 1),
        iters=iters,
    )
