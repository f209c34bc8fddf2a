"""Independent references for the triton_ssm tests: fla-core's naive recurrences (GDN, KDA), an
explicit per-token loop for Mamba2 (the SSD paper's recurrence) and torch's conv1d.

Nothing here imports the plugin: the kernels are checked against code they do not share.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.kda.naive import naive_recurrent_kda


def l2(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_ref(q, k, v, g, beta, h0, *, kda: bool, scale=None, l2norm=True):
    """q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; g ``[B, T, Hv]`` or ``[B, T, Hv, Dk]``;
    beta ``[B, T, Hv]``; h0 ``[B, Hv, Dk, Dv]``. Returns o ``[B, T, Hv, Dv]`` (fp32) and the
    states after every prefix ``[B, T, Hv, Dk, Dv]`` (fp32)."""
    if l2norm:
        q, k = l2(q), l2(k)
    q, k, v, g, beta, h0 = (t.float() for t in (q, k, v, g, beta, h0))
    G = v.shape[2] // q.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    T = q.shape[1]
    states = []
    for t in range(1, T + 1):
        sl = slice(0, t)
        if kda:
            o, h = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                       scale=scale, initial_state=h0.clone(),
                                       output_final_state=True)  # fmt: skip
        else:
            o, h = naive_recurrent_gated_delta_rule(
                q[:, sl].repeat_interleave(G, 2), k[:, sl].repeat_interleave(G, 2), v[:, sl],
                beta[:, sl], g[:, sl], scale=scale, initial_state=h0.clone(),
                output_final_state=True,
            )  # fmt: skip
        states.append(h.float())
    return o.float(), torch.stack(states, 1)


def mamba2_ref(x, dt, A_log, B, C, h0, *, D=None, dt_bias=None, z=None, dt_softplus=True):
    """Explicit recurrence. x ``[Bt, T, H, P]``, dt ``[Bt, T, H]``, B/C ``[Bt, T, G, N]``,
    h0 ``[Bt, H, N, P]``. Returns y ``[Bt, T, H, P]`` and the final state, fp32."""
    x, dt, B, C, h = (t.float() for t in (x, dt, B, C, h0))
    H, G = x.shape[2], B.shape[2]
    h = h.clone()
    ys = []
    for t in range(x.shape[1]):
        d = dt[:, t] + (dt_bias.float() if dt_bias is not None else 0)
        if dt_softplus:
            d = F.softplus(d)
        a = torch.exp(-torch.exp(A_log.float()) * d)  # [Bt, H]
        Bt_ = B[:, t].repeat_interleave(H // G, 1)  # [Bt, H, N]
        Ct_ = C[:, t].repeat_interleave(H // G, 1)
        h = h * a[..., None, None] + (d[..., None] * Bt_)[..., :, None] * x[:, t, :, None, :]
        y = torch.einsum("bhn,bhnp->bhp", Ct_, h)
        if D is not None:
            y = y + D.float()[:, None] * x[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].float())
        ys.append(y)
    return torch.stack(ys, 1), h


#: The Mamba2 varlen case: four packed sequences (one of a single token), H=16, G=2, N=64, P=32.
#: At this shape Triton 3.6 miscompiles the SSD's 32-column tiles on the H200 (kernels/ssd.py
#: tiles P by 64 for that reason); the GPU varlen test runs it at the shipped tiling.
MAMBA2_VARLEN = dict(lens=[300, 64, 1, 457], H=16, G=2, N=64, P=32, S=8)


def mamba2_varlen_case(device: str = "cuda") -> tuple[dict, torch.Tensor, torch.Tensor, list]:
    """Inputs of :data:`MAMBA2_VARLEN`: ``(inputs, state, idx, offsets)`` with ``inputs`` keyed
    as ``mamba2_prefill``'s arguments (x, dt, A_log, B, C bf16 where the models' are; D,
    dt_bias, z float32), ``state`` ``[S, H, N, P]``, ``idx`` int32 slots, ``offsets`` the
    ``N + 1`` token offsets as a list."""
    c = MAMBA2_VARLEN
    lens, H, G, N, P, S = c["lens"], c["H"], c["G"], c["N"], c["P"], c["S"]
    T = sum(lens)
    g = torch.Generator(device=device).manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    x, dt, A_log = r(T, H, P).bfloat16(), r(T, H) - 2.0, r(H) * 0.5
    Bm, Cm, Dp, dt_bias, z = r(T, G, N).bfloat16(), r(T, G, N).bfloat16(), r(H), r(H), r(T, H, P)
    state = r(S, H, N, P) * 0.1
    idx = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=device)
    offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
    inputs = dict(x=x, dt=dt, A_log=A_log, B=Bm, C=Cm, D=Dp, dt_bias=dt_bias, z=z)
    return inputs, state, idx, offsets


def mamba2_varlen_errors(y, state, before, inputs, idx, offsets) -> list[tuple[float, float]]:
    """Per sequence, the mean relative error of the outputs ``y`` and of the final state in
    ``state[idx[i]]`` against :func:`mamba2_ref` started from ``before[idx[i]]``."""
    a = inputs
    errors = []
    for i, (s, e) in enumerate(itertools.pairwise(offsets)):
        sl = slice(s, e)
        y_ref, h_ref = mamba2_ref(a["x"][None, sl], a["dt"][None, sl], a["A_log"],
                                  a["B"][None, sl], a["C"][None, sl], before[idx[i]][None],
                                  D=a["D"], dt_bias=a["dt_bias"], z=a["z"][None, sl])  # fmt: skip
        o_rel = ((y[sl].float() - y_ref[0]).abs().mean() / y_ref.abs().mean()).item()
        h_rel = ((state[idx[i]] - h_ref[0]).abs().mean() / h_ref.abs().mean()).item()
        errors.append((o_rel, h_rel))
    return errors


def conv_ref(state, x, weight, bias, silu):
    """One request. state ``[C, K-1]``, x ``[T, C]``. Returns out ``[T, C]`` and the full
    sequence ``[C, K-1+T]`` (new state after n tokens = ``seq[:, n:n+K-1]``)."""
    seq = torch.cat([state.float(), x.float().T], 1)
    out = F.conv1d(seq[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                   groups=weight.shape[0])[0].T  # fmt: skip
    return (F.silu(out) if silu else out), seq
