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


def _run_stages(tmp_path: Path, *stages: str, python3: str | None = None, **env: str) -> str:
    """Run gpu_run.sh with a stub device set-up and a 16-core ``nproc`` (and ``python3``: a
    stand-in script for python3); the stages' logs."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_run.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "device_setup.sh").write_text("")  # the H200's wheels: not here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nproc").write_text("#!/bin/sh\necho 16\n")
    (bin_dir / "nproc").chmod(0o755)
    if python3 is not None:
        (bin_dir / "python3").write_text(python3)
        (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    run_env = {k: v for k, v in os.environ.items() if k not in ("MAX_JOBS", "OMP_NUM_THREADS")}
    run_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), **env)
    r = subprocess.run(["bash", "scripts/gpu_run.sh", *stages], cwd=tmp_path, env=run_env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    logs = [out / f"{s.split('=')[0]}.log" for s in stages]
    return "\n".join(log.read_text() for log in logs if log.exists())


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


def test_kit_shards_run_at_once_with_the_cores_split_over_them(tmp_path):
    # a stand-in python3 that says what it was asked and with which MAX_JOBS
    stub = '#!/bin/sh\necho "python3 $* MAX_JOBS=$MAX_JOBS"\n'
    _run_stages(tmp_path, "kit_fi", python3=stub, KIT_SHARDS="4")
    out = tmp_path / "out"
    for k in range(4):
        text = (out / f"kit_fi_{k}.log").read_text()
        assert f"--attn-shard={k}/4" in text and "--attn-backend=flashinfer:flashinfer " in text
        assert "MAX_JOBS=4" in text and " -n " not in text, text
    mla = (out / "kit_fi_mla.log").read_text()  # the MLA kit: one run, as before
    assert "--attn-backend=flashinfer:flashinfer_mla" in mla and "--attn-shard" not in mla
    assert not (out / "kit_fi.log").exists()


def test_the_flashinfer_kit_builds_its_soft_cap_module_first_with_every_core(tmp_path):
    # the soft-cap prefill module's build never finished in a shard (4 jobs beside three other
    # shards' builds): its checks run first, alone, one process with all 16 cores' jobs
    stub = '#!/bin/sh\necho "python3 $* MAX_JOBS=$MAX_JOBS"\n'
    _run_stages(tmp_path, "kit_fi", python3=stub, KIT_SHARDS="4", KIT_SEED="3")
    out = tmp_path / "out"
    text = (out / "kit_fi_softcap.log").read_text()
    assert "--attn-backend=flashinfer:flashinfer " in text and text.rstrip().endswith(
        "-k softcap MAX_JOBS=16"
    ), text
    assert "--attn-seed=3" in text and " -n " not in text and "--attn-shard" not in text, text
    summary = (out / "summary.log").read_text()
    assert summary.index("kit_fi_softcap:") < summary.index("kit_fi_0:"), summary


def test_the_triton_ssm_kit_runs_as_shards_too(tmp_path):
    stub = '#!/bin/sh\necho "python3 $* MAX_JOBS=$MAX_JOBS"\n'
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    sharded.mkdir()
    whole.mkdir()
    _run_stages(sharded, "kit_ssm", python3=stub, KIT_SHARDS="2")
    for k in range(2):
        text = (sharded / "out" / f"kit_ssm_{k}.log").read_text()
        assert f"--attn-shard={k}/2" in text and "--attn-backend=triton_ssm:triton_ssm " in text
        assert "MAX_JOBS=8" in text and " -n " not in text, text
    mamba1 = (sharded / "out" / "kit_ssm_mamba1.log").read_text()  # one run, as before
    assert "--attn-backend=triton_ssm:triton_ssm_mamba1" in mamba1 and "--attn-shard" not in mamba1
    # without KIT_SHARDS: one xdist run over the stage's processes
    _run_stages(whole, "kit_ssm", python3=stub, XDIST="6")
    text = (whole / "out" / "kit_ssm.log").read_text()
    assert "-n 6 --attn-backend=triton_ssm:triton_ssm" in text and "--attn-shard" not in text
