"""mamba_ssm's selective-scan forward built from packed sources (bench/mamba_ssm_scan.py), on CPU.

What can go wrong before the H200 ever compiles it: the pack script copies the wrong files or
records no commit; upstream's ``selective_scan.cpp`` dispatches a ``selective_scan_bwd_cuda`` /
``selective_scan_fwd_cuda`` combination that neither our backward stub nor upstream's forward
``.cu`` files instantiate (the extension would then fail to import, "undefined symbol", after a
minute of building); the bench's correctness verdict lets a NaN through. The tests against the
real upstream sources read the git-ignored ``.ext/mamba_ssm_src/`` and skip without it.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "attn_plugins" / "triton_ssm" / "bench"
SCRIPT = ROOT / "scripts" / "pack_mamba_ssm_src.sh"
PACKED_DIR = ROOT / ".ext" / "mamba_ssm_src"


def _bench_module(name: str):
    """Import ``name`` from the bench folder (not a package) for a module's tests."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def mss():
    yield from _bench_module("mamba_ssm_scan")


def _script_files() -> list[str]:
    text = SCRIPT.read_text()
    body = re.search(r"^files=\((.*?)^\)", text, re.S | re.M)
    assert body, "pack_mamba_ssm_src.sh: no files=( ... ) array"
    return body.group(1).split()


def test_pack_list_matches_loader(mss):
    """The script copies exactly what load() checks for and compiles (plus the license)."""
    assert sorted([*_script_files(), "LICENSE"]) == sorted(mss.PACKED)
    assert set(mss.SOURCES) <= set(mss.PACKED)
    assert all("bwd" not in f for f in mss.PACKED)


# --- the pack script on a fake upstream tree --------------------------------------------------
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _fake_upstream(tmp_path: Path, extra_include: str | None = None) -> tuple[Path, str]:
    repo = tmp_path / "mamba"
    d = repo / "csrc" / "selective_scan"
    d.mkdir(parents=True)
    for f in _script_files():
        (d / f).write_text(f"// {f}\n")
    (d / "selective_scan_bwd_kernel.cuh").write_text("// not wanted\n")
    (d / "selective_scan_fwd_kernel.cuh").write_text(
        '#include "selective_scan.h"\n#include "static_switch.h"\n'
        + (f'#include "{extra_include}"\n' if extra_include else "")
    )
    (repo / "LICENSE").write_text("Apache License 2.0 (fake)\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "fake"], check=True)
    commit = subprocess.run([*git[:3], "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    return repo, commit


def _pack(src: Path, out: Path, *rev: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(src), *(rev or ("HEAD",)), str(out)],
                          capture_output=True, text=True)  # fmt: skip


@needs_git
@pytest.mark.parametrize("form", ["worktree", "bare"])
def test_pack_script_copies_the_forward_and_records_the_commit(tmp_path, mss, form):
    repo, commit = _fake_upstream(tmp_path)
    src = repo
    if form == "bare":  # like the mirror: a git dir without a work tree
        src = tmp_path / "mirror.git"
        subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(src)], check=True)
    out = tmp_path / "out" / "mamba_ssm_src"
    r = _pack(src, out)
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*mss.PACKED, "SOURCE"])
    assert (out / "LICENSE").read_text() == "Apache License 2.0 (fake)\n"
    assert (out / "selective_scan.cpp").read_text() == "// selective_scan.cpp\n"
    assert mss.source_commit(out) == commit
    if form == "worktree":  # an edit on disk is what gets copied, and is said to be local
        (repo / "csrc" / "selective_scan" / "selective_scan.h").write_text("// edited\n")
        assert _pack(src, out).returncode == 0
        assert (out / "selective_scan.h").read_text() == "// edited\n"
        assert mss.source_commit(out) == f"{commit} (+ local changes)"


@needs_git
def test_pack_script_refuses_an_include_it_does_not_copy(tmp_path):
    repo, _ = _fake_upstream(tmp_path, extra_include="new_header.h")
    out = tmp_path / "out"
    r = _pack(repo, out)
    assert r.returncode != 0
    assert "new_header.h" in r.stderr
    assert not out.exists()


def test_source_commit_absent(tmp_path, mss):
    assert mss.source_commit(tmp_path / "nothing") is None


# --- the stub against the real upstream selective_scan.cpp -------------------------------------
needs_packed = pytest.mark.skipif(
    not (PACKED_DIR / "selective_scan.cpp").is_file(),
    reason=".ext/mamba_ssm_src absent (scripts/pack_mamba_ssm_src.sh packs it)",
)


