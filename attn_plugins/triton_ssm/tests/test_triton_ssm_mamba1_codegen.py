"""The Mamba1 scan's verify and replay-commit specializations round the state update alike.

The two commit strategies of speculative decoding must store bit-identical states: the native
one copies the verify scan's per-token state, the replay one re-runs the accepted tokens in a
launch without outputs. Both compile ``_mamba1_scan_kernel`` with other constexprs, and LLVM
contracted ``h * exp(dt A) + (dt x) B`` into an FMA as it saw fit: on the H200 the verify build
fused ``fma(h, e, dt x B)`` and the replay build ``fma(dt x, B, h e)``, and the states differed
in the last bit (hence the explicit ``tl.fma`` there). This test compiles both for sm90 on the
CPU (Triton's own compiler, no GPU) and compares the float instructions of the update's lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from attn_plugin_triton_ssm.kernels import mamba1  # noqa: E402

_POINTERS = {
    "x_ptr": "*bf16", "dt_ptr": "*bf16", "a_log_ptr": "*fp32", "b_ptr": "*bf16",
    "c_ptr": "*bf16", "d_ptr": "*fp32", "dt_bias_ptr": "*fp32", "z_ptr": "*bf16",
    "state_ptr": "*fp32", "idx_ptr": "*i32", "cu_ptr": "*i32", "len_ptr": "*i32",
    "init_ptr": "*i32", "inter_ptr": "*fp32", "out_ptr": "*bf16", "dts_ptr": "*fp32",
}  # fmt: skip
#: what the verify scan and the replay commit share (the tiles _launch gives both)
_COMMON = dict(
    D=8192, N=16, BD=16, BN=16, RPP=1, HAS_INIT=False, HAS_D=True, HAS_DT_BIAS=True,
    HAS_Z=False, DT_SOFTPLUS=True, STORE_DTSUM=False, HINTS=False, PIPELINE=0,
    LOADS_FIRST=False,
    s_xd=1, s_zd=1, s_od=1,
)  # fmt: skip
VERIFY = dict(MODE=1, STEP=1, STORE_INTER=True, WRITE_STATE=False, WRITE_OUT=True)
REPLAY = dict(MODE=2, STEP=4, STORE_INTER=False, WRITE_STATE=True, WRITE_OUT=False)


#: compiles ``_mamba1_scan_kernel`` for sm90 and writes its PTX to stdout (argv: pointer types,
#: constexprs, as JSON), in a fresh interpreter: a test process whose kernel tests ran in
#: Triton's CPU interpreter has its language module patched for it and cannot compile
_COMPILE = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

pointers, constexprs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
module, name, warps = sys.argv[3], sys.argv[4], int(sys.argv[5])
kernel = getattr(importlib.import_module(module), name)
names = list(inspect.signature(kernel.fn).parameters)
sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] != "constexpr"}
src = ASTSource(
    fn=kernel, signature=sig,
    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs,
)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
sys.stdout.write(compiled.asm["ptx"])
"""


def _ptx(
    constexprs: dict,
    kernel: str = "attn_plugin_triton_ssm.kernels.mamba1:_mamba1_scan_kernel",
    num_warps: int = 1,
) -> str:
    """PTX of a Mamba1 kernel (``module:name``; the scan kernel by default) for sm90 with
    ``constexprs``, the other ints as 16-divisible i32 (as a launch with these strides
    specializes them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(_POINTERS), json.dumps(constexprs),
         *kernel.split(":"), str(num_warps)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        if "CompilationError" not in proc.stderr and re.search(r"ptxas|nvidia", proc.stderr, re.I):
            pytest.skip(f"cannot compile for sm90 here (no NVIDIA backend or ptxas): {tail[0]}")
        pytest.fail(f"compiling the kernel for sm90 failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _update_ops(ptx: str) -> Counter:
    """``((line, column), opcode)`` counts of the float instructions PTX attributes to the
    state update's lines in mamba1.py (the column tells which product an FMA absorbed)."""
    src = Path(mamba1.__file__).read_text().splitlines()
    # the token's input term and the update itself
    lines = {i + 1 for i, s in enumerate(src) if s.strip().startswith(("b_u = ", "b_h = tl.fma("))}
    assert len(lines) == 2, f"expected the two lines of the state update in mamba1.py: {lines}"
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    ours = {k for k, v in files.items() if v.endswith("mamba1.py")}
    ops: Counter = Counter()
    column = None
    for text in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)", text)
        if loc:
            here = loc.group(1) in ours and int(loc.group(2)) in lines
            column = (int(loc.group(2)), int(loc.group(3))) if here else None
            continue
        op = re.match(r"\s*((?:fma|mul|add|sub)\.[a-z.]*f32)\s", text)
        if column is not None and op:
            ops[(column, op.group(1))] += 1
    return ops


