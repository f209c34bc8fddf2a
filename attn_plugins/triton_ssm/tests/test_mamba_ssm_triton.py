"""mamba_ssm's Triton SSD packed for the bench (scripts/pack_mamba_ssm_triton.sh,
bench/mamba_ssm_ssd.py, bench_ssm.py's mamba2_vs_mamba_ssm), on CPU.

What can go wrong before the H200 runs it: the pack script copies the wrong files, misses a
module the forward imports, keeps upstream's ``__init__.py`` (which imports the CUDA selective
scan) or records no commit; the bench maps our inputs to mamba_chunk_scan_combined's layouts
or conventions wrongly (then the check, not the kernel, would be blamed on the device); a
missing einops crashes instead of saying so. The tests on the real upstream files read the
git-ignored ``.ext/mamba_ssm_triton/`` and skip without it; the interpreter test runs upstream's
kernels under ``TRITON_INTERPRET=1`` in float32 (the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "pack_mamba_ssm_triton.sh"
PACKED_DIR = ROOT / ".ext" / "mamba_ssm_triton"
BENCH = ROOT / "attn_plugins" / "triton_ssm" / "bench"


def _bench_module(name: str):
    """Import ``name`` from the bench folder (not a package) for a module's tests."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
needs_packed = pytest.mark.skipif(
    not (PACKED_DIR / "SOURCE").is_file(),
    reason=".ext/mamba_ssm_triton absent (scripts/pack_mamba_ssm_triton.sh packs it)",
)


@pytest.fixture(scope="module")
def mss():
    yield from _bench_module("mamba_ssm_ssd")


@pytest.fixture(scope="module")
def bench():
    yield from _bench_module("bench_ssm")


def _script_files() -> list[str]:
    body = re.search(r"^files=\((.*?)^\)", SCRIPT.read_text(), re.S | re.M)
    assert body, "pack_mamba_ssm_triton.sh: no files=( ... ) array"
    return body.group(1).split()


def test_pack_list_matches_loader(mss):
    """The script copies exactly what the loader checks for (plus the license), and the empty
    ``__init__.py`` files the loader expects are those of the copied files' packages."""
    files = _script_files()
    assert sorted([*files, "LICENSE"]) == sorted(mss.PACKED)
    assert "mamba_ssm/ops/triton/ssd_combined.py" in files
    pkgs = set()
    for f in files:
        d = Path(f).parent
        while str(d) != ".":
            pkgs.add(f"{d}/__init__.py")
            d = d.parent
    assert pkgs == set(mss.INITS)


# --- the pack script on a fake upstream tree --------------------------------------------------
def _fake_upstream(tmp_path: Path, extra_import: str | None = None) -> tuple[Path, str]:
    repo = tmp_path / "mamba"
    for f in _script_files():
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(f"# {f}\nfrom mamba_ssm.utils.determinism import autotune_configs\n")
    (repo / "mamba_ssm/ops/triton/ssd_combined.py").write_text(
        "from mamba_ssm.ops.triton.ssd_bmm import x\n"
        "def ref():\n    from mamba_ssm.ops.selective_scan_interface import y  # lazy: ignored\n"
        + (f"{extra_import}\n" if extra_import else "")
    )
    (repo / "mamba_ssm/__init__.py").write_text(
        '__version__ = "9.8.7"\n\nfrom mamba_ssm.ops.selective_scan_interface import f\n'
    )
    (repo / "mamba_ssm/ops/triton/selective_state_update.py").write_text("# not wanted\n")
    (repo / "LICENSE").write_text("Apache License 2.0 (fake)\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "fake"], check=True)
    commit = subprocess.run([*git[:3], "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    return repo, commit


def _pack(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(src), "HEAD", str(out)], capture_output=True,
                          text=True)  # fmt: skip


@needs_git
@pytest.mark.parametrize("form", ["worktree", "bare"])
def test_pack_script_copies_the_closure_and_records_the_commit(tmp_path, mss, form):
    repo, commit = _fake_upstream(tmp_path)
    src = repo
    if form == "bare":  # like the mirror: a git dir without a work tree
        src = tmp_path / "mirror.git"
        subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(src)], check=True)
    out = tmp_path / "out" / "mamba_ssm_triton"
    r = _pack(src, out)
    assert r.returncode == 0, r.stderr
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted([*mss.PACKED, *mss.INITS, "SOURCE"])
    assert mss.missing_files(out) == []
    for init in mss.INITS:  # upstream's imports the CUDA selective scan: written empty
        assert (out / init).read_text() == ""
    assert (out / "mamba_ssm/ops/triton/ssd_bmm.py").read_text().startswith("# mamba_ssm/ops")
    assert (out / "LICENSE").read_text() == "Apache License 2.0 (fake)\n"
    assert mss.source_info(out) == {"commit": commit, "version": "9.8.7"}


