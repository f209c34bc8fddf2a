"""Prefill / decode disaggregation: a request prefilled on rank 0 (page 4) decodes on rank 1
(page 16) after its state moves over gloo, equal to one engine's run, for every causal family;
corrupted headers and metadata are refused on both sides by name; the measurement mode runs.

One torchrun of ``attn_core.e2e.handoff_check --model all --corrupt --measure`` (small sizes)
checks everything: two processes start once. The engine's hand-off arguments are also checked
in one process (no transport) and their misuse is refused.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import torch
from two_ranks import torchrun

from attn_core.e2e.handoff_check import (
    DECODE_PAGE,
    HANDOFF_FAMILIES,
    PREFILL_PAGE,
    REFUSALS,
    TOLERANCE,
)

pytest.importorskip("transformers")


def _torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun("attn_core.e2e.handoff_check", *args, timeout=timeout)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("handoff") / "results.json"
    proc = _torchrun(
        "--device", "cpu", "--model", "all", "--prompts", "2", "--new-tokens", "3",
        "--corrupt", "--measure", "--tokens", "80", "--layers", "2", "--kv-heads", "2",
        "--head-dim", "16", "--iters", "2", "--timeout", "120", "--json", str(out),
    )  # fmt: skip
    if not out.is_file():
        pytest.fail(
            f"handoff_check wrote no results:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    results = {r["name"]: r for r in json.loads(out.read_text())}
    return {"proc": proc, "results": results}


@pytest.mark.parametrize("name", HANDOFF_FAMILIES)
def test_decode_after_the_hand_off_equals_one_engine(name: str, gloo_run: dict[str, Any]) -> None:
    result = gloo_run["results"][name]
    assert result["ok"] and not result["error"], result
    assert result["max_abs_diff"] <= TOLERANCE and result["prefill_diff"] <= TOLERANCE, result
    assert result["tokens_equal"] and result["nbytes"] > 0, result


@pytest.mark.parametrize("case", REFUSALS)
def test_a_corrupted_or_unfitting_export_is_refused_by_name(
    case: str, gloo_run: dict[str, Any]
) -> None:
    result = gloo_run["results"][f"refuse {case}"]
    want_receiver, want_sender = REFUSALS[case]
    assert result["ok"], result
    receiver, sender, kept = result["detail"].split(" | ")
    assert "HandoffError" in receiver and want_receiver in receiver, result
    assert "HandoffError: rank 1 refused the export's" in sender and want_sender in sender
    assert kept == "resident request intact", result


def test_after_the_refusals_a_genuine_export_imports(gloo_run: dict[str, Any]) -> None:
    result = gloo_run["results"]["after refusals"]
    assert result["ok"] and not result["error"], result


def test_the_measurement_runs_and_checks_the_bytes(gloo_run: dict[str, Any]) -> None:
    result = gloo_run["results"]["measure"]
    assert result["ok"], result
    assert (
        result["nbytes"] == 2 * 2 * 80 * 2 * 16 * 2
    )  # layers x (k, v) x tokens x heads x dim x 2 B
    assert set(result["gbps"]) == {"send", "export_send_import", "link"}
    assert all(v > 0 for v in result["gbps"].values()), result
    assert "of the link" in result["detail"] and "bytes equal" in result["detail"], result


def test_exit_status_and_one_line_per_family(gloo_run: dict[str, Any]) -> None:
    proc = gloo_run["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("handoff_check ")]
    assert len(lines) == len(HANDOFF_FAMILIES) + len(REFUSALS) + 2, proc.stdout
    assert not [ln for ln in lines if not ln.endswith("-> OK")], proc.stdout
    family = [ln for ln in lines if f"page {PREFILL_PAGE} -> {DECODE_PAGE}, " in ln]
    assert len(family) == len(HANDOFF_FAMILIES) and all("tokens equal" in ln for ln in family)


def test_handoff_check_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_core.e2e.handoff_check import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen3,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--new-tokens", "1"])
    assert exc.value.code == 2 and "--new-tokens" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# the engine's side of a hand-off, in one process
# ------------------------------------------------------------------------------------------
def _engines(name: str, ids: list[list[int]], new_tokens: int):
    from attn_core.e2e.handoff_check import _engine
    from attn_core.e2e.main import default_registry

    kw = dict(
        device=torch.device("cpu"), prompts=ids, new_tokens=new_tokens, shapes="tiny",
        registry=default_registry(),
    )  # fmt: skip
    return _engine(name, PREFILL_PAGE, **kw), _engine(name, DECODE_PAGE, **kw)


def test_an_engine_prefills_keeps_the_state_and_another_decodes_from_its_import() -> None:
    from attn_core.e2e.main import make_prompts

    ids = make_prompts(2)
    prefill, decode = _engines("deepseek-v3", ids, 3)
    ref = decode.generate(ids, 3)
    pre = prefill.generate(ids, 1, release=False)
    assert prefill.state.request_ids() == [0, 1]  # kept for the export
    assert [prefill.state.num_tokens(i) for i in (0, 1)] == [len(p) for p in ids]
    for i in (0, 1):
        decode.state.import_request(i, prefill.state.export_request(i))
    out = decode.generate(ids, 3, generated=[t[:1] for t in pre.tokens])
    assert out.tokens == ref.tokens and all(len(t) == 3 for t in out.tokens)
    for got, want, p in zip(out.logits, ref.logits, ids, strict=True):
        assert got.shape == (2, want.shape[1])  # the two rows decoded here
        assert (got - want[len(p) :]).abs().max().item() <= TOLERANCE
    assert decode.state.request_ids() == []  # released when done
    assert set(out.step_modes) == {"decode"}


def test_generated_tokens_must_match_the_imported_state() -> None:
    from attn_core.e2e.main import make_prompts

    ids = make_prompts(2)
    prefill, decode = _engines("qwen3", ids, 3)
    held = r"request 0: the state holds None tokens, expected 7 \(its 7-token prompt"
    with pytest.raises(ValueError, match=held):
        decode.generate(ids, 3, generated=[[5], [6]])
    prefill.generate(ids, 1, release=False)
    for i in (0, 1):
        decode.state.import_request(i, prefill.state.export_request(i))
    with pytest.raises(ValueError, match=r"request 0: the state holds 7 tokens, expected 8"):
        decode.generate(ids, 3, generated=[[5, 6], [6, 7]])
    with pytest.raises(ValueError, match=r"request 0: 3 tokens generated already, expected 1\.\.2"):
        decode.generate(ids, 3, generated=[[5, 6, 7], [6]])
    with pytest.raises(ValueError, match=r"generated: 1 token lists for 2 prompts"):
        decode.generate(ids, 3, generated=[[5]])
    assert decode.state.request_ids() == [0, 1]  # nothing ran, nothing released


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_hand_off_matches_one_engine_and_refuses_by_name() -> None:
    proc = _torchrun("--device", "cuda", "--model", "all", "--corrupt")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("handoff_check ")]
    assert len(lines) == len(HANDOFF_FAMILIES) + len(REFUSALS) + 1
    assert all(ln.endswith("-> OK") for ln in lines), proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_measure_a_32k_qwen3_8b_request() -> None:
    """4.8 GB of KV (36 layers x 8 KV heads x 128, bf16, 32768 tokens) from GPU 0 to GPU 1."""
    proc = _torchrun("--device", "cuda", "--measure", timeout=500)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("handoff_check measure"))
    assert "nccl on cuda" in line and "bytes equal" in line and line.endswith("-> OK"), line
