"""Audit the Gated DeltaNet state pass's tilings on a GPU against fla's public
``chunk_gated_delta_rule`` (states gathered and scattered), after Triton 3.6 was found to
miscompile the Mamba2 SSD at 32-column tiles on the H200 (scripts/diag_mamba2_chunk.py).

For each shape, value-block width (``block_v``) and pipeline depth it prints the output and
final-state error relative to fla, PASS / WRONG, or FAULT. Cases run in one child process; a
fault poisons the CUDA context, so the parent then starts a new child at the next case.

    python scripts/diag_gdn_tiles.py              # the whole table (~1-3 min on an H200)
    python scripts/diag_gdn_tiles.py --child 5    # cases 5.. in this process (what the parent runs)
"""

import subprocess
import sys

SHAPES = [  # (key heads, value heads, d_k, d_v, sequence lengths, input dtype)
    (16, 32, 128, 128, [1000, 64, 1, 257, 2100], "bfloat16"),  # Qwen3-Next, varlen
    (16, 32, 128, 128, [8192], "bfloat16"),  # one long sequence: the (32, 4) tiling
    (4, 8, 64, 64, [300, 1, 77], "bfloat16"),
    (8, 8, 256, 256, [513], "bfloat16"),
    (16, 32, 128, 128, [700], "float32"),
]
TILINGS = [(bv, st) for bv in (16, 32, 64) for st in (1, 2, 3, 4)]
CASES = [(s, t) for s in range(len(SHAPES)) for t in TILINGS]


def run_case(shape_index: int, block_v: int, stages: int) -> str:
    import torch
    from attn_plugin_triton_ssm import kernels as K
    from attn_plugin_triton_ssm.kernels import gdn_chunk

    hk, hv, dk, dv, lens, dtype = SHAPES[shape_index]
    dtype = getattr(torch, dtype)
    g_ = torch.Generator(device="cuda").manual_seed(shape_index)
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g_, device="cuda")  # noqa: E731
    q, k, v = r(T, hk, dk).to(dtype), r(T, hk, dk).to(dtype), r(T, hv, dv).to(dtype)
    g = -torch.rand(T, hv, generator=g_, device="cuda") * 0.3
    beta = torch.rand(T, hv, generator=g_, device="cuda")
    state = r(len(lens) + 2, hv, dk, dv) * 0.1
    idx = torch.arange(len(lens), device="cuda", dtype=torch.int32).flip(0) + 1
    cu_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    cu = cu_cpu.cuda()
    ref_state = state.clone()
    y_ref = K.gdn_prefill(q, k, v, g, beta, ref_state, idx, cu, cu_seqlens_cpu=cu_cpu,
                          slot_pass=False)  # fmt: skip
    y = gdn_chunk.gdn_chunk_prefill_slots(q, k, v, g, beta, state, idx, cu, cu_cpu,
                                          scale=dk**-0.5, use_qk_l2norm=True, block_v=block_v,
                                          num_stages=stages)  # fmt: skip
    torch.cuda.synchronize()
    o = ((y.float() - y_ref.float()).abs().mean() / y_ref.float().abs().mean()).item()
    h = ((state - ref_state).abs().max() / ref_state.abs().max()).item()
    ok = o < 2e-3 and h < 1e-3 and not torch.isnan(y).any()
    return f"out {o:.1e} state {h:.1e} {'PASS' if ok else 'WRONG'}"


def label(i: int) -> str:
    (s, (bv, st)) = CASES[i]
    hk, hv, dk, dv, lens, dtype = SHAPES[s]
    return f"{hk}/{hv} heads d{dk}/{dv} {dtype} lens {lens}  block_v {bv:2d} stages {st}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        for i in range(int(sys.argv[2]), len(CASES)):
            print(f"START {i}", flush=True)
            try:
                verdict = run_case(CASES[i][0], *CASES[i][1])
            except Exception as exc:  # a refusal (no tiling fits, say) is a result too
                if "illegal memory access" in str(exc):
                    raise
                verdict = f"REFUSED {type(exc).__name__}: {str(exc)[:100]}"
            print(f"DONE {i} {verdict}", flush=True)
        sys.exit(0)
    start = 0
    while start < len(CASES):
        child = subprocess.run([sys.executable, __file__, "--child", str(start)],
                               capture_output=True, text=True, timeout=900)  # fmt: skip
        done, current = {}, None
        for line in child.stdout.splitlines():
            if line.startswith("START "):
                current = int(line.split()[1])
            elif line.startswith("DONE "):
                _, i, verdict = line.split(" ", 2)
                done[int(i)] = verdict
        for i in sorted(done):
            print(f"{label(i)}: {done[i]}", flush=True)
        if current is None or current in done:
            if child.returncode:
                print(child.stderr[-2000:], flush=True)
            break
        fault = "illegal memory access" in child.stderr
        print(f"{label(current)}: {'FAULT (illegal memory access)' if fault else 'CRASH'}",
              flush=True)  # fmt: skip
        if not fault:
            print(child.stderr[-2000:], flush=True)
        start = current + 1
