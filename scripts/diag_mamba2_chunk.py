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
    from triton_ssm_refs import mamba2_varlen_case, mamba2_varlen_errors

    inputs, state, idx, offsets = mamba2_varlen_case()
    before = state.clone()
    y = K.ssd.mamba2_ssd_triton(**inputs, ssm_state=state, state_indices=idx,
                                cu_seqlens_cpu=torch.tensor(offsets, dtype=torch.int32),
                                chunk_size=chunk, block_p=block_p,
                                num_stages=(3, stages))  # fmt: skip
    torch.cuda.synchronize()
    errors = mamba2_varlen_errors(y, state, before, inputs, idx, offsets)
    worst_o, worst_h = (max(col) for col in zip(*errors, strict=True))
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
