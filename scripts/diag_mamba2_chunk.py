"""Locate the Triton SSD miscompile on a GPU (H200, Triton 3.6: NaN outputs, then an illegal
memory access, at H=16, G=2, N=64, P=32): output and state error relative to the recurrence
for each (chunk, P tile, scan stages), each case in its own process because a fault poisons
the CUDA context.

    python scripts/diag_mamba2_chunk.py            # the whole table
    python scripts/diag_mamba2_chunk.py 64 32 1    # one case: chunk, block_p, scan stages
"""

import subprocess
import sys
from pathlib import Path

CASES = [  # (chunk, block_p, scan stages)
    (64, 32, 2), (64, 32, 1), (128, 32, 2), (128, 32, 1),
    (64, 64, 2), (64, 64, 1), (128, 64, 2), (128, 64, 1),
]  # fmt: skip


def case(chunk: int, block_p: int, stages: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attn_plugins/triton_ssm/tests"))
    from attn_plugin_triton_ssm import kernels as K
    from triton_ssm_refs import mamba2_ref

    K.ssd.CHUNK_SIZES = (16, 32, 64, 128)  # chunk 128 is refused; lift the check to test it
    lens, H, G, N, P, S = [300, 64, 1, 457], 16, 2, 64, 32, 8
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, dt, A_log = r(T, H, P).bfloat16(), r(T, H) - 2.0, r(H) * 0.5
    Bm, Cm, Dp, dt_bias, z = r(T, G, N).bfloat16(), r(T, G, N).bfloat16(), r(H), r(H), r(T, H, P)
    state = r(S, H, N, P) * 0.1
    idx = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    before = state.clone()
    y = K.ssd.mamba2_ssd_triton(x, dt, A_log, Bm, Cm, state, idx, cu, D=Dp, dt_bias=dt_bias,
                                z=z, chunk_size=chunk, block_p=block_p,
                                num_stages=(3, stages))  # fmt: skip
    torch.cuda.synchronize()
    worst_o = worst_h = 0.0
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        sl = slice(s, e)
        y_ref, h_ref = mamba2_ref(x[None, sl], dt[None, sl], A_log, Bm[None, sl], Cm[None, sl],
                                  before[idx[i]][None], D=Dp, dt_bias=dt_bias,
                                  z=z[None, sl])  # fmt: skip
        o = ((y[sl].float() - y_ref[0]).abs().mean() / y_ref.abs().mean()).item()
        h = ((state[idx[i]] - h_ref[0]).abs().mean() / h_ref.abs().mean()).item()
        worst_o, worst_h = max(worst_o, o), max(worst_h, h)
    ok = worst_o < 1e-2 and worst_h < 1e-2
    print(f"out {worst_o:.1e} state {worst_h:.1e} nan={bool(torch.isnan(y).any())} "
          f"{'PASS' if ok else 'WRONG'}")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4:
        case(*map(int, sys.argv[1:]))
        sys.exit(0)
    for c in CASES:
        run = subprocess.run([sys.executable, __file__, *map(str, c)], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        lines = (run.stdout + run.stderr).strip().splitlines()
        fault = next((ln for ln in lines if "illegal memory access" in ln), None)
        verdict = "FAULT (illegal memory access)" if fault else (lines[-1] if lines else "?")
        print(f"chunk {c[0]:3d}  P tile {c[1]:2d}  scan stages {c[2]}: {verdict}", flush=True)
