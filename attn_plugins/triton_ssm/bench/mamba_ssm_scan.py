"""mamba_ssm's CUDA selective-scan forward, built from source where mamba_ssm does not install.

The H200 cannot pip-install mamba_ssm (no internet, no wheel for its torch), so
``scripts/pack_mamba_ssm_src.sh`` copies the forward kernel's sources (``csrc/selective_scan/``
of state-spaces/mamba, Apache-2.0) into the git-ignored ``.ext/mamba_ssm_src/`` on the
development machine, the checkout carries them to the device, and :func:`load` builds them there
with ``torch.utils.cpp_extension.load`` on first use (1-2 minutes on the H200's 16 cores: the
three forward ``.cu`` files, 160 kernels each, compile in parallel, 50-65 s of CPU time each on
the development machine; cached in ``.jit/mamba_ssm`` while the machine stays warm).
Upstream's ``selective_scan.cpp`` binds the backward too:
``mamba_ssm_ext/selective_scan_bwd_stub.cpp`` (ours) defines the six ``selective_scan_bwd_cuda``
instantiations it dispatches as functions that raise, so the slow backward kernels are never
compiled.

Build ahead of a benchmark (the bench's first mamba_ssm row would otherwise spend its budget
compiling)::

    python3 attn_plugins/triton_ssm/bench/mamba_ssm_scan.py          # from the checkout root

Nothing here runs on CPU but :func:`source_commit` and the constants.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

#: The checkout root: relative ``src_dir`` / ``build_dir`` are taken from here.
ROOT = Path(__file__).resolve().parents[3]
#: Our stub of the backward instantiations (see the module docstring).
STUB = Path(__file__).resolve().parent / "mamba_ssm_ext" / "selective_scan_bwd_stub.cpp"
#: Upstream sources compiled into the extension (the headers are found by include path).
SOURCES = (
    "selective_scan.cpp",
    "selective_scan_fwd_fp32.cu",
    "selective_scan_fwd_fp16.cu",
    "selective_scan_fwd_bf16.cu",
)
#: Every file the pack script copies (the forward's #include closure) and the license.
PACKED = (
    *SOURCES,
    "selective_scan.h",
    "selective_scan_common.h",
    "selective_scan_fwd_kernel.cuh",
    "static_switch.h",
    "LICENSE",
)
#: mamba_ssm's setup.py flags for nvcc, sm_90 only. Left out: ``--threads 4`` (splits work
#: across gencode targets: one here) and ``--ptxas-options=-v`` (register report, log noise).
NVCC_FLAGS = (
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-O3",
    "-std=c++17",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "-lineinfo",
)
CXX_FLAGS = ("-O3", "-std=c++17")
#: Not upstream's ``selective_scan_cuda``: an installed mamba_ssm keeps its own module.
EXT_NAME = "attn_mamba_ssm_selective_scan_fwd"

#: A build directory's ``lock`` older than this is left by a killed build and removed.
STALE_LOCK_S = 300.0

_MODULE: Any = None


def _resolve(p: str | Path) -> Path:
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


def source_commit(src_dir: str | Path = ".ext/mamba_ssm_src") -> str | None:
    """The state-spaces/mamba commit the pack script recorded in ``SOURCE``; None when
    ``src_dir`` holds no packed sources."""
    f = _resolve(src_dir) / "SOURCE"
    if not f.is_file():
        return None
    for line in f.read_text().splitlines():
        if line.startswith("commit:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load(
    src_dir: str | Path = ".ext/mamba_ssm_src",
    build_dir: str | Path = ".jit/mamba_ssm",
    verbose: bool = False,
) -> Any:
    """Build (first call on a machine: 1-2 minutes) or load the extension; returns the
    module. ``module.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)`` is upstream's
    ``selective_scan_fwd``: ``[out, x]`` plus ``out_z`` when ``z`` is given, where ``x`` is
    ``[batch, dim, n_chunks, 2 * dstate]`` (chunks of 2048 tokens; odd entries: the state).
    ``module.bwd`` raises (not built)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    src, build = _resolve(src_dir), _resolve(build_dir)
    missing = [f for f in PACKED if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{src} lacks {', '.join(missing)}: run scripts/pack_mamba_ssm_src.sh on the "
            "development machine (a state-spaces/mamba checkout) and carry .ext"
        )
    from torch.utils.cpp_extension import load as cpp_load

    build.mkdir(parents=True, exist_ok=True)
    # cpp_extension waits, without end, on the `lock` file of a build killed midway (the bench
    # worker cut at its budget); a device call lasts at most 10 minutes and nothing else builds
    # this extension beside the bench's one worker, so an old lock is a dead build's.
    lock = build / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    _MODULE = cpp_load(
        name=EXT_NAME,
        sources=[str(src / f) for f in SOURCES] + [str(STUB)],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        extra_include_paths=[str(src)],
        build_directory=str(build),
        verbose=verbose,
    )
    return _MODULE


def selective_scan_fwd(
    u: Any,
    delta: Any,
    A: Any,
    B: Any,
    C: Any,
    D: Any = None,
    z: Any = None,
    delta_bias: Any = None,
    delta_softplus: bool = True,
    module: Any = None,
) -> tuple[Any, Any]:
    """``selective_scan_fn(..., return_last_state=True)`` without autograd: ``(out,
    last_state)``, ``out`` gated by ``silu(z)`` when ``z`` is given, ``last_state`` =
    ``x[:, :, -1, 1::2]`` (``[batch, dim, dstate]``, A's dtype) as mamba_ssm computes it.

    Layouts as upstream: ``u``, ``delta``, ``z`` ``[batch, dim, L]``; ``A`` ``[dim, dstate]``
    float32 (``-exp(A_log)``); ``B``, ``C`` ``[batch, dstate, L]`` or ``[batch, groups, dstate,
    L]`` (input dtype) or ``[dim, dstate]``; ``D``, ``delta_bias`` ``[dim]`` float32."""
    mod = module if module is not None else load()
    if u.stride(-1) != 1:
        u = u.contiguous()
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    if D is not None:
        D = D.contiguous()
    if B.stride(-1) != 1:
        B = B.contiguous()
    if C.stride(-1) != 1:
        C = C.contiguous()
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    if B.dim() == 3:
        B = B.unsqueeze(1)
    if C.dim() == 3:
        C = C.unsqueeze(1)
    out, x, *rest = mod.fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    last_state = x[:, :, -1, 1::2]
    return (out if z is None else rest[0]), last_state


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="build mamba_ssm's selective-scan forward")
    ap.add_argument("--src-dir", default=".ext/mamba_ssm_src")
    ap.add_argument("--build-dir", default=".jit/mamba_ssm")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    mod = load(args.src_dir, args.build_dir, verbose=args.verbose)
    print(
        f"{EXT_NAME}: state-spaces/mamba {source_commit(args.src_dir)}, "
        f"{time.time() - t0:.1f} s, {mod.__file__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
