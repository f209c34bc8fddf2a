"""What both slot-pass tests (GDN, KDA) share: the chunks of a varlen batch, the CPU check of
the chunked formulation against fla's naive recurrence, and the GPU check of a prefill through
the slot pass against the same prefill gathering and scattering around fla's public function."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import torch


def chunk_spans(lens: list[int], chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` token offsets of every ``chunk``-token chunk of every sequence of
    ``lens`` (packed in order); a sequence's last chunk may be shorter."""
    out, s0 = [], 0
    for n in lens:
        out += [(s0 + c, s0 + min(c + chunk, n)) for c in range(0, n, chunk)]
        s0 += n
    return out


def assert_chunked_matches_naive(
    naive: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    chunked: Callable[..., torch.Tensor],
    make_gate: Callable[[int, int, int, torch.Generator], torch.Tensor],
    *,
    chunk: int,
    slots: list[int],
    num_slots: int,
    device: str,
    repeat_qk_for_naive: bool = False,
) -> None:
    """``chunked(q, k, v, gate, beta, state, idx, lens, scale)`` (writing the final states into
    ``state [num_slots, HV, K, V]`` at ``idx``) against fla's token-by-token ``naive`` per
    sequence (which computes in float32), outputs and final states: sequences of 70, 5 and
    ``chunk`` tokens (ending inside and on chunk ends), one key head, two value heads, head dims
    16, random unit-norm keys and ``make_gate(T, HV, K, generator)``. ``repeat_qk_for_naive``:
    q and k go to ``naive`` repeated to the value heads. Within 1e-5 relative on the CPU
    (interpreted), 5e-3 compiled (tf32 dots)."""
    lens, H, HV, Kd, Vd = [70, 5, chunk], 1, 2, 16, 16
    T = sum(lens)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(T, H, Kd, generator=g)
    k = torch.nn.functional.normalize(torch.randn(T, H, Kd, generator=g), dim=-1)
    v = torch.randn(T, HV, Vd, generator=g)
    gate = make_gate(T, HV, Kd, g)
    beta = torch.rand(T, HV, generator=g)
    state = torch.randn(num_slots, HV, Kd, Vd, generator=g) * 0.3
    idx = torch.tensor(slots[: len(lens)], dtype=torch.int32)
    scale = Kd**-0.5
    want_o, want_ht, s0 = [], {}, 0
    for i, n in enumerate(lens):
        qi, ki = (x[s0 : s0 + n] for x in (q, k))
        if repeat_qk_for_naive:
            qi, ki = (x.repeat_interleave(HV // H, dim=1) for x in (qi, ki))
        # by keyword: fla's GDN takes (.., beta, g), its KDA (.., g, beta)
        o_i, ht_i = naive(
            *(x[None].double() for x in (qi, ki, v[s0 : s0 + n])),
            g=gate[s0 : s0 + n][None].double(), beta=beta[s0 : s0 + n][None].double(),
            scale=scale, initial_state=state[int(idx[i])][None].double(),
            output_final_state=True,
        )  # fmt: skip
        want_o.append(o_i[0])
        want_ht[int(idx[i])] = ht_i[0]
        s0 += n
    want = torch.cat(want_o)
    slots_dev = state.to(device)
    got = chunked(
        *(x.to(device) for x in (q, k, v, gate, beta)), slots_dev, idx.to(device), lens, scale
    ).cpu()
    tol = 1e-5 if device == "cpu" else 5e-3
    assert (got - want).abs().max().item() < tol * want.abs().max().item()
    for slot, ht in want_ht.items():
        err = (slots_dev[slot].cpu().double() - ht).abs().max().item()
        assert err < tol * ht.abs().max().item(), slot


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


def one_config_per_fla_autotuner(monkeypatch: pytest.MonkeyPatch) -> int:
    """Give every autotuned kernel of the imported fla modules a single config (its last), so
    that fla's stages run in Triton's interpreter: an autotuner with several configs times them
    on a GPU driver, which the interpreter has not. Restored by ``monkeypatch``.

    :returns: how many autotuners were narrowed.
    """
    from triton.runtime.autotuner import Autotuner

    def wrapped(obj: object) -> Iterator[object]:  # heuristics wrap the autotuner: follow .fn
        while obj is not None and not isinstance(obj, type):
            yield obj
            obj = getattr(obj, "fn", None)

    narrowed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            for obj in wrapped(value):
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    monkeypatch.setattr(obj, "configs", obj.configs[-1:])
                    narrowed += 1
    return narrowed


def fla_stages_here(kind: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless fla's internal stages of ``kind`` (``"gdn"``, ``"kda"``) load here; on the
    CPU narrow fla's autotuners (:func:`one_config_per_fla_autotuner`) so that they run in
    Triton's interpreter."""
    from attn_plugin_triton_ssm import compat

    reason = compat.stages(kind)[1]  # type: ignore[arg-type]
    if reason:
        pytest.skip(f"fla's {kind} stages: {reason}")
    if device == "cpu":
        assert one_config_per_fla_autotuner(monkeypatch) > 0


def slot_path_on_fla_stages(
    slot_fn: Callable[..., torch.Tensor], out_kind: str
) -> Callable[..., torch.Tensor]:
    """``slot_fn`` (``gdn_chunk_prefill_slots`` / ``kda_chunk_prefill_slots``: fla's stages
    around the slot pass) as :func:`assert_chunked_matches_naive` calls its ``chunked``, q and k
    taken as they come (no l2norm). ``out_kind``: ``"none"`` (the function allocates),
    ``"given"`` (a NaN-filled contiguous ``out``, which must be what comes back, written in
    place) or ``"strided"`` (a NaN-filled ``out`` whose rows are not packed: the output is
    copied into it)."""

    def chunked(q, k, v, gate, beta, state, idx, lens, scale):
        cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        T, HV, V = v.shape
        out = None
        if out_kind == "given":
            out = torch.full_like(v, float("nan"))

            def no_copy(*_: object, **__: object) -> None:
                raise AssertionError("out was filled by a copy, not by the output pass")

            out.copy_ = no_copy  # type: ignore[method-assign]
        elif out_kind == "strided":
            out = torch.full((T, HV, 2 * V), float("nan"), device=v.device)[..., :V]
        got = slot_fn(
            q, k, v, gate, beta, state, idx, cu_cpu.to(v.device), cu_cpu, scale=scale,
            use_qk_l2norm=False, out=out,
        )  # fmt: skip
        if out is not None:
            assert got is out and not got.isnan().any()
        return got

    return chunked
