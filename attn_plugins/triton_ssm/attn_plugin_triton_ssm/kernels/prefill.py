"""Chunked prefill: thin wrappers over fla-core's chunk kernels (GDN, KDA) and, for Mamba2, our
Triton chunked SSD (:mod:`~attn_plugin_triton_ssm.kernels.ssd`) or a chunked SSD in torch, all
with the state in slots.

Every wrapper takes the step's tokens packed (varlen) with ``cu_seqlens`` ``[N + 1]``, starts
each of the ``N`` sequences from its state in ``ssm_state[state_indices]`` and leaves the final
state in the same slot. Gated DeltaNet and KDA on CUDA read and write the slots in our own state
pass (:mod:`.gdn_chunk`); the other paths (and these where fla's stages are off) gather the
initial states into a dense tensor, run the chunked algorithm and scatter the final states
back. Prefill is not graph-captured, so no
padding rows are expected: every ``state_indices`` entry must be a valid slot.

fla's chunk kernels need CUDA. On CPU the GDN/KDA wrappers fall back to fla's naive recurrent
functions (slow; for tests and small experiments), so the gather/scatter logic runs everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_plugin_triton_ssm import compat
from attn_plugin_triton_ssm.kernels import gdn_chunk
from attn_plugin_triton_ssm.kernels._common import (
    STATE_DTYPES,
    check_dtype,
    check_shape,
)

__all__ = ["gdn_prefill", "kda_prefill", "mamba2_prefill"]

_L2_EPS = 1e-6


def _check_varlen(state_indices: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> int:
    check_shape("cu_seqlens", cu_seqlens, [None], "[N + 1] (int32/int64, starts at 0)")
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    n = cu_seqlens.shape[0] - 1
    if n < 1:
        raise ValueError("cu_seqlens: expected at least 2 entries [0, ..., T], got 1")
    check_shape("state_indices", state_indices, [n], f"[N={n}] (one slot per sequence)")
    check_dtype("state_indices", state_indices, (torch.int32, torch.int64))
    del total  # the last offset is checked by the kernels; reading it would sync the device
    return n


def _host_offsets(cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor | None:
    # .long() returns the tensor itself when it is int64 already: pass int64 offsets (device
    # and host) so that fla's identity-keyed cache of chunk indices hits across layers.
    return None if cu_seqlens_cpu is None else cu_seqlens_cpu.long()


def _l2(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def _delta_prefill(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens, *, kda, scale,
                   use_qk_l2norm, out, cu_seqlens_cpu, slot_pass=None):  # fmt: skip
    check_shape("q", q, [None, None, None], "[T, Hk, Dk] (packed tokens)")
    T, Hk, Dk = q.shape
    check_shape("k", k, [T, Hk, Dk], "[T, Hk, Dk] like q")
    check_shape("v", v, [T, None, None], "[T, Hv, Dv]")
    Hv, Dv = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"v: value heads Hv={Hv} must be a multiple of key heads Hk={Hk}")
    if kda:
        check_shape("g", g, [T, Hv, Dk], "[T, Hv, Dk] (KDA per-channel log decay)")
    else:
        check_shape("g", g, [T, Hv], "[T, Hv] (GDN per-head log decay)")
    check_shape("beta", beta, [T, Hv], "[T, Hv]")
    check_shape("ssm_state", ssm_state, [None, Hv, Dk, Dv], "[S, Hv, Dk, Dv]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    _check_varlen(state_indices, cu_seqlens, T)
    if out is not None:  # before any slot is written
        check_shape("out", out, [T, Hv, Dv], "[T, Hv, Dv]")
    if scale is None:
        scale = Dk**-0.5
    kind = "kda" if kda else "gdn"
    if slot_pass is None:
        slot_pass = _slot_pass_serves(q, ssm_state, kind)
    elif slot_pass and not _slot_pass_serves(q, ssm_state, kind):
        raise ValueError(
            f"slot_pass=True ({kind} prefill): needs CUDA, K <= 256, each slot's [Hv, Dk, Dv] "
            f"contiguous and fla-core's {kind} stages "
            f"({gdn_chunk.unavailable(kind) or 'importable'}); got q on {q.device}, K={Dk}, "
            f"slot strides {list(ssm_state.stride()[1:])}"
        )
    if slot_pass:
        slot_fn = gdn_chunk.kda_chunk_prefill_slots if kda else gdn_chunk.gdn_chunk_prefill_slots
        o = slot_fn(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            ssm_state, state_indices, cu_seqlens.long(), _host_offsets(cu_seqlens_cpu),
            scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
        )  # fmt: skip
        return o  # out itself when given: written in place (or copied) by the slot pass
    idx = state_indices.long()
    h0 = ssm_state.index_select(0, idx).float()

    if q.is_cuda:
        chunk_fn = compat.public_chunk(kda=kda)
        o, ht = chunk_fn(
            q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=_host_offsets(cu_seqlens_cpu),
        )  # fmt: skip
        o = o[0]
    else:
        o, ht = _naive_varlen(q, k, v, g, beta, h0, cu_seqlens, kda=kda, scale=scale,
                              use_qk_l2norm=use_qk_l2norm)  # fmt: skip
    ssm_state.index_copy_(0, idx, ht.to(ssm_state.dtype))
    return _finish(o, v, out)


def _slot_pass_serves(q: torch.Tensor, ssm_state: torch.Tensor, kind: compat.Kind) -> bool:
    """Whether :mod:`.gdn_chunk` (the state pass reading and writing slots) takes this call."""
    Dk, Dv = ssm_state.shape[2], ssm_state.shape[3]
    return (
        q.is_cuda
        and Dk <= 256
        and ssm_state.stride()[1:] == (Dk * Dv, Dv, 1)
        and compat.slot_pass_reason(q.device, kind) is None  # gate, imports, self-check
    )


def _finish(o: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def _naive_varlen(q, k, v, g, beta, h0, cu_seqlens, *, kda, scale, use_qk_l2norm):
    """CPU fallback: fla's naive recurrences, one sequence at a time."""
    naive_recurrent_gated_delta_rule, naive_recurrent_kda = compat.naive_recurrences()

    group = v.shape[1] // q.shape[1]
    if use_qk_l2norm:
        q, k = _l2(q), _l2(k)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    ht = torch.empty_like(h0)
    bounds = cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        args = [t[s:e][None].float() for t in (q, k, v, g, beta)]
        if kda:
            oi, hi = naive_recurrent_kda(
                args[0], args[1], args[2], args[3], args[4], scale=scale,
                initial_state=h0[i : i + 1], output_final_state=True,
            )  # fmt: skip
        else:
            qi, ki = (a.repeat_interleave(group, dim=2) for a in args[:2])
            oi, hi = naive_recurrent_gated_delta_rule(
                qi, ki, args[2], args[4], args[3], scale=scale, initial_state=h0[i : i + 1],
                output_final_state=True,
            )  # fmt: skip
        o[s:e] = oi[0].float()
        ht[i] = hi[0]
    return o, ht


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    slot_pass: bool | None = None,
) -> torch.Tensor:
    """Gated DeltaNet chunked prefill over packed sequences (fla ``chunk_gated_delta_rule``).

    On CUDA the inter-chunk state pass is ours (:mod:`.gdn_chunk`): it reads the initial states
    from their slots and writes the final states back, where fla's public function needs them
    gathered into a dense tensor and scattered back. ``slot_pass`` forces that path (True:
    ``ValueError`` where it cannot serve the call) or fla's public function with the gather and
    scatter (False); None takes the slot pass wherever it serves.

    :param q: ``[T, Hk, Dk]`` packed tokens of ``N`` sequences; ``k`` likewise.
    :param v: ``[T, Hv, Dv]``; ``g`` ``[T, Hv]`` log decay; ``beta`` ``[T, Hv]``.
    :param ssm_state: ``[S, Hv, Dk, Dv]`` float32/bfloat16; slots read as initial states and
        overwritten with the final states.
    :param state_indices: ``[N]`` int32 slots, all valid (no ``-1``).
    :param cu_seqlens: ``[N + 1]`` int32/int64 sequence starts, ``cu_seqlens[-1] == T``.
    :param out: ``[T, Hv, Dv]`` (a new tensor of ``v``'s dtype when ``None``).
    :param cu_seqlens_cpu: the same offsets on the host, when the caller has them: fla then
        plans its chunks without reading ``cu_seqlens`` back from the device (no sync).
    :returns: the output ``[T, Hv, Dv]``.
    """
    return _delta_prefill(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens, kda=False,
                          scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
                          cu_seqlens_cpu=cu_seqlens_cpu, slot_pass=slot_pass)  # fmt: skip


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    slot_pass: bool | None = None,
) -> torch.Tensor:
    """:func:`gdn_prefill` for KDA (fla ``chunk_kda``): ``g`` is ``[T, Hv, Dk]``, the log
    decay per key channel. On CUDA the state pass over slots is ours as for Gated DeltaNet
    (:func:`.gdn_chunk.kda_chunk_prefill_slots`, around fla's KDA stages); ``slot_pass`` as
    there."""
    return _delta_prefill(q, k, v, g, beta, ssm_state, state_indices, cu_seqlens, kda=True,
                          scale=scale, use_qk_l2norm=use_qk_l2norm, out=out,
                          cu_seqlens_cpu=cu_seqlens_cpu, slot_pass=slot_pass)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Mamba2: chunked SSD (Dao & Gu 2024, "ssd_minimal"), in torch, one sequence at a time
