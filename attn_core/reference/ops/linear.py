"""Reference math for linear-attention / SSM layers: Gated DeltaNet, KDA, Mamba2 (SSD), Mamba1
(selective scan) and lightning attention (MiniMax-01).

Pure PyTorch, device-agnostic, written from the papers and checked against fla-core's naive
functions and transformers' torch paths. Every op takes a varlen batch (``T`` tokens of ``B``
requests concatenated, see :mod:`attn_core.reference.ops.conv` for ``query_start_loc`` /
``state_indices`` / ``has_initial_state``) and a pool of recurrent states, one slot per request,
updated in place with each request's final state.

State layout: one head's state is ``[Dk, Dv]`` (fla's ``[.., K, V]``); the output of a token is
``o = S^T q``. For Mamba2 ``Dk = N`` (d_state) and ``Dv = P`` (head dim): the pool is
``[S, H, N, P]``, the TRANSPOSE of HF's / mamba_ssm's ``ssm_states`` ``[.., H, P, N]``
(convert with ``.transpose(-1, -2)``). For Mamba1 ``H = d_inner`` (one head per channel),
``N = d_state`` and ``P = 1``: the pool ``[S, d_inner, N, 1]`` has the memory layout of HF's /
mamba_ssm's ``[.., d_inner, d_state]`` (``.squeeze(-1)`` / ``.unsqueeze(-1)``, no transpose).

Maths run in float32 whatever the input dtype; states are stored in the pool's dtype and
outputs in the value's dtype.

Two algorithms per op, selected by ``mode``:

- ``"recurrent"``: the token loop of the paper's recurrence (decode, speculative verify).
- ``"chunked"``: the chunk-parallel prefill form: the WY / UT-transform form of Gated DeltaNet
  (Yang et al. 2024, "Gated Delta Networks"), its per-channel-gate generalisation for KDA, and
  the state-space-dual block decomposition for Mamba2 (Dao & Gu 2024, "Transformers are SSMs"),
  and for Mamba1 (whose decay is per channel and per state entry, so SSD's scalar-decay trick
  does not apply) exact pairwise decays inside each chunk with the state carried across chunks.
- ``"auto"``: chunked for a request with more than one token, recurrent for one token.

``intermediate_states`` (speculative verify, the "native" strategy) makes the op run the token
loop and store the state after every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attn_core.reference.ops.conv import (
    VarlenRequest,
    causal_conv1d,
    check_same_device,
    check_shape,
    prepare_out,
    varlen_requests,
)

__all__ = [
    "LINEAR_MODES",
    "causal_conv1d",
    "gated_delta_rule",
    "kda",
    "l2norm",
    "lightning_attention",
    "mamba1_selective_scan",
    "mamba2_ssd",
]

#: Accepted values of the ``mode`` option.
LINEAR_MODES = ("auto", "recurrent", "chunked")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, as fla's ``l2norm`` (same dtype as x)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _check_options(mode: str, chunk_size: int) -> None:
    if mode not in LINEAR_MODES:
        raise ValueError(f"mode: expected one of {list(LINEAR_MODES)}, got {mode!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")


def _use_chunked(mode: str, num_tokens: int) -> bool:
    return mode == "chunked" or (mode == "auto" and num_tokens > 1)


def _check_intermediate(
    intermediate_states: torch.Tensor | None,
    requests: list[VarlenRequest],
    state_shape: tuple[int, ...],
) -> None:
    if intermediate_states is None:
        return
    max_len = max((r.num_tokens for r in requests), default=0)
    check_shape("intermediate_states", intermediate_states, (len(requests), None, *state_shape))
    if intermediate_states.shape[1] < max_len:
        raise ValueError(
            f"intermediate_states: expected room for max_q_len={max_len} states per request, "
            f"got {intermediate_states.shape[1]}"
        )


# Runs one request: (request, fp32 initial state, where to store the state after each token or
# None) -> (fp32 outputs [L, H, Dv], fp32 final state).
_Kernel = Callable[
    [VarlenRequest, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"
]


def _run_requests(
    requests: list[VarlenRequest],
    state_pool: torch.Tensor,
    out: torch.Tensor,
    intermediate_states: torch.Tensor | None,
    kernel: _Kernel,
) -> torch.Tensor:
    """Walk the requests: read the slot (or zeros), run ``kernel``, write outputs and the slot."""
    check_same_device("ssm_state", state_pool, out.device)
    if intermediate_states is not None:
        check_same_device("intermediate_states", intermediate_states, out.device)
    for req in requests:
        if req.slot < 0:
            out[req.start : req.end].zero_()
            continue
        if req.has_initial_state:
            state = state_pool[req.slot].to(device=out.device, dtype=torch.float32)
        else:
            state = torch.zeros(state_pool.shape[1:], dtype=torch.float32, device=out.device)
        states_out = None if intermediate_states is None else intermediate_states[req.index]
        o, state = kernel(req, state, states_out)
        out[req.start : req.end] = o
        state_pool[req.slot] = state
    return out


# --------------------------------------------------------------------------------------------
# Delta rule (Gated DeltaNet and KDA)
# --------------------------------------------------------------------------------------------


def _delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of the gated delta rule for one request, all heads at once.

    q, k ``[L, H, Dk]`` (q already scaled); v ``[L, H, Dv]``; g ``[L, H, G]`` log decay with
    ``G = 1`` (one gate per head, GDN) or ``G = Dk`` (one per key channel, KDA); beta ``[L, H]``;
    state ``[H, Dk, Dv]``. Per token, as fla's naive_recurrent_*::

        S = diag(exp(g)) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
    """
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, :, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * u[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
        if states_out is not None:
            states_out[t] = state
    if not outputs:
        return v.new_zeros(v.shape), state
    return torch.stack(outputs), state


def _pairwise(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``r[h, t, s] = sum_d a[h, t, d] * b[h, s, d] * decay[h, t, s, d]`` (decay's d may be 1)."""
    if decay.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("htd,hsd,htsd->hts", a, b, decay)


def _delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel gated delta rule (WY / UT transform) for one request; same inputs as the
    recurrent form.

    Inside a chunk, with ``G_t = sum_{s<=t} g_s`` (cumulative log decay from the chunk start)
    and ``S_0`` the state entering the chunk, unrolling the recurrence gives

        u_t = beta_t v_t - beta_t (e^{G_t} k_t)^T S_0 - sum_{s<t} A[t, s] u_s,
        A[t, s] = beta_t sum_d k_t[d] k_s[d] e^{G_t[d] - G_s[d]},

    i.e. ``(I + A) U = beta V - (beta e^{G} K) S_0``: one unit-lower-triangular solve gives
    ``U = U_hat - W S_0`` (the UT transform; ``W`` are the WY "pseudo keys"). Then

        o_t   = (q_t e^{G_t})^T S_0 + sum_{s<=t} u_s sum_d q_t[d] k_s[d] e^{G_t[d] - G_s[d]}
        S_end = e^{G_last} S_0 + sum_s (k_s e^{G_last - G_s}) u_s^T.

    Every exponent is <= 0 (pairs above the diagonal are masked before ``exp``), so nothing
    overflows for any gate values.
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return v.new_zeros(v.shape), state
    # Head-major: [H, L, D].
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
    beta = beta.transpose(0, 1)
    dim_v = v.shape[-1]
    outputs = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        cum = g[:, start:end].cumsum(1)  # [H, c, G]
        size = end - start
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [H, t, s, G]
        decay = diff.masked_fill(~causal[None, :, :, None], -math.inf).exp()

        a_kk = (_pairwise(kc, kc, decay) * bc[:, :, None]).tril(-1)
        system = a_kk + torch.eye(size, dtype=a_kk.dtype, device=a_kk.device)
        rhs = torch.cat([vc * bc[..., None], kc * cum.exp() * bc[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u_hat, w = solved.split([dim_v, solved.shape[-1] - dim_v], dim=-1)
        u = u_hat - w @ state  # [H, c, Dv]

        a_qk = _pairwise(qc, kc, decay)  # zero above the diagonal through `decay`
        outputs.append((qc * cum.exp()) @ state + a_qk @ u)

        last = cum[:, -1:, :]  # [H, 1, G]
        state = state * last.transpose(1, 2).exp() + (kc * (last - cum).exp()).transpose(1, 2) @ u
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def _delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    mode: str,
    intermediate_states: torch.Tensor | None,
    out: torch.Tensor | None,
    per_channel_gate: bool,
) -> torch.Tensor:
    """Checks and driver of :func:`gated_delta_rule` (``per_channel_gate=False``: g is
    ``[T, Hv]``) and :func:`kda` (``per_channel_gate=True``: g is ``[T, Hv, Dk]``)."""
    check_shape("q", q, (None, None, None))
    num_tokens, num_qk_heads, dim_k = q.shape
    check_shape("k", k, (num_tokens, num_qk_heads, dim_k))
    check_shape("v", v, (num_tokens, None, None))
    num_v_heads, dim_v = v.shape[1:]
    if num_qk_heads == 0 or num_v_heads % num_qk_heads != 0:
        raise ValueError(
            f"v: expected a number of value heads that is a multiple of the {num_qk_heads} "
            f"query/key heads, got {num_v_heads}"
        )
    check_shape("beta", beta, (num_tokens, num_v_heads))
    check_shape("ssm_state", ssm_state, (None, num_v_heads, dim_k, dim_v))
    if per_channel_gate:
        check_shape("g", g, (num_tokens, num_v_heads, dim_k))
    else:
        check_shape("g", g, (num_tokens, num_v_heads))
        g = g[..., None]  # one gate per head: the kernels broadcast a gate dim of 1 over Dk
    _check_options(mode, chunk_size)
    requests = varlen_requests(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=num_tokens,
        num_slots=ssm_state.shape[0],
    )
    _check_intermediate(intermediate_states, requests, (num_v_heads, dim_k, dim_v))
    out = prepare_out(out, (num_tokens, num_v_heads, dim_v), v.dtype, v.device)

    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (dim_k**-0.5 if scale is None else scale)
    # Grouped value heads: value head h reads query/key head h // (Hv / Hk).
    group = num_v_heads // num_qk_heads
    qf, kf = qf.repeat_interleave(group, dim=1), kf.repeat_interleave(group, dim=1)
    vf, gf, bf = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)

    def kernel(
        req: VarlenRequest, state: torch.Tensor, states_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(req.start, req.end)
        args = (qf[sl], kf[sl], vf[sl], gf[sl], bf[sl], state)
        if states_out is None and _use_chunked(mode, req.num_tokens):
            return _delta_rule_chunked(*args, chunk_size)
        return _delta_rule_recurrent(*args, states_out)

    return _run_requests(requests, ssm_state, out, intermediate_states, kernel)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    mode: str = "auto",
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated DeltaNet (Qwen3-Next) over a varlen batch with a slot pool of states.

    Per value head, per token (fla's ``naive_recurrent_gated_delta_rule``)::

        S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T (q * scale)

    with q and k first L2-normalised over Dk when ``use_qk_l2norm`` (eps 1e-6, as fla).

    :param q: ``[T, Hk, Dk]`` queries.
    :param k: ``[T, Hk, Dk]`` keys.
    :param v: ``[T, Hv, Dv]`` values; ``Hv`` a multiple of ``Hk``, value head ``h`` uses
        query/key head ``h // (Hv / Hk)``.
    :param g: ``[T, Hv]`` log decay (<= 0), e.g. ``-exp(A_log) * softplus(a + dt_bias)``.
    :param beta: ``[T, Hv]`` write strength in (0, 1), e.g. ``sigmoid(b)``.
    :param ssm_state: ``[S, Hv, Dk, Dv]`` slot pool (float32 or bfloat16), updated in place.
    :param query_start_loc: ``[B + 1]`` int32 cu-seqlens.
    :param state_indices: ``[B]`` int32 slots (negative: padding request, output zeros).
    :param has_initial_state: ``[B]`` bool; False starts from a zero state.
    :param scale: query scale; None means ``Dk ** -0.5``.
    :param use_qk_l2norm: L2-normalise q and k inside the op.
    :param chunk_size: tokens per chunk of the chunked form.
    :param mode: ``"auto"`` | ``"recurrent"`` | ``"chunked"`` (see the module docstring).
    :param intermediate_states: optional ``[B, >= max_q_len, Hv, Dk, Dv]`` (any float dtype,
        written in its own dtype); when given every request runs the token loop, whatever
        ``mode`` says, and ``[b, i]`` receives the state after its token ``i`` (entries past a
        request's length, and rows of padding requests, are left alone).
    :param out: optional ``[T, Hv, Dv]`` output buffer (written and returned).
    :returns: ``[T, Hv, Dv]`` in ``v.dtype`` (or ``out``).
    """
    return _delta_rule(
        q,
        k,
        v,
        g,
        beta,
        ssm_state,
        query_start_loc,
        state_indices,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        mode=mode,
        intermediate_states=intermediate_states,
        out=out,
        per_channel_gate=False,
    )


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    mode: str = "auto",
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kimi Delta Attention over a varlen batch with a slot pool of states.

    As :func:`gated_delta_rule` but the decay is per key channel (fla's ``naive_recurrent_kda``:
    the state is decayed first, then the delta update reads the decayed state)::

        S = diag(exp(g)) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T (q * scale)

    :param g: ``[T, Hv, Dk]`` per-channel log decay (<= 0), already activated (fla's
        ``use_gate_in_kernel`` gate, e.g. ``-exp(A_log) * softplus(g + dt_bias)``, is model
        side).

    Every other argument, the options and the result are those of :func:`gated_delta_rule`.
    """
    return _delta_rule(
        q,
        k,
        v,
        g,
        beta,
        ssm_state,
        query_start_loc,
        state_indices,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        mode=mode,
        intermediate_states=intermediate_states,
        out=out,
        per_channel_gate=True,
    )


# --------------------------------------------------------------------------------------------
# Mamba2 (SSD)
# --------------------------------------------------------------------------------------------


def _ssd_recurrent(
    x: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of the discretised SSM for one request.

    x ``[L, H, P]`` already multiplied by dt; log_decay ``[L, H]`` = ``dt * A``; b, c
    ``[L, H, N]``; state ``[H, N, P]``::

        h = exp(dt A) h + B (dt x)^T;  y = h^T C
    """
    outputs = []
    for t in range(x.shape[0]):
        state = state * log_decay[t].exp()[:, None, None] + b[t][:, :, None] * x[t][:, None, :]
        outputs.append(torch.einsum("hn,hnp->hp", c[t], state))
        if states_out is not None:
            states_out[t] = state
    if not outputs:
        return x.new_zeros(x.shape), state
    return torch.stack(outputs), state


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """``r[..., i, j] = sum_{j < s <= i} x[..., s]`` for ``j <= i``, ``-inf`` above the diagonal.

    Summed by a masked cumsum rather than as a difference of prefix sums, so that long runs of
    large negative values do not lose precision (the stable segsum of the SSD paper).
    """
    size = x.shape[-1]
    expanded = x[..., :, None].expand(*x.shape, size)  # [..., s, j] = x[s]
    strictly_lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1)
    sums = expanded.masked_fill(~strictly_lower, 0).cumsum(dim=-2)
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    return sums.masked_fill(~lower, -math.inf)


def _ssd_chunked(
    x: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """State-space-dual chunked scan for one request (Dao & Gu 2024, ``ssd_minimal``).

    Same inputs as :func:`_ssd_recurrent`. The sequence is zero-padded to whole chunks (a pad
    token has ``dt = 0``: it neither decays nor writes the state). Four steps: (1) the diagonal
    blocks, a masked attention ``(C B^T * exp(segsum)) X`` inside each chunk; (2) each chunk's
    own contribution to the state at its end; (3) the recurrence over chunk boundaries, done
    at once with a segsum over chunks (including the initial state); (4) each chunk's read of
    the state entering it.
    """
    num_tokens = x.shape[0]
    pad = (-num_tokens) % chunk_size
    if pad:
        x, log_decay, b, c = (
            torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (x, log_decay, b, c)
        )
    chunks = x.shape[0] // chunk_size
    # [chunk c, position l, head h, ...]
    x, b, c = (t.reshape(chunks, chunk_size, *t.shape[1:]) for t in (x, b, c))
    a = log_decay.reshape(chunks, chunk_size, -1).permute(2, 0, 1)  # [h, c, l]
    a_cum = a.cumsum(-1)

    # 1. intra-chunk outputs.
    within = _segsum(a).exp()  # [h, c, l, s]
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", c, b, within, x)
    # 2. state contributed by each chunk, at its end.
    to_end = (a_cum[..., -1:] - a_cum).exp()  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chnp", b, to_end, x)
    # 3. states entering each chunk (and the final one) from the chunk-level recurrence.
    chunk_states = torch.cat([state[None], chunk_states])  # [c + 1, h, n, p]
    across = _segsum(F.pad(a_cum[..., -1], (1, 0))).exp()  # [h, c + 1, c + 1]
    entering = torch.einsum("hzc,chnp->zhnp", across, chunk_states)
    # 4. read of the entering state, decayed to each position.
    y_off = torch.einsum("clhn,chnp,hcl->clhp", c, entering[:-1], a_cum.exp())
    y = (y_diag + y_off).reshape(chunks * chunk_size, *y_diag.shape[2:])
    return y[:num_tokens], entering[-1]


def _time_step(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """The Mamba time step in float32: ``softplus(dt + dt_bias)`` (either part optional);
    ``dt`` ``[T, H]``, ``dt_bias`` ``[H]``."""
    step = dt.to(torch.float32)
    if dt_bias is not None:
        step = step + dt_bias.to(torch.float32)
    return F.softplus(step) if softplus else step


def mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    chunk_size: int = 64,
    mode: str = "auto",
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 selective SSM (scalar decay per head) over a varlen batch with a slot pool.

    Per head, per token::

        dt = clamp(softplus(dt + dt_bias), *dt_limit);  A = -exp(A_log)
        h  = exp(dt A) h + B (dt x)^T            h: [N, P]
        y  = h^T C + D x

    The gated RMSNorm with ``z`` is model side, not here.

    :param x: ``[T, H, P]`` inputs (after the conv).
    :param dt: ``[T, H]`` raw time step (before bias / softplus).
    :param A_log: ``[H]``; ``A = -exp(A_log)``.
    :param B: ``[T, G, N]`` input projection; head ``h`` uses group ``h // (H / G)``.
    :param C: ``[T, G, N]`` output projection, same grouping.
    :param D: ``[H]`` skip, or None.
    :param dt_bias: ``[H]``, or None.
    :param ssm_state: ``[S, H, N, P]`` slot pool (float32 or bfloat16), updated in place. NOTE:
        transposed relative to HF / mamba_ssm's ``[.., H, P, N]`` cache.
    :param query_start_loc: ``[B + 1]`` int32 cu-seqlens.
    :param state_indices: ``[B]`` int32 slots (negative: padding request, output zeros).
    :param has_initial_state: ``[B]`` bool; False starts from a zero state.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param dt_limit: ``(min, max)`` clamp of the final dt.
    :param chunk_size: tokens per chunk of the chunked (SSD) form.
    :param mode: ``"auto"`` | ``"recurrent"`` | ``"chunked"``.
    :param intermediate_states: optional ``[B, >= max_q_len, H, N, P]``: forces the token loop
        and receives the state after each token of request ``b`` at ``[b, i]``.
    :param out: optional ``[T, H, P]`` output buffer (written and returned).
    :returns: ``[T, H, P]`` in ``x.dtype`` (or ``out``).
    """
    _check_options(mode, chunk_size)
    check_shape("x", x, (None, None, None))
    num_tokens, num_heads, head_dim = x.shape
    check_shape("dt", dt, (num_tokens, num_heads))
    check_shape("A_log", A_log, (num_heads,))
    check_shape("B", B, (num_tokens, None, None))
    num_groups, state_size = B.shape[1:]
    if num_groups == 0 or num_heads % num_groups != 0:
        raise ValueError(
            f"B: expected a number of groups that divides the {num_heads} heads, got {num_groups}"
        )
    check_shape("C", C, (num_tokens, num_groups, state_size))
    if D is not None:
        check_shape("D", D, (num_heads,))
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (num_heads,))
    check_shape("ssm_state", ssm_state, (None, num_heads, state_size, head_dim))
    requests = varlen_requests(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=num_tokens,
        num_slots=ssm_state.shape[0],
    )
    _check_intermediate(intermediate_states, requests, (num_heads, state_size, head_dim))
    out = prepare_out(out, (num_tokens, num_heads, head_dim), x.dtype, x.device)

    step = _time_step(dt, dt_bias, dt_softplus).clamp(min=dt_limit[0], max=dt_limit[1])
    log_decay = step * -A_log.to(torch.float32).exp()  # dt * A, <= 0
    xf = x.to(torch.float32)
    x_dt = xf * step[..., None]
    group = num_heads // num_groups
    bf = B.to(torch.float32).repeat_interleave(group, dim=1)
    cf = C.to(torch.float32).repeat_interleave(group, dim=1)
    skip = None if D is None else xf * D.to(torch.float32)[:, None]

    def kernel(
        req: VarlenRequest, state: torch.Tensor, states_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(req.start, req.end)
        args = (x_dt[sl], log_decay[sl], bf[sl], cf[sl], state)
        if states_out is None and _use_chunked(mode, req.num_tokens):
            y, state = _ssd_chunked(*args, chunk_size)
        else:
            y, state = _ssd_recurrent(*args, states_out)
        return (y if skip is None else y + skip[sl]), state

    return _run_requests(requests, ssm_state, out, intermediate_states, kernel)


# --------------------------------------------------------------------------------------------
# Lightning attention (MiniMax-Text-01 / MiniMax-M1)
# --------------------------------------------------------------------------------------------


def _lightning_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: torch.Tensor,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of lightning attention for one request.

    q (already scaled), k ``[L, H, Dk]``; v ``[L, H, Dv]``; log_decay ``[H]`` (``-slope``, the
    same for every token); state ``[H, Dk, Dv]``::

        S = exp(-slope) S + k v^T;  o = S^T q
    """
    ratio = log_decay.exp()[:, None, None]
    outputs = []
    for t in range(q.shape[0]):
        state = state * ratio + k[t][:, :, None] * v[t][:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
        if states_out is not None:
            states_out[t] = state
    if not outputs:
        return v.new_zeros(v.shape), state
    return torch.stack(outputs), state


def _lightning_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel lightning attention (Qin et al. 2024, "Lightning Attention-2") for one
    request; same inputs as the recurrent form.

    With a constant log decay ``a = -slope`` per head, inside a chunk of ``c`` tokens (local
    positions ``t, s`` from 0) and ``S_0`` the state entering it::

        o_t   = e^{a (t + 1)} q_t^T S_0 + sum_{s <= t} e^{a (t - s)} (q_t . k_s) v_s
        S_end = e^{a c} S_0 + sum_s e^{a (c - 1 - s)} k_s v_s^T

    Every exponent is <= 0 (pairs above the diagonal are masked before ``exp``).
    """
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return v.new_zeros(v.shape), state
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    a = log_decay[:, None]  # [H, 1]
    outputs = []
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        size = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        pos = torch.arange(size, dtype=torch.float32, device=q.device)
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        diff = (pos[:, None] - pos[None, :]) * a[:, :, None]  # [H, t, s]
        within = diff.masked_fill(~causal, -math.inf).exp()
        from_state = (a * (pos + 1)).exp()[..., None]  # [H, c, 1]
        outputs.append((qc * from_state) @ state + ((qc @ kc.transpose(-1, -2)) * within) @ vc)
        to_end = (a * (size - 1 - pos)).exp()[..., None]  # [H, c, 1]
        state = state * (a * size).exp()[..., None] + (kc * to_end).transpose(-1, -2) @ vc
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float = 1.0,
    chunk_size: int = 64,
    mode: str = "auto",
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning attention (MiniMax-01's linear attention) over a varlen batch with a slot pool.

    Linear attention with a fixed exponential decay per head (no gate, no delta rule). Per
    head, per token (transformers' ``MiniMaxLightningAttention``; fla's simple GLA with a
    constant gate ``g = -slope``)::

        S = exp(-slope) S + k v^T;  o = S^T (q * scale)

    The activation of q, k, v, the RMSNorm and the sigmoid output gate are model side.

    :param q: ``[T, H, Dk]`` queries.
    :param k: ``[T, H, Dk]`` keys (one key head per value head).
    :param v: ``[T, H, Dv]`` values.
    :param slope: ``[H]`` decay rate per head, ``> 0`` (MiniMax: ALiBi-style slopes scaled by
        the layer's depth; a per-layer constant, not a per-token input).
    :param ssm_state: ``[S, H, Dk, Dv]`` slot pool (float32 or bfloat16), updated in place
        (transformers keeps the same ``[Dk, Dv]`` = ``K^T V`` orientation).
    :param query_start_loc: ``[B + 1]`` int32 cu-seqlens.
    :param state_indices: ``[B]`` int32 slots (negative: padding request, output zeros).
    :param has_initial_state: ``[B]`` bool; False starts from a zero state.
    :param scale: query scale; MiniMax reads ``q . S`` unscaled (1.0).
    :param chunk_size: tokens per chunk of the chunked form (MiniMax's ``block_size``; any
        value gives the same result up to rounding).
    :param mode: ``"auto"`` | ``"recurrent"`` | ``"chunked"``.
    :param intermediate_states: optional ``[B, >= max_q_len, H, Dk, Dv]``: forces the token
        loop and receives the state after each token of request ``b`` at ``[b, i]``.
    :param out: optional ``[T, H, Dv]`` output buffer (written and returned).
    :returns: ``[T, H, Dv]`` in ``v.dtype`` (or ``out``).
    """
    _check_options(mode, chunk_size)
    check_shape("q", q, (None, None, None))
    num_tokens, num_heads, dim_k = q.shape
    check_shape("k", k, (num_tokens, num_heads, dim_k))
    check_shape("v", v, (num_tokens, num_heads, None))
    dim_v = v.shape[2]
    check_shape("slope", slope, (num_heads,))
    check_shape("ssm_state", ssm_state, (None, num_heads, dim_k, dim_v))
    requests = varlen_requests(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=num_tokens,
        num_slots=ssm_state.shape[0],
    )
    _check_intermediate(intermediate_states, requests, (num_heads, dim_k, dim_v))
    out = prepare_out(out, (num_tokens, num_heads, dim_v), v.dtype, v.device)
    log_decay = -slope.to(device=q.device, dtype=torch.float32)
    qf = q.to(torch.float32) * scale
    kf, vf = k.to(torch.float32), v.to(torch.float32)

    def kernel(
        req: VarlenRequest, state: torch.Tensor, states_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(req.start, req.end)
        if states_out is None and _use_chunked(mode, req.num_tokens):
            return _lightning_chunked(qf[sl], kf[sl], vf[sl], log_decay, state, chunk_size)
        return _lightning_recurrent(qf[sl], kf[sl], vf[sl], log_decay, state, states_out)

    return _run_requests(requests, ssm_state, out, intermediate_states, kernel)


# --------------------------------------------------------------------------------------------
# Mamba1 (selective scan)
# --------------------------------------------------------------------------------------------


def _scan1_recurrent(
    u: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loop of Mamba1's selective scan for one request.

    u ``[L, H]`` = ``dt * x``; log_decay ``[L, H, N]`` = ``dt * A``; b, c ``[L, N]``; state
    ``[H, N]``::

        h = exp(dt A) * h + (dt x) B^T;  y = h C
    """
    outputs = []
    for t in range(u.shape[0]):
        state = state * log_decay[t].exp() + u[t][:, None] * b[t][None, :]
        outputs.append(state @ c[t])
        if states_out is not None:
            states_out[t] = state[..., None]
    if not outputs:
        return u.new_zeros(u.shape), state
    return torch.stack(outputs), state


def _scan1_chunked(
    u: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form of :func:`_scan1_recurrent` (same inputs).

    Inside a chunk, with ``g_t`` the cumulative log decay from the chunk start (``[H, N]`` per
    token), ``y_t = sum_{s<=t} sum_n C_t[n] exp(g_t - g_s)[h, n] B_s[n] u_s[h] +
    sum_n C_t[n] exp(g_t)[h, n] h0[h, n]``. The pairwise decays are taken as differences of
    cumulative sums masked to ``s <= t`` before the exponential, never as a ratio
    ``exp(g_t) / exp(g_s)``, which overflows float32 for the strong decays Mamba1 learns. The
    pairwise tensor is ``[L, L, H, N]``: keep ``chunk_size`` small.
    """
    outputs = []
    for start in range(0, u.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        uc, bc, cc = u[sl], b[sl], c[sl]
        g = log_decay[sl].cumsum(0)  # [L, H, N]
        size = g.shape[0]
        causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
        diff = (g[:, None] - g[None, :]).masked_fill(~causal[:, :, None, None], -math.inf)
        y = torch.einsum("tn,sn,tshn,sh->th", cc, bc, diff.exp(), uc)
        y = y + torch.einsum("tn,thn,hn->th", cc, g.exp(), state)
        to_end = (g[-1][None] - g).exp()  # [L, H, N]
        state = state * g[-1].exp() + torch.einsum("shn,sn,sh->hn", to_end, bc, uc)
        outputs.append(y)
    if not outputs:
        return u.new_zeros(u.shape), state
    return torch.cat(outputs), state


def mamba1_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    dt_softplus: bool = True,
    chunk_size: int = 16,
    mode: str = "auto",
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba1 selective scan (decay per channel and state entry) over a varlen batch.

    Per inner channel ``h`` (one "head" of width 1) and token::

        dt = softplus(dt + dt_bias);  A = -exp(A_log)            A: [H, N]
        h  = exp(dt A) * h + (dt x) B^T                           h: [N]
        y  = h . C + D x

    The conv before it runs through :func:`causal_conv1d`; the projections, Falcon-Mamba's and
    Jamba's RMS norms on B / C / dt and the ``silu(z)`` gate after it are model side, not here.

    :param x: ``[T, H, 1]`` inputs after the conv (``H = d_inner``).
    :param dt: ``[T, H]`` time step after ``dt_proj``'s weight, before its bias / softplus.
    :param A_log: ``[H, N]``; ``A = -exp(A_log)``.
    :param B: ``[T, 1, N]`` input projection, shared by every channel.
    :param C: ``[T, 1, N]`` output projection, shared by every channel.
    :param D: ``[H]`` skip, or None.
    :param dt_bias: ``[H]`` (``dt_proj.bias``), or None.
    :param ssm_state: ``[S, H, N, 1]`` slot pool (float32 or bfloat16), updated in place; the
        memory layout of HF's ``[.., d_inner, d_state]`` cache.
    :param query_start_loc: ``[B + 1]`` int32 cu-seqlens.
    :param state_indices: ``[B]`` int32 slots (negative: padding request, output zeros).
    :param has_initial_state: ``[B]`` bool; False starts from a zero state.
    :param dt_softplus: apply softplus to ``dt + dt_bias``.
    :param chunk_size: tokens per chunk of the chunked form (memory ``chunk_size^2 * H * N``).
    :param mode: ``"auto"`` | ``"recurrent"`` | ``"chunked"``.
    :param intermediate_states: optional ``[B, >= max_q_len, H, N, 1]``: forces the token loop
        and receives the state after each token of request ``b`` at ``[b, i]``.
    :param out: optional ``[T, H, 1]`` output buffer (written and returned).
    :returns: ``[T, H, 1]`` in ``x.dtype`` (or ``out``).
    """
    _check_options(mode, chunk_size)
    check_shape("x", x, (None, None, 1))
    num_tokens, num_channels, _ = x.shape
    check_shape("dt", dt, (num_tokens, num_channels))
    check_shape("A_log", A_log, (num_channels, None))
    state_size = A_log.shape[1]
    check_shape("B", B, (num_tokens, 1, state_size))
    check_shape("C", C, (num_tokens, 1, state_size))
    if D is not None:
        check_shape("D", D, (num_channels,))
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (num_channels,))
    check_shape("ssm_state", ssm_state, (None, num_channels, state_size, 1))
    requests = varlen_requests(
        query_start_loc,
        state_indices,
        has_initial_state,
        num_tokens=num_tokens,
        num_slots=ssm_state.shape[0],
    )
    _check_intermediate(intermediate_states, requests, (num_channels, state_size, 1))
    out = prepare_out(out, (num_tokens, num_channels, 1), x.dtype, x.device)

    step = _time_step(dt, dt_bias, dt_softplus)
    log_decay = step[..., None] * -A_log.to(torch.float32).exp()  # [T, H, N], <= 0
    xf = x[..., 0].to(torch.float32)
    u = xf * step
    bf, cf = B[:, 0].to(torch.float32), C[:, 0].to(torch.float32)
    skip = None if D is None else xf * D.to(torch.float32)

    def kernel(
        req: VarlenRequest, state: torch.Tensor, states_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(req.start, req.end)
        args = (u[sl], log_decay[sl], bf[sl], cf[sl], state[..., 0])
        if states_out is None and _use_chunked(mode, req.num_tokens):
            y, final = _scan1_chunked(*args, chunk_size)
        else:
            y, final = _scan1_recurrent(*args, states_out)
        if skip is not None:
            y = y + skip[sl]
        return y[..., None], final[..., None]

    return _run_requests(requests, ssm_state, out, intermediate_states, kernel)
