"""Named workloads (step sequences) and the random inputs of one layer for one step.

A workload is a list of :class:`Step`; request ids are small ints. Lengths are chosen so that the
interesting boundaries are hit: ragged batches, chunks ending on and just past a page boundary,
a request of one token, speculative verify with ``k + 1`` tokens per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attn_core.specs import LayerKind, LayerSpec, LinearVariant, torch_dtype

__all__ = [
    "LARGE_MAGNITUDE",
    "WORKLOADS",
    "InputBank",
    "Step",
    "Workload",
    "layer_inputs",
    "scale_inputs",
    "workload",
]

#: Magnitude of the kit's large-input bfloat16 case: past float16's largest finite value (65504),
#: far inside bfloat16's range (3.4e38). A power of two, so scaling is exact in every float
#: format: a correct backend's output is exactly this many times its unit-scale output.
LARGE_MAGNITUDE = 2.0**17


@dataclass(slots=True)
class Step:
    """One step of a workload.

    :ivar requests: ``(request id, new tokens)`` in batch order (encoder: ``(id, length)``).
    :ivar add: requests to add to the state before the step.
    :ivar release: requests to release after the step.
    :ivar spec_tokens: ``k`` for a speculative-verify step (every request has ``k + 1`` tokens).
    :ivar pad_to: pad the batch to this many requests (graph-style decode).
    :ivar pad_tokens_to: with ``pad_to``, pad to this many tokens: a captured mixed step of
        graph mode ``full`` (``BatchBuilder.build(pad_tokens_to=...)``).
    """

    requests: list[tuple[int, int]]
    add: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    spec_tokens: int = 0
    pad_to: int | None = None
    pad_tokens_to: int | None = None


@dataclass(slots=True)
class Workload:
    name: str
    steps: list[Step]
    max_len: int = 0  # longest request (tokens, speculative drafts included)
    max_batch: int = 0
    max_tokens: int = 0
    num_requests: int = 0
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        lens: dict[int, int] = {}
        for s in self.steps:
            self.max_batch = max(self.max_batch, s.pad_to or len(s.requests))
            tokens = sum(n for _, n in s.requests) + max(0, (s.pad_to or 0) - len(s.requests))
            self.max_tokens = max(self.max_tokens, tokens, s.pad_tokens_to or 0)
            for r, n in s.requests:
                lens[r] = lens.get(r, 0) + n
        self.num_requests = len(lens)
        self.max_len = max(lens.values(), default=0)


def _prefill_then_decode(lens: list[int], decodes: int) -> list[Step]:
    ids = tuple(range(len(lens)))
    steps = [Step(list(zip(ids, lens, strict=True)), add=ids)]
    steps += [Step([(r, 1) for r in ids]) for _ in range(decodes)]
    return steps


def _decode(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    return _prefill_then_decode([5, 9, 3, 12], 2 if quick else 4)


def _prefill(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    ids = (0, 1, 2, 3)
    return [Step(list(zip(ids, (6, 13, 2, 9), strict=True)), add=ids)]


def _mixed(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    return [
        Step([(0, 8), (1, 5)], add=(0, 1)),
        Step([(0, 1), (2, 7), (1, 1)], add=(2,)),  # decodes with a new prefill chunk
        Step([(2, 4), (0, 1), (1, 1)]),  # a chunk that continues a prefill
        Step([(0, 1), (1, 1), (2, 1)]),
    ]


def _ragged(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    return _prefill_then_decode([1, 17, 2, 33, 5], 2)


def _page_boundary(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    ps = spec.page_size if spec.has_kv_cache else 16
    lens = sorted({max(ps - 1, 1), ps, ps + 1, 2 * ps})
    ids = tuple(range(len(lens)))
    steps = [Step(list(zip(ids, lens, strict=True)), add=ids)]
    steps += [Step([(r, 1) for r in ids]) for _ in range(2)]  # ps-1 -> ps -> ps+1
    steps.append(Step([(0, ps), *((r, 1) for r in ids[1:])]))  # a chunk of exactly one page
    return steps


def _long_context(spec: LayerSpec, quick: bool, k: int, *, cuda: bool = False) -> list[Step]:
    n = 4096 if cuda else 1000
    return [
        Step([(0, n // 2), (1, 37)], add=(0, 1)),
        Step([(0, n - n // 2), (1, 1)]),
        Step([(0, 1), (1, 1)]),
    ]


def _tiny_batch(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    return _prefill_then_decode([5], 3)


def _verify(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    ids = (0, 1, 2)
    # verified in another order than added: a batch row is not its request's slot (a commit
    # that reads per-token states by slot instead of by row reads the wrong request's)
    order = (2, 0, 1)
    return [
        Step(list(zip(ids, (6, 11, 3), strict=True)), add=ids),
        Step([(r, k + 1) for r in order], spec_tokens=k),
        Step([(r, k + 1) for r in order], spec_tokens=k),
        Step([(r, 1) for r in ids]),
    ]


def _lifecycle(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
    # requests join, finish and come back in other batch positions, with chunked prefills
    return [
        Step([(0, 7), (1, 3)], add=(0, 1)),
        Step([(0, 1), (1, 1)]),
        Step([(1, 1), (2, 9), (0, 1)], add=(2,)),
        Step([(2, 1), (0, 1), (1, 1)], release=(1,)),
        Step([(3, 18), (0, 1), (2, 1)], add=(3,)),
        Step([(0, 1), (2, 1), (3, 1)], release=(0,)),
        Step([(3, 1), (2, 1)]),
        Step([(4, 2), (5, 5), (2, 1), (3, 1)], add=(4, 5)),
        Step([(5, 1), (4, 1), (3, 1)], release=(2,)),
        Step([(3, 1)]),
        Step([(4, 1), (5, 1), (3, 1)], release=(3, 4, 5)),
        Step([(6, 4)], add=(6,)),
        Step([(6, 1)]),
    ]


def _encoder(lens_by_step: list[list[int]]) -> Callable[..., list[Step]]:
    def steps(spec: LayerSpec, quick: bool, k: int) -> list[Step]:
        return [Step(list(enumerate(lens))) for lens in lens_by_step]

    return steps


WORKLOADS: dict[str, Callable[..., list[Step]]] = {
    "decode": _decode,
    "prefill": _prefill,
    "mixed": _mixed,
    "ragged": _ragged,
    "page_boundary": _page_boundary,
    "long_context": _long_context,
    "tiny_batch": _tiny_batch,
    "verify": _verify,
    "lifecycle": _lifecycle,
}
ENCODER_WORKLOADS: dict[str, Callable[..., list[Step]]] = {
    "prefill": _encoder([[7, 16, 3]]),
    "ragged": _encoder([[1, 33, 5, 12]]),
    "tiny_batch": _encoder([[9]]),
    "long_context": _encoder([[1000, 24]]),
    "lifecycle": _encoder([[7, 3], [12], [1, 1, 30], [5, 8, 2, 9], [16]]),
}


def workload(
    name: str, spec: LayerSpec, *, quick: bool, spec_tokens: int = 0, cuda: bool = False
) -> Workload:
    """The named workload for ``spec`` (encoder layers have their own step lists)."""
    table = ENCODER_WORKLOADS if spec.kind is LayerKind.ENCODER else WORKLOADS
    if name not in table:
        raise ValueError(
            f"workload {name!r} is unknown for {spec.kind.value}; known: {sorted(table)}"
        )
    fn = table[name]
    if fn is _long_context:
        steps = _long_context(spec, quick, spec_tokens, cuda=cuda)
    else:
        steps = fn(spec, quick, spec_tokens)
    return Workload(name, steps)


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def layer_inputs(spec: LayerSpec, tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random forward inputs of one layer for ``tokens`` rows, float32 on the CPU.

    Keys: ``q``, ``k``, ``v`` (``v`` absent for MLA) and the kind's extra inputs (``g``,
    ``beta`` / ``dt``, ``A_log``, ``D``, ``dt_bias``); linear layers also get the conv input
    ``conv_x [T, conv_channels]``. Shapes follow :mod:`attn_core.specs`. :func:`to_device`
    casts them to the layer dtype.
    """
    T, H, Hk, D, Dv = tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    if spec.kind in (LayerKind.FULL, LayerKind.ENCODER):
        return {"q": _randn(gen, T, H, D), "k": _randn(gen, T, Hk, D), "v": _randn(gen, T, Hk, Dv)}
    if spec.kind is LayerKind.MLA:
        return {"q": _randn(gen, T, H, D), "k": _randn(gen, T, D)}
    if spec.linear_variant is LinearVariant.SHORT_CONV:  # the conv is the whole core
        return {"conv_x": _randn(gen, T, spec.conv_dims[0])}
    out = {"q": _randn(gen, T, Hk, D), "k": _randn(gen, T, Hk, D), "v": _randn(gen, T, H, Dv)}
    if spec.linear_variant is LinearVariant.LIGHTNING:
        # SiLU-activated q, k as MiniMax feeds them, and decay rates from e^-1.5 (a short
        # memory) to e^-0.01 per token; no conv.
        out["q"], out["k"] = F.silu(out["q"]), F.silu(out["k"])
        out["slope"] = torch.rand(H, generator=gen) * 1.5 + 0.01
        return out
    if spec.linear_variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
        out["dt"] = _randn(gen, T, H) - 1.0
        # Mamba1's A is per channel and state entry [H, N], Mamba2's one per head [H]
        a_shape = (H, D) if spec.linear_variant is LinearVariant.MAMBA1 else (H,)
        out["A_log"] = torch.rand(*a_shape, generator=gen).mul(2.0).log1p()
        out["D"] = _randn(gen, H)
        out["dt_bias"] = _randn(gen, H) * 0.5
    else:
        g_shape = (T, H, D) if spec.linear_variant is LinearVariant.KDA else (T, H)
        out["g"] = F.logsigmoid(_randn(gen, *g_shape) + 2.0)  # log decay <= 0, mostly near 0
        out["beta"] = torch.sigmoid(_randn(gen, T, H))
        if not spec.qk_l2norm:
            # the layer takes q and k as they come: keys of norm about 0.5 keep the delta rule
            # contracting (beta |k|^2 < 2), queries of norm about 2 keep the outputs well
            # above the absolute tolerance, and a kernel that normalises them anyway doubles
            # the keys and halves the queries
            out["q"], out["k"] = out["q"] * (2.0 / D**0.5), out["k"] * (0.5 / D**0.5)
    out["conv_x"] = _randn(gen, T, spec.conv_dims[0])
    return out