# --------------------------------------------------------------------------------------------
def _segsum(x: torch.Tensor) -> torch.Tensor:
    """``[..., L] -> [..., L, L]``: ``out[i, j] = sum(x[j+1 : i+1])`` for ``i >= j``, else -inf."""
    L = x.shape[-1]
    xx = x[..., None].expand(*x.shape, L)
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=-1)
    xx = xx.masked_fill(~mask, 0)
    seg = torch.cumsum(xx, dim=-2)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=0)
    return seg.masked_fill(~keep, float("-inf"))


def _ssd_chunked(X, A, B, C, h0, chunk):
    """One sequence. X ``[L, H, P]`` (already times dt), A ``[L, H]`` (A * dt), B, C
    ``[L, H, N]``, h0 ``[H, N, P]``; returns y ``[L, H, P]`` and the final state ``[H, N, P]``."""
    L = X.shape[0]
    pad = (-L) % chunk
    if pad:  # zero inputs and zero log-decay leave the state as it is
        X, A, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (X, A, B, C))
    nc = X.shape[0] // chunk
    X = X.reshape(nc, chunk, *X.shape[1:])
    B = B.reshape(nc, chunk, *B.shape[1:])
    C = C.reshape(nc, chunk, *C.shape[1:])
    A = A.reshape(nc, chunk, -1).permute(2, 0, 1)  # [H, c, l]
    A_cs = torch.cumsum(A, dim=-1)
    Ld = torch.exp(_segsum(A))  # [H, c, l, s]
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", C, B, Ld, X)
    decay_states = torch.exp(A_cs[..., -1:] - A_cs)  # [H, c, l]
    states = torch.einsum("clhn,hcl,clhp->chnp", B, decay_states, X)
    states = torch.cat([h0[None], states], dim=0)  # [c+1, H, N, P]
    decay_chunk = torch.exp(_segsum(F.pad(A_cs[..., -1], (1, 0))))  # [H, c+1, c+1]
    new_states = torch.einsum("hzc,chnp->zhnp", decay_chunk, states)
    states, final = new_states[:-1], new_states[-1]
    y_off = torch.einsum("clhn,chnp,hcl->clhp", C, states, torch.exp(A_cs))
    y = (y_diag + y_off).reshape(nc * chunk, *X.shape[2:])[:L]
    return y, final