@needs_git
@pytest.mark.parametrize(
    "line", ["from mamba_ssm.ops.triton.new_module import z", "import mamba_ssm.utils.other"]
)
def test_pack_script_refuses_an_import_it_does_not_copy(tmp_path, line):
    repo, _ = _fake_upstream(tmp_path, extra_import=line)
    out = tmp_path / "out"
    r = _pack(repo, out)
    assert r.returncode != 0
    assert line.split()[1] in r.stderr
    assert not out.exists()


def test_source_info_and_missing_files_without_a_pack(tmp_path, mss):
    assert mss.source_info(tmp_path) is None
    assert "mamba_ssm/ops/triton/ssd_combined.py" in mss.missing_files(tmp_path)


# --- loading -----------------------------------------------------------------------------------
def _python(code: str, env: dict | None = None, timeout: float = 300):
    """Run ``code`` in a fresh interpreter (its own sys.modules) from the bench folder."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(BENCH), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=str(ROOT))  # fmt: skip


def test_row_says_how_to_pack_when_sources_absent(tmp_path, mss, monkeypatch):
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # not installed, whatever this machine has
    monkeypatch.setattr(mss, "_LOADED", {})
    with pytest.raises(RuntimeError, match=r"^skipped: mamba_ssm not importable .*lacks .*"
                       r"pack_mamba_ssm_triton\.sh.*carry \.ext"):  # fmt: skip
        mss.load(tmp_path / "nothing")


def test_bench_row_without_sources_is_an_error_row_not_a_crash(bench, mss, monkeypatch, tmp_path):
    """The bench's job raises the loader's "skipped: ..." before touching CUDA: the worker
    turns it into the row's error."""
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    monkeypatch.setattr(mss, "_LOADED", {})
    monkeypatch.setattr(mss, "DEFAULT_DIR", str(tmp_path / "nothing"))
    monkeypatch.setattr(mss.load, "__defaults__", (str(tmp_path / "nothing"), True))
    with pytest.raises(RuntimeError, match="pack_mamba_ssm_triton"):
        bench.job_mamba2_vs_mamba_ssm(T=64, n_seq=1, device="cpu")


@needs_packed
def test_packed_dir_is_complete_and_records_a_commit(mss):
    assert mss.missing_files(PACKED_DIR) == []
    info = mss.source_info(PACKED_DIR)
    assert info and re.fullmatch(r"[0-9a-f]{40}", info["commit"]), info


