"""scripts/gpu_run.sh shares the device's cores per stage: the JIT compilers' MAX_JOBS and
torch's OMP_NUM_THREADS are nproc / XDIST for a stage of several pytest processes and nproc for
a single-process stage (a benchmark), unless the caller set them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_stages(tmp_path: Path, *stages: str, **env: str) -> str:
    """Run gpu_run.sh with a stub device set-up and a 16-core ``nproc``; the summary log."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_run.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "device_setup.sh").write_text("")  # the H200's wheels: not here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nproc").write_text("#!/bin/sh\necho 16\n")
    (bin_dir / "nproc").chmod(0o755)
    out = tmp_path / "out"
    run_env = {k: v for k, v in os.environ.items() if k not in ("MAX_JOBS", "OMP_NUM_THREADS")}
    run_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), **env)
    r = subprocess.run(["bash", "scripts/gpu_run.sh", *stages], cwd=tmp_path, env=run_env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return "\n".join((out / f"{s.split('=')[0]}.log").read_text() for s in stages)


SHOW = 'echo "$0 MAX_JOBS=$MAX_JOBS OMP=$OMP_NUM_THREADS"'


def test_a_pytest_stage_shares_the_cores_and_a_bench_gets_them_all(tmp_path):
    text = _run_stages(
        tmp_path, f"multi=bash -c '{SHOW}' pytest -n 4", f"single=bash -c '{SHOW}' bench",
        XDIST="4",
    )  # fmt: skip
    assert "pytest MAX_JOBS=4 OMP=4" in text, text
    assert "bench MAX_JOBS=16 OMP=16" in text, text


def test_a_caller_s_max_jobs_holds_for_every_stage(tmp_path):
    text = _run_stages(
        tmp_path, f"multi=bash -c '{SHOW}' pytest -n 4", f"single=bash -c '{SHOW}' bench",
        XDIST="4", MAX_JOBS="3", OMP_NUM_THREADS="5",
    )  # fmt: skip
    assert "pytest MAX_JOBS=3 OMP=5" in text and "bench MAX_JOBS=3 OMP=5" in text, text