def mamba2_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_softplus: bool = True,
    chunk_size: int | None = None,
    impl: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    states_dtype: torch.dtype | None = None,
    precise: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 chunked prefill (SSD) over packed sequences, state in slots.

    Same math as :func:`~attn_plugin_triton_ssm.kernels.mamba2.mamba2_decode` applied to every
    token. Implementations:

    * ``"triton"``: our two-kernel chunked SSD (:mod:`~attn_plugin_triton_ssm.kernels.ssd`),
      all sequences in one launch each, float32 state and accumulation, B/C shared per group.
      Inputs it cannot serve raise ``ValueError`` (no fallback). ``chunk_size`` 16, 32, 64,
      128 or 256 (default 64, see :data:`~attn_plugin_triton_ssm.kernels.ssd.CHUNK_SIZES`);
      chunks above 64 tokens run on 64-token tiles.
    * ``"torch"``: the chunked SSD in torch, one sequence at a time, in float32 (default chunk
      256). Runs anywhere; slow.
    * ``"fla"``: SSD as scalar-gated linear attention (``q = C``, ``k = B``, ``v = dt * x``, log
      decay ``dt * A``, scale 1) through fla-core's ``chunk_simple_gla``; ``dt * x`` is rounded
      to the activation dtype first, and at Nemotron-H-like shapes single outputs then missed
      the float32 recurrence by more than 2e-2 (bf16). Opt-in.
    * ``"auto"``: ``"triton"`` for CUDA tensors, ``"torch"`` otherwise (CPU; the interpreter
      build runs ``"triton"`` only when asked for).

    Shapes: ``x`` ``[T, H, P]``, ``dt`` ``[T, H]``, ``A_log`` ``[H]``, ``B``/``C``
    ``[T, G, N]``, ``ssm_state`` ``[S, H, N, P]`` (slots read and overwritten), ``state_indices``
    ``[N_seq]``, ``cu_seqlens`` ``[N_seq + 1]`` (device or host), ``cu_seqlens_cpu`` the same
    on the host when the caller has it (no device sync), ``D``/``dt_bias`` ``[H]``, ``z``
    ``[T, H, P]``.
    :param states_dtype: ``"triton"``: the dtype the SSD stores its entering states in between
        its kernels (:func:`~attn_plugin_triton_ssm.kernels.ssd.mamba2_ssd_triton`; None:
        float32); the other implementations keep float32 states.
    :param precise: ``"triton"``: split the float32 dot operands (decay times ``dt``, the
        entering state) in hi + lo halves of the 16-bit input dtype (the default, ~2^-16
        operand error); False rounds them to the input dtype, one dot each, and stores the
        entering states in it, as mamba_ssm's SSD computes (~2^-9 per term). Ignored by the
        other implementations (float32 throughout).
    :param out: ``[T, H, P]`` (the layer's buffer; its shape is checked before any slot is
        written): ``"triton"`` stores ``y`` into it directly where its last dim is packed, the
        others copy ``y`` in.
    :returns: ``y`` ``[T, H, P]`` in ``x``'s dtype: ``out`` when given.
    """
    check_shape("x", x, [None, None, None], "[T, H, P]")
    T, H, P = x.shape
    check_shape("dt", dt, [T, H], "[T, H]")
    check_shape("B", B, [T, None, None], "[T, G, N]")
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"B: heads H={H} must be a multiple of groups G={G}")
    check_shape("C", C, [T, G, N], "[T, G, N]")
    check_shape("ssm_state", ssm_state, [None, H, N, P], "[S, H, N, P]")
    check_dtype("ssm_state", ssm_state, STATE_DTYPES)
    _check_varlen(state_indices, cu_seqlens, T)
    if out is not None:
        check_shape("out", out, [T, H, P], "[T, H, P]")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    if impl not in ("auto", "fla", "torch", "triton"):
        raise ValueError(f"impl: expected 'auto', 'fla', 'torch' or 'triton', got {impl!r}")
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "triton":
        from attn_plugin_triton_ssm.kernels.ssd import DEFAULT_CHUNK, mamba2_ssd_triton

        if cu_seqlens_cpu is None:
            cu_seqlens_cpu = cu_seqlens.cpu()  # chunks are planned on the host: a device sync
        # the scan kernel stores rows with any outer strides but packed heads' values
        direct = out is not None and out.stride(-1) == 1
        y = mamba2_ssd_triton(
            x, dt, A_log, B, C, ssm_state, state_indices, cu_seqlens_cpu, D=D, dt_bias=dt_bias,
            z=z, dt_softplus=dt_softplus, chunk_size=chunk_size or DEFAULT_CHUNK,
            states_dtype=states_dtype or torch.float32, precise=precise,
            out=out if direct else None,
        )  # fmt: skip
        return y if direct else _finish(y, x, out)

    dtf = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dtf = F.softplus(dtf)  # threshold 20, as the decode kernel
    A = -torch.exp(A_log.float())
    if impl == "fla":
        y = _mamba2_fla(x, dtf, A, B, C, ssm_state, state_indices.long(), cu_seqlens,
                        _host_offsets(cu_seqlens_cpu))  # fmt: skip
        if D is not None:
            y = y + D.float()[:, None] * x.float()
        if z is not None:
            y = y * F.silu(z.float())
        return _finish(y, x, out)
    Bh = B.float().repeat_interleave(H // G, dim=1)
    Ch = C.float().repeat_interleave(H // G, dim=1)
    xf = x.float()
    idx = state_indices.long()
    h0 = ssm_state.index_select(0, idx).float()
    y = torch.empty_like(xf)
    ht = torch.empty_like(h0)
    bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        yi, ht[i] = _ssd_chunked(
            xf[s:e] * dtf[s:e, :, None], A * dtf[s:e], Bh[s:e], Ch[s:e], h0[i], chunk_size or 256
        )
        y[s:e] = yi
    if D is not None:
        y = y + D.float()[:, None] * xf
    if z is not None:
        y = y * F.silu(z.float())
    ssm_state.index_copy_(0, idx, ht.to(ssm_state.dtype))
    return _finish(y, x, out)


def _mamba2_fla(x, dtf, A, B, C, ssm_state, idx, cu_seqlens, cu_seqlens_cpu) -> torch.Tensor:
    """SSD through fla's ``chunk_simple_gla``; returns ``y`` ``[T, H, P]`` float32 without the
    ``D`` skip and ``z`` gate, and writes the final states into ``ssm_state[idx]``."""
    chunk_simple_gla = compat.public_simple_gla()
    H, G = x.shape[1], B.shape[1]
    # The kernels want one key head per value head: B and C are shared by H // G heads.
    kq_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    Bh = B.to(kq_dtype).repeat_interleave(H // G, dim=1) if G != H else B.to(kq_dtype)
    Ch = C.to(kq_dtype).repeat_interleave(H // G, dim=1) if G != H else C.to(kq_dtype)
    v = (x.float() * dtf[:, :, None]).to(kq_dtype)
    h0 = ssm_state.index_select(0, idx).float()
    y, ht = chunk_simple_gla(
        Ch[None], Bh[None], v[None], g=(A * dtf)[None], scale=1.0, initial_state=h0,
        output_final_state=True, cu_seqlens=cu_seqlens.to(x.device, torch.long),
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    ssm_state.index_copy_(0, idx, ht.to(ssm_state.dtype))
    return y[0].float()
