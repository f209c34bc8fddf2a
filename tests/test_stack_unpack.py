"""scripts/stack_unpack.sh assembles the newest kernel stack (scripts/pack_newest_stack.sh) from
parts carried over several device calls: nothing is unpacked until every part is there and the
archive's checksum matches, and a call that still lacks parts names them."""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "stack_unpack.sh"


def _pack(tmp_path: Path, files: dict[str, bytes], part_size: int) -> tuple[bytes, list[Path]]:
    """An xz tarball of ``files`` cut into ``part_aa``, ``part_ab``, ... as split(1) names them."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{name}")  # as tar -cf - . names them
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = lzma.compress(raw.getvalue())
    chunks = [archive[i : i + part_size] for i in range(0, len(archive), part_size)]
    names = [f"part_a{chr(ord('a') + i)}" for i in range(len(chunks))]
    parts = []
    for name, chunk in zip(names, chunks, strict=True):
        (tmp_path / "all").mkdir(exist_ok=True)
        path = tmp_path / "all" / name
        path.write_bytes(chunk)
        parts.append(path)
    return archive, parts


def _part_lines(parts: list[Path]) -> str:
    """The MANIFEST's part list, in the order the archive is their concatenation."""
    return "".join(f"part {p.name}\n" for p in parts)


def _carry(tmp_path: Path, call: str, manifest: str, parts: list[Path]) -> Path:
    """The folder one device call carries: the MANIFEST and some of the parts."""
    d = tmp_path / call
    d.mkdir()
    (d / "MANIFEST").write_text(manifest)
    for p in parts:
        shutil.copy(p, d / p.name)
    return d


def _unpack(carried: Path, site: Path, stage: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("bash") is None or shutil.which("xz") is None:
        pytest.skip("needs bash and xz")
    return subprocess.run(
        ["bash", str(SCRIPT), str(carried), str(site), str(stage)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_parts_over_two_calls_unpack_once_all_are_there(tmp_path):
    rng = random.Random(0)  # incompressible contents, so that the archive needs several parts
    payload = {"flashinfer/__init__.py": rng.randbytes(1500), "fla/__init__.py": rng.randbytes(900)}
    archive, parts = _pack(tmp_path, payload, part_size=400)
    assert len(parts) >= 3, "the test needs an archive of several parts"
    manifest = (
        _part_lines(parts) + f"sha256 {hashlib.sha256(archive).hexdigest()}\n"
        "wheel flashinfer_python-0.7.4-py3-none-any.whl\n"
    )
    site, stage = tmp_path / "site", tmp_path / "stage"

    first = _unpack(_carry(tmp_path, "call1", manifest, parts[:1]), site, stage)
    assert first.returncode == 3, first.stdout + first.stderr
    rest = " ".join(p.name for p in parts[1:])
    assert f"1 of {len(parts)} parts here; carry {rest} in the next call" in first.stdout
    assert not (site / "flashinfer").exists(), "nothing may be unpacked before every part is in"

    second = _unpack(_carry(tmp_path, "call2", manifest, parts[1:]), site, stage)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (site / "flashinfer" / "__init__.py").read_bytes() == payload["flashinfer/__init__.py"]
    assert (site / "fla" / "__init__.py").read_bytes() == payload["fla/__init__.py"]
    assert "flashinfer_python-0.7.4-py3-none-any.whl" in second.stdout

    (site / "fla" / "__init__.py").write_bytes(b"changed after the unpack\n")
    third = _unpack(_carry(tmp_path, "call3", manifest, []), site, stage)
    assert third.returncode == 0 and "already unpacked" in third.stdout
    assert (site / "fla" / "__init__.py").read_bytes() == b"changed after the unpack\n"


def test_a_part_that_does_not_match_the_checksum_leaves_the_site_alone(tmp_path):
    archive, parts = _pack(
        tmp_path, {"flashinfer/__init__.py": random.Random(1).randbytes(1000)}, part_size=300
    )
    manifest = _part_lines(parts) + f"sha256 {hashlib.sha256(archive).hexdigest()}\n"
    parts[-1].write_bytes(parts[-1].read_bytes()[:-1] + b"\0")  # one byte off in transit
    site, stage = tmp_path / "site", tmp_path / "stage"
    r = _unpack(_carry(tmp_path, "call", manifest, parts), site, stage)
    assert r.returncode == 1
    assert "checksum mismatch" in r.stderr
    assert not (site / "flashinfer").exists()


def test_the_stack_replaces_the_site_s_folders_of_the_same_names(tmp_path):
    """A machine that had FlashInfer 0.6.7 from .whl: none of its files or its dist-info may
    stay beside the stack's release; what the stack does not bring stays."""
    rng = random.Random(3)
    payload = {
        "flashinfer/__init__.py": rng.randbytes(500),
        "flashinfer_python-0.7.4.dist-info/METADATA": b"Version: 0.7.4\n",
    }
    archive, parts = _pack(tmp_path, payload, part_size=10_000)
    manifest = _part_lines(parts) + f"sha256 {hashlib.sha256(archive).hexdigest()}\n"
    site = tmp_path / "site"
    for old in ("flashinfer/stale_module.py", "flashinfer_python-0.6.7.dist-info/METADATA",
                "triton_extra/keep.py"):  # fmt: skip
        (site / old).parent.mkdir(parents=True, exist_ok=True)
        (site / old).write_text("old\n")

    r = _unpack(_carry(tmp_path, "call", manifest, parts), site, tmp_path / "stage")

    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "flashinfer" / "__init__.py").read_bytes() == payload["flashinfer/__init__.py"]
    assert not (site / "flashinfer" / "stale_module.py").exists()
    assert not (site / "flashinfer_python-0.6.7.dist-info").exists()
    assert (site / "flashinfer_python-0.7.4.dist-info" / "METADATA").exists()
    assert (site / "triton_extra" / "keep.py").read_text() == "old\n"


def test_a_part_left_from_an_earlier_pack_is_not_read(tmp_path):
    """The stage folder of a warm machine may still hold a part of an earlier, longer pack:
    only the parts the MANIFEST lists make the archive."""
    archive, parts = _pack(tmp_path, {"fla/__init__.py": random.Random(4).randbytes(500)}, 300)
    stale = f"part_a{chr(ord('a') + len(parts))}"  # the name a next part would have
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / stale).write_bytes(b"a part of another pack")
    manifest = _part_lines(parts) + f"sha256 {hashlib.sha256(archive).hexdigest()}\n"
    r = _unpack(_carry(tmp_path, "call", manifest, parts), tmp_path / "site", stage)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "fla" / "__init__.py").exists()