def _norm(t: str) -> str:
    t = re.sub(r"\s+", "", t)
    return {"complex_t": "c10::complex<float>", "c10::Half": "at::Half",
            "c10::BFloat16": "at::BFloat16"}.get(t, t)  # fmt: skip


def _dispatched(cpp: str, fn: str) -> set[tuple[str, str]]:
    """The (input_t, weight_t) pairs ``selective_scan.cpp`` dispatches ``fn`` over: the two
    DISPATCH_* macros wrapped around its call, each expanded to its ``using`` types."""
    m = re.search(
        r"(DISPATCH_\w+)\(u\.scalar_type\(\),\s*\"(\w+)\",\s*\[&\]\s*\{\s*"
        r"(DISPATCH_\w+)\(A\.scalar_type\(\),\s*\"\w+\",\s*\[&\]\s*\{\s*"
        rf"{fn}<input_t,\s*weight_t>\(",
        cpp,
    )
    assert m, f"no dispatch of {fn} found in selective_scan.cpp: its layout changed"

    def types(macro: str, var: str) -> list[str]:
        body = re.search(rf"#define {macro}\b(.*?)(?=\n#define|\ntemplate)", cpp, re.S)
        assert body, macro
        return [_norm(t) for t in re.findall(rf"using {var} = ([^;]+);", body.group(1))]

    ins, ws = types(m.group(1), "input_t"), types(m.group(3), "weight_t")
    assert ins and ws
    return {(i, w) for i in ins for w in ws}


def _instantiated(text: str, fn: str) -> set[tuple[str, str]]:
    pat = rf"^template void {fn}<([^,>]+(?:<[^>]*>)?),\s*([^>]+(?:<[^>]*>)?)>\("
    return {(_norm(a), _norm(b)) for a, b in re.findall(pat, text, re.M)}


@needs_packed
def test_stub_and_forward_cover_every_dispatched_instantiation(mss):
    cpp = (PACKED_DIR / "selective_scan.cpp").read_text()
    bwd = _dispatched(cpp, "selective_scan_bwd_cuda")
    fwd = _dispatched(cpp, "selective_scan_fwd_cuda")
    # upstream today: 3 input types x (float, complex) for both
    assert len(bwd) == 6 and len(fwd) == 6
    assert ("at::BFloat16", "float") in fwd
    assert _instantiated(mss.STUB.read_text(), "selective_scan_bwd_cuda") == bwd
    fwd_defined: set[tuple[str, str]] = set()
    for f in mss.SOURCES:
        if f.endswith(".cu"):
            fwd_defined |= _instantiated((PACKED_DIR / f).read_text(), "selective_scan_fwd_cuda")
    assert fwd_defined == fwd


@needs_packed
def test_packed_dir_is_complete_and_records_a_commit(mss):
    assert all((PACKED_DIR / f).is_file() for f in mss.PACKED)
    commit = mss.source_commit(PACKED_DIR)
    assert commit and re.match(r"[0-9a-f]{40}", commit), commit


# --- the bench's side -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    yield from _bench_module("bench_ssm")


def test_check_verdict(bench):
    tol = bench.MAMBA1_CHECK_TOL
    assert bench._check_verdict(tol / 10, 0.0) == "ok"
    assert bench._check_verdict(0.0, tol * 2) == "MISMATCH"
    assert bench._check_verdict(0.0, float("nan")) == "MISMATCH"
    assert bench._check_verdict(float("nan"), 0.0) == "MISMATCH"
    assert bench._check_verdict(float("inf"), 0.0) == "MISMATCH"


def test_diff_keeps_nan(bench):
    torch = pytest.importorskip("torch")
    ref = torch.tensor([1.0, -4.0, 2.0])
    d = bench._diff("out", torch.tensor([1.0, -4.0, 2.5]), ref)
    assert d == {"out_maxabs": 0.5, "out_maxrel": 0.125}
    d = bench._diff("state", torch.tensor([1.0, float("nan"), 2.0]), ref)
    assert d["state_maxabs"] != d["state_maxabs"]  # NaN
    assert bench._check_verdict(0.0, d["state_maxrel"]) == "MISMATCH"


def test_mamba_ssm_row_says_why_when_nothing_to_run(bench, mss, monkeypatch):
    """No mamba_ssm package and no packed sources: the row's error names both and the fix."""
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # import fails, installed or not
    monkeypatch.setattr(mss, "source_commit", lambda *a: None)
    with pytest.raises(RuntimeError, match=r"skipped: mamba_ssm not importable .*pack_mamba_ssm"):
        bench._mamba_ssm_scan()
