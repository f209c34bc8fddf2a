"""Reproduce the Triton SSD failure at chunk 128 on a GPU (H200: NaN outputs, then an illegal
memory access, at H=16, G=2, N=64, P=32): output error relative to the recurrence per case."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attn_plugins/triton_ssm/tests"))
from attn_plugin_triton_ssm import kernels as K
from triton_ssm_refs import mamba2_ref


def case(lens, H, G, N, P, chunk, with_z, precise=True):
    T, S = sum(lens), 8
    g = torch.Generator(device="cuda").manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, dt, A_log = r(T, H, P).bfloat16(), r(T, H) - 2.0, r(H) * 0.5
    Bm, Cm, Dp, dt_bias, z = r(T, G, N).bfloat16(), r(T, G, N).bfloat16(), r(H), r(H), r(T, H, P)
    z = z if with_z else None
    state = r(S, H, N, P) * 0.1
    idx = torch.tensor([5, 0, 3, 6][: len(lens)], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    before = state.clone()
    y = K.mamba2_ssd_triton(x, dt, A_log, Bm, Cm, state, idx, cu, D=Dp, dt_bias=dt_bias, z=z,
                            chunk_size=chunk, precise=precise)  # fmt: skip
    errs = []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(s, e)
        y_ref, h_ref = mamba2_ref(x[None, sl], dt[None, sl], A_log, Bm[None, sl], Cm[None, sl],
                                  before[idx[i]][None], D=Dp, dt_bias=dt_bias,
                                  z=None if z is None else z[None, sl])  # fmt: skip
        o = ((y[sl].float() - y_ref[0]).abs().mean() / y_ref.abs().mean()).item()
        h = ((state[idx[i]] - h_ref[0]).abs().mean() / h_ref.abs().mean()).item()
        bad_rows = int(((y[sl].float() - y_ref[0]).abs().amax((1, 2)) > 0.1).sum())
        errs.append(f"{o:.1e}/{h:.1e}/bad{bad_rows}")
    nan = bool(torch.isnan(y).any())
    print(f"lens={lens} H={H} G={G} N={N} P={P} chunk={chunk} z={with_z} precise={precise}: "
          f"out/state rel per seq {errs} nan={nan}", flush=True)  # fmt: skip


# chunk 128 is refused by CHUNK_SIZES; lift the check to reproduce (each case may fault)
K.ssd.CHUNK_SIZES = (16, 32, 64, 128)
for chunk in (64, 128):
    for with_z in (True, False):
        case([300, 64, 1, 457], 16, 2, 64, 32, chunk, with_z)