def test_verify_and_replay_commit_round_the_state_update_alike() -> None:
    verify = _update_ops(_ptx({**_COMMON, **VERIFY}))
    replay = _update_ops(_ptx({**_COMMON, **REPLAY}))
    assert verify, "no instructions found for the update line: the test lost track of it"
    assert verify == replay
    assert any(op.startswith("fma") for _, op in verify)


def _loop_body(ptx: str) -> str:
    """The PTX between the token loop's label and its backward branch (the kernel's one loop
    with both)."""
    for label in re.findall(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        start = ptx.index(label + ":")
        back = ptx.find(f"bra.uni \t{label};", start)
        back = back if back >= 0 else ptx.find(f"bra \t{label};", start)
        if back > start:
            return ptx[start:back]
    raise AssertionError("no loop in the lanes kernel's PTX")


@pytest.mark.parametrize("block_d", [128, 256], ids=["a channel a thread", "two (default)"])
@pytest.mark.parametrize("write_out", [True, False], ids=["output pass", "state pass"])
def test_lanes_kernel_keeps_a_channel_in_one_thread(write_out: bool, block_d: int) -> None:
    """The lanes kernel (d_state 16, 4 warps: one or two channels a thread) compiles for sm90
    with its token loop free of shuffles (``y = h . C`` sums inside the thread) and, per
    channel, one ``ex2.approx.ftz`` per state entry plus the softplus's, whose ``log2`` is one
    ``lg2.approx`` (not libdevice's polynomial)."""
    n, channels = 16, block_d // 128
    constexprs = dict(
        D=8192, N=n, BD=block_d, HAS_INIT=not write_out, HAS_D=write_out, HAS_DT_BIAS=True,
        HAS_Z=write_out, DT_SOFTPLUS=True, WRITE_STATE=not write_out, WRITE_OUT=write_out,
        STORE_DTSUM=not write_out, FAST=True, s_xd=1, s_zd=1, s_od=1, GROUPED=channels == 1,
    )  # fmt: skip
    ptx = _ptx(constexprs, LANES_KERNEL, 4)
    body = _loop_body(ptx)
    assert "shfl" not in body
    assert len(re.findall(r"ex2\.approx\.ftz\.f32", body)) == (n + 1) * channels
    assert len(re.findall(r"lg2\.approx\.ftz\.f32", body)) == channels


LANES_KERNEL = "attn_plugin_triton_ssm.kernels.mamba1_lanes:_mamba1_lanes_kernel"


def test_lanes_kernel_moves_the_state_in_16_byte_rows_at_a_channel_a_thread() -> None:
    """With one channel a thread (d_state 16) the lanes kernel loads and stores the state and
    loads ``A_log`` as 16-byte vectors, four a channel each, with no trip through shared
    memory: entry-wide accesses would touch a line of every other thread's row."""
    from attn_plugin_triton_ssm.kernels.mamba1_lanes import _grouped

    assert _grouped(128, 4, 16) and not _grouped(256, 4, 16) and not _grouped(128, 4, 6)
    constexprs = dict(
        D=8192, N=16, BD=128, HAS_INIT=False, HAS_D=True, HAS_DT_BIAS=True, HAS_Z=True,
        DT_SOFTPLUS=True, WRITE_STATE=True, WRITE_OUT=True, STORE_DTSUM=False, FAST=True,
        s_xd=1, s_zd=1, s_od=1, GROUPED=True,
    )  # fmt: skip
    ptx = _ptx(constexprs, LANES_KERNEL, 4)
    loads = len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32", ptx))
    assert loads == 4 + 4  # A_log, the request's state
    assert len(re.findall(r"st\.global(?:\.[a-z]+)*\.v4\.b32", ptx)) == 4  # state
    assert not re.search(r"\.shared|bar\.sync", ptx)
