"""What both slot-pass tests (GDN, KDA) share: the chunks of a varlen batch, and the GPU check
of a prefill through the slot pass against the same prefill gathering and scattering around
fla's public function."""

from __future__ import annotations

from collections.abc import Callable

import torch


def chunk_spans(lens: list[int], chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` token offsets of every ``chunk``-token chunk of every sequence of
    ``lens`` (packed in order); a sequence's last chunk may be shorter."""
    out, s0 = [], 0
    for n in lens:
        out += [(s0 + c, s0 + min(c + chunk, n)) for c in range(0, n, chunk)]
        s0 += n
    return out


def assert_slot_pass_matches_gathered(
    prefill: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    idx: torch.Tensor,
    cu: torch.Tensor,
) -> None:
    """``prefill`` (``gdn_prefill`` / ``kda_prefill``) with ``slot_pass=True`` on ``state`` and
    with ``slot_pass=False`` on a copy: outputs within 2e-3 mean relative, final states within
    1e-3 (fp32 state) or 1e-2 (bf16) of the largest, every other slot bit-identical."""
    cu_cpu = cu.cpu()
    gathered = state.clone()
    y_slots = prefill(q, k, v, g, beta, state, idx, cu, cu_seqlens_cpu=cu_cpu, slot_pass=True)
    y_fla = prefill(q, k, v, g, beta, gathered, idx, cu, cu_seqlens_cpu=cu_cpu, slot_pass=False)
    rel = ((y_slots.float() - y_fla.float()).abs().mean() / y_fla.float().abs().mean()).item()
    assert rel < 2e-3, rel
    s_rel = ((state.float() - gathered.float()).abs().max() / gathered.float().abs().max()).item()
    assert s_rel < (1e-3 if state.dtype == torch.float32 else 1e-2), s_rel
    untouched = [s for s in range(state.shape[0]) if s not in idx.tolist()]
    assert torch.equal(state[untouched], gathered[untouched])