def test_without_a_manifest_it_says_so(tmp_path):
    carried = tmp_path / "call"
    carried.mkdir()
    r = _unpack(carried, tmp_path / "site", tmp_path / "stage")
    assert r.returncode == 1 and "no MANIFEST" in r.stderr


def _gpu_run_stack_install(repo: Path, tmp_path: Path, stack: str) -> str:
    """gpu_run.sh's stack_install stage in a copy of the scripts: the summary it writes."""
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", "scripts/gpu_run.sh", "stack_install"], cwd=repo, capture_output=True,
        text=True, timeout=60, env={"PATH": os.environ["PATH"], "OUT": str(out),
                                    "STACK": stack, "STACK_SITE": str(tmp_path / "site"),
                                    "STACK_STAGE": str(tmp_path / "stage")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = (out / "summary.log").read_text()
    (out / "summary.log").unlink()
    return summary


def test_gpu_run_s_stage_installs_each_whole_layer_and_names_the_parts_to_carry(tmp_path):
    """stack_install in gpu_run.sh over the two layers pack_newest_stack.sh makes: a layer
    whose parts have all come is unpacked (and the versions are read), the other says what to
    carry next; the next call completes it from the parts the first left on the machine. No
    version check runs while no layer is whole."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("gpu_run.sh", "stack_unpack.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "scripts" / "device_setup.sh").write_text("")  # the H200's wheels: not here
    layers = {}
    for layer, seed in (("kernels", 5), ("cutlass", 6)):
        (tmp_path / layer).mkdir()
        payload = {f"{layer}_pkg/__init__.py": random.Random(seed).randbytes(900)}
        archive, parts = _pack(tmp_path / layer, payload, 10_000 if layer == "kernels" else 800)
        manifest = _part_lines(parts) + f"sha256 {hashlib.sha256(archive).hexdigest()}\n"
        layers[layer] = manifest, parts
    stack = ".whl-new/kernels .whl-new/cutlass"
    (repo / ".whl-new").mkdir()
    kernels_manifest, kernels_parts = layers["kernels"]
    cutlass_manifest, cutlass_parts = layers["cutlass"]
    assert len(kernels_parts) == 1 and len(cutlass_parts) >= 2

    # a first call with no layer whole: nothing unpacked, no version check
    _carry(repo / ".whl-new", "kernels", kernels_manifest, [])
    _carry(repo / ".whl-new", "cutlass", cutlass_manifest, cutlass_parts[:1])
    summary = _gpu_run_stack_install(repo, tmp_path, stack)
    assert "[stack_install_kernels rc=3" in summary and "stack_versions" not in summary, summary

    # the kernels layer whole, cutlass still waiting on its later parts
    shutil.rmtree(repo / ".whl-new")
    (repo / ".whl-new").mkdir()
    _carry(repo / ".whl-new", "kernels", kernels_manifest, kernels_parts)
    _carry(repo / ".whl-new", "cutlass", cutlass_manifest, [])
    summary = _gpu_run_stack_install(repo, tmp_path, stack)
    assert "[stack_install_kernels rc=0" in summary, summary
    later = " ".join(p.name for p in cutlass_parts[1:])
    assert "[stack_install_cutlass rc=3" in summary and f"carry {later}" in summary, summary
    assert "stack_versions" in summary, summary
    assert (tmp_path / "site" / "kernels_pkg" / "__init__.py").exists()
    assert not (tmp_path / "site" / "cutlass_pkg").exists()

    # the next call carries the rest of cutlass and not the kernels layer
    shutil.rmtree(repo / ".whl-new")
    (repo / ".whl-new").mkdir()
    _carry(repo / ".whl-new", "cutlass", cutlass_manifest, cutlass_parts[1:])
    summary = _gpu_run_stack_install(repo, tmp_path, stack)
    assert "[stack_install_kernels rc=0" in summary and "[stack_install_cutlass rc=0" in summary
    assert (tmp_path / "site" / "cutlass_pkg" / "__init__.py").exists()
