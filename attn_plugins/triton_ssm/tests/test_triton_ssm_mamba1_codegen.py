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

import re
from collections import Counter
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from attn_plugin_triton_ssm.kernels import mamba1  # noqa: E402
from sm90_codegen import loop_body, sm90_ptx  # noqa: E402

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


def _ptx(
    constexprs: dict,
    kernel: str = "attn_plugin_triton_ssm.kernels.mamba1:_mamba1_scan_kernel",
    num_warps: int = 1,
) -> str:
    """PTX of a Mamba1 kernel (``module:name``; the scan kernel by default) for sm90 with
    ``constexprs``, the other ints as 16-divisible i32 (as a launch with these strides
    specializes them)."""
    return sm90_ptx(kernel, _POINTERS, constexprs, num_warps)


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
    body = loop_body(ptx)
    assert "shfl" not in body
    assert len(re.findall(r"ex2\.approx\.ftz\.f32", body)) == (n + 1) * channels
    assert len(re.findall(r"lg2\.approx\.ftz\.f32", body)) == channels


LANES_KERNEL = "attn_plugin_triton_ssm.kernels.mamba1_lanes:_mamba1_lanes_kernel"


def test_lanes_kernel_moves_the_state_in_16_byte_rows_at_a_channel_a_thread() -> None:
    """With one channel a thread (d_state 16) the lanes kernel loads and stores the state and
    loads ``A_log`` as 16-byte vectors, four a channel each, with no trip through shared
    memory: entry-wide accesses would touch a line of every other thread's row. Checked in the
    PTX and in the SASS ptxas makes of it, which is what the GPU runs."""
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
    sass = sm90_ptx(LANES_KERNEL, _POINTERS, constexprs, 4, sass=True)
    assert len(re.findall(r"\bLDG\.E(?:\.\w+)*\.128\b", sass)) == 4 + 4
    assert len(re.findall(r"\bSTG\.E(?:\.\w+)*\.128\b", sass)) == 4
    assert not re.search(r"\b(LDS|STS|BAR)\b", sass)