def scale_inputs(
    inputs: dict[str, torch.Tensor], spec: LayerSpec, magnitude: float
) -> dict[str, torch.Tensor]:
    """``layer_inputs`` whose values reach ``magnitude`` while the logits stay as they were.

    Softmax kinds (full, encoder, mla): ``q / M``, ``k * M`` (the MLA latent too) and ``v * M``:
    ``q . k`` is unchanged (exactly, for a power of two) and the output is ``M`` times larger.
    Linear kinds: ``v * M`` and ``conv_x * M``; output and recurrent state are linear in ``v``
    (q and k are L2-normalised or enter as Mamba's C and B, gates are left alone). A backend that
    computes a bfloat16 layer in float16 turns such values into inf.
    """
    if magnitude == 1.0:
        return inputs
    if spec.kind is LayerKind.LINEAR:
        factors = {"v": magnitude, "conv_x": magnitude}
    else:
        factors = {"q": 1.0 / magnitude, "k": magnitude, "v": magnitude}
    return {name: t * factors[name] if name in factors else t for name, t in inputs.items()}


def conv_params(spec: LayerSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv ``weight [C, K]`` and ``bias [C]`` of a linear layer, float32 on the CPU."""
    c, k = spec.conv_dims
    return _randn(gen, c, k) * 0.5, _randn(gen, c) * 0.1


#: inputs that stay float32 whatever the layer dtype (as the models compute them)
_FLOAT32_INPUTS = frozenset({"g", "A_log", "D", "dt_bias", "slope"})
#: per-layer inputs (not per token): the same tensor whatever the step's tokens
_PER_LAYER_INPUTS = ("A_log", "D", "dt_bias", "slope")


def to_device(inputs: dict[str, torch.Tensor], spec: LayerSpec, device: torch.device):
    """Cast ``layer_inputs`` to the layer dtype (gates stay float32) on ``device``."""
    dtype = torch_dtype(spec.dtype)
    return {
        name: t.to(device=device, dtype=torch.float32 if name in _FLOAT32_INPUTS else dtype)
        for name, t in inputs.items()
    }


class InputBank:
    """Position-indexed inputs: the same token position gets the same inputs in every request.

    Used by the state checks: two requests fed from one bank must produce equal outputs however
    their prefills were chunked or restored.
    """

    def __init__(self, spec: LayerSpec, positions: int, num_layers: int, gen: torch.Generator):
        self.by_layer = [layer_inputs(spec, positions, gen) for _ in range(num_layers)]

    def take(self, layer: int, spans: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Concatenate positions ``[start, end)`` of every span, in order."""
        bank = self.by_layer[layer]
        out = {}
        for name, t in bank.items():
            if t.dim() and name not in _PER_LAYER_INPUTS:
                out[name] = torch.cat([t[a:b] for a, b in spans])
            else:
                out[name] = t
        return out