@needs_packed
def test_packed_closure_imports_without_cuda_extensions():
    """The real upstream files import from the packed folder alone (no mamba_ssm installed
    needed), and nothing pulls mamba_ssm's CUDA selective scan or causal_conv1d."""
    pytest.importorskip("einops")
    r = _python("""
        import sys
        import mamba_ssm_ssd
        fn, provider = mamba_ssm_ssd.load(prefer_installed=False)
        mods = sorted(m for m in sys.modules if m.startswith("mamba_ssm."))
        print(provider); print(fn.__module__); print(" ".join(mods))
        print("selective_scan_cuda" in sys.modules, "mamba_ssm.ops.selective_scan_interface"
              in sys.modules)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    provider, module, mods, cuda = r.stdout.strip().splitlines()[-4:]
    assert module == "mamba_ssm.ops.triton.ssd_combined"
    assert "Triton SSD (packed " in provider
    assert "mamba_ssm.ops.triton.ssd_chunk_scan" in mods.split()
    assert cuda == "False False"


@needs_packed
def test_missing_einops_is_named_in_the_error():
    r = _python("""
        import sys
        sys.modules["einops"] = None  # as if not installed
        import mamba_ssm_ssd
        try:
            mamba_ssm_ssd.load(prefer_installed=False)
        except RuntimeError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^skipped: .*imports einops.*pip install einops", r.stdout, re.M), r.stdout


# --- the argument mapping ----------------------------------------------------------------------
def _inputs(bench, T=12, n_seq=3, H=4, G=2, N=8, P=4):
    a = bench._mamba2_prefill_inputs(T, n_seq, H, G, N, P, device="cpu", dtype="float32")
    return a, a.pop("cu_seqlens_cpu")


def _recorder():
    calls = []

    def fn(*args, **kw):
        calls.append((args, kw))
        return "result"

    return fn, calls


def test_call_batch_layout(bench, mss):
    torch = pytest.importorskip("torch")
    a, cu = _inputs(bench)
    fn, calls = _recorder()
    run, unpack = mss.call(fn, a, cu, layout="batch", chunk_size=256)
    assert not calls  # prepared, not called
    assert run() == "result"
    (x, dt, A, B, C, chunk), kw = calls[0]
    assert x.shape == (3, 4, 4, 4) and dt.shape == (3, 4, 4)  # (batch, seqlen, nheads, headdim)
    assert B.shape == C.shape == (3, 4, 2, 8)  # (batch, seqlen, ngroups, dstate)
    assert torch.equal(x.reshape(12, 4, 4), a["x"]) and torch.equal(C.reshape(12, 2, 8), a["C"])
    assert chunk == 256
    assert A.dtype == torch.float32 and torch.allclose(A, -torch.exp(a["A_log"]))
    assert kw["dt_softplus"] is True and kw["z"] is None and kw["return_final_states"] is True
    assert kw["D"] is a["D"] and kw["dt_bias"] is a["dt_bias"]
    assert "state_dtype" not in kw and "seq_idx" not in kw
    h0 = kw["initial_states"]  # (batch, nheads, headdim, dstate) from slots [S, H, N, P]
    assert h0.shape == (3, 4, 4, 8) and h0.is_contiguous()
    assert torch.equal(h0[1], a["ssm_state"][a["state_indices"][1]].transpose(-1, -2))
    y, final = unpack((torch.arange(3 * 4 * 4 * 4.0).view(3, 4, 4, 4), h0))
    assert y.shape == (12, 4, 4) and torch.equal(
        y[5], torch.arange(3 * 4 * 4 * 4.0).view(12, 4, 4)[5]
    )
    assert torch.equal(final, a["ssm_state"][a["state_indices"].long()])
    mss.call(fn, a, cu, layout="batch", state_dtype=torch.float32)[0]()
    assert calls[1][1]["state_dtype"] is torch.float32


def test_call_varlen_layout(bench, mss):
    torch = pytest.importorskip("torch")
    a, cu = _inputs(bench, T=10, n_seq=3)  # lengths 3, 4, 3
    fn, calls = _recorder()
    run, unpack = mss.call(fn, a, cu, layout="varlen", chunk_size=4)
    run()
    (x, dt, _A, B, _C, chunk), kw = calls[0]
    assert chunk == 4
    assert x.shape == (1, 10, 4, 4) and dt.shape == (1, 10, 4) and B.shape == (1, 10, 2, 8)
    assert kw["seq_idx"].dtype == torch.int32
    assert kw["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    assert kw["cu_seqlens"].tolist() == cu.tolist() == [0, 3, 7, 10]
    assert kw["return_varlen_states"] is True and "initial_states" not in kw
    st = torch.randn(3, 4, 4, 8)  # (n_seq, nheads, headdim, dstate)
    y, final = unpack((torch.zeros(1, 10, 4, 4), torch.zeros(1, 4, 4, 8), st))
    assert y.shape == (10, 4, 4) and torch.equal(final, st.transpose(-1, -2))
    with pytest.raises(ValueError, match="one length"):
        mss.call(fn, a, cu, layout="batch")
    with pytest.raises(ValueError, match="layout"):
        mss.call(fn, a, cu, layout="packed")


# --- the bench section's CPU side --------------------------------------------------------------
def test_section_jobs(bench):
    n = iter(range(100))

    def job(fn, row, **kw):
        return {"id": next(n), "fn": fn, "kw": kw, "row": row}

    jobs = bench._vs_mamba_ssm_jobs(job, chunk_size=128, our_chunk=256)
    shapes = sorted((j["kw"]["T"], j["kw"]["n_seq"], j["kw"]["layout"]) for j in jobs)
    assert shapes == [(8192, 1, "batch"), (8192, 16, "batch"), (8192, 16, "varlen"),
                      (32768, 1, "batch"), (32768, 16, "batch"), (32768, 16, "varlen")]  # fmt: skip
    assert all(j["fn"] == "mamba2_vs_mamba_ssm" in bench.JOBS for j in jobs)
    assert {j["row"]["section"] for j in jobs} == {"mamba2_vs_mamba_ssm"}
    assert {(j["kw"]["chunk_size"], j["kw"]["our_chunk"]) for j in jobs} == {(128, 256)}
    long_only = bench._vs_mamba_ssm_jobs(job, tokens=(32768,))
    assert sorted((j["kw"]["T"], j["kw"]["n_seq"]) for j in long_only) == [
        (32768, 1),
        (32768, 16),
        (32768, 16),
    ]


def test_section_text(bench):
    r = {"section": "mamba2_vs_mamba_ssm", "provider": "ours vs mamba_ssm batch", "T": 8192,
         "n_seq": 1, "ms": 0.5, "Mtok_per_s": 16.4, "mamba_ssm": "mamba_ssm 2.3 Triton SSD",
         "layout": "batch", "chunk_size": 256, "our_chunk": 64, "mamba_ssm_ms": 0.4,
         "mamba_ssm_Mtok_per_s": 20.5, "mamba_ssm_speed": 0.8, "mamba_ssm_out_maxrel": 3e-3,
         "mamba_ssm_state_maxrel": 1e-3, "mamba_ssm_check": "ok",
         "mamba_ssm_float32_check": "MISMATCH", "mamba_ssm_float32_out_maxrel": 0.5,
         "mamba_ssm_float32_state_maxrel": 1e-3, "ours_ref_out_maxrel": 1e-6,
         "ours_ref_state_maxrel": 2e-6, "ours_dots_act_ms": 0.25,
         "ours_dots_act_Mtok_per_s": 32.8, "ours_dots_act_speed": 1.6,
         "ours_dots_act_ref_out_maxrel": 3e-3, "ours_dots_act_ref_state_maxrel": 4e-3,
         "ours_states_act_error": "ValueError: no"}  # fmt: skip
    text = bench._table([r], None)
    dots = next(ln for ln in text.splitlines() if "ours (precise=False)" in ln)
    assert "32.80 Mtok/s, 1.60 x mamba_ssm's rate" in dots and "out rel 3.0e-03" in dots
    assert any("ours (states_dtype=activations): failed: ValueError" in ln
               for ln in text.splitlines())  # fmt: skip
    assert "16.40 Mtok/s" in text and "20.50 Mtok/s, ours 0.80 x its rate" in text
    assert "out rel 3.0e-03, state rel 1.0e-03 ok" in text
    lines = text.splitlines()
    f32 = next(ln for ln in lines if "state_dtype=float32" in ln)
    assert "not timed" in f32 and "MISMATCH" in f32 and "out rel 5.0e-01" in f32
    assert any("ours vs float32 torch: out rel 1.0e-06" in ln for ln in lines)
    err = {"section": "mamba2_vs_mamba_ssm", "provider": "p", "T": 8192, "n_seq": 1,
           "error": "RuntimeError: skipped: ... scripts/pack_mamba_ssm_triton.sh ..."}  # fmt: skip
    assert "ERROR RuntimeError: skipped" in bench._table([err], None)


@needs_packed
def test_interpreter_check_against_our_torch_ssd(bench):
    """mamba_chunk_scan_combined under Triton's interpreter (float32, small shapes) against our
    float32 torch SSD through the bench's own check path: batch (initial states from the
    slots) and varlen (seq_idx, requests of unequal length whose boundaries fall inside
    chunks), with groups, D, dt_bias and softplus. Agreement to float32 rounding means the
    layouts and conventions map; a wrong one is off by O(1)."""
    pytest.importorskip("einops")
    r = _python(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import bench_ssm as b
        out = []
        for T, n_seq, layout in ((64, 2, "batch"), (50, 3, "varlen")):
            r = b.job_mamba2_vs_mamba_ssm(T=T, n_seq=n_seq, layout=layout, chunk_size=16,
                                          our_chunk=16, H=4, G=2, N=16, P=16, device="cpu",
                                          impl="torch", dtype="float32")
            out.append(r)
        print("@@" + json.dumps(out))
        """,
        env={"TRITON_INTERPRET": "1", "MAMBA_DETERMINISTIC": "1",
             "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "attn_plugins/triton_ssm")])},
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.split("@@", 1)[1])
    for row in rows:
        assert row["check"] == "ok", row
        assert "Triton SSD (packed" in row["mamba_ssm"]
        for v in ("mamba_ssm", "mamba_ssm_float32"):
            for what in ("out", "state"):
                assert row[f"{v}_{what}_maxrel"] < 1e-4, (row["layout"], v, what, row)
                assert row[f"{v}_ref_{what}_maxrel"] < 1e-4
        for v in bench.OUR_SSD_VARIANTS:
            for what in ("out", "state"):
                assert row[f"{v}_ref_{what}_maxrel"] < 1e-4, (row["layout"], v, what, row)
        assert "ms" not in row  # the CPU dry run times nothing
