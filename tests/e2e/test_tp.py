"""Tensor parallelism: every family's heads over 2 ranks (torchrun, gloo on CPU) vs the
unsharded run and transformers (the encoder stacks: every block's hidden states and the final
output); heads that cannot split are refused by name.

One torchrun of ``attn_core.e2e.tp_check --model all`` checks every family (two processes
start once: torch and transformers imports dominate a per-family launch); each family is its
own test case reading that run's results.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import torch
from two_ranks import torchrun

from attn_core.e2e.configs import ENCODER_MODELS, ENCODER_RUNS
from attn_core.e2e.tp_check import TP_FAMILIES

pytest.importorskip("transformers")


def _torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return torchrun("attn_core.e2e.tp_check", *args, timeout=timeout)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp") / "results.json"
    proc = _torchrun(
        "--device", "cpu", "--model", "all", "--prompts", "2", "--new-tokens", "3",
        "--json", str(out),
    )  # fmt: skip
    if not out.is_file():
        pytest.fail(f"tp_check wrote no results:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = {r["name"]: r for r in json.loads(out.read_text())}
    return {"proc": proc, "results": results}


# Families whose per-rank state is not half the TP=1 state: MLA's latent KV is shared by all
# heads (replicated), one KV head is replicated, Kimi-Linear splits its KDA states only,
# Bamba's single Mamba2 group keeps its conv's B / C channels on both ranks, Qwen3-Next's single
# Gated DeltaNet key head its q / k conv channels.
_STATE_NOT_HALVED = {
    "deepseek-v3",
    "deepseek-v2",
    "qwen3-kv1",
    "kimi-linear",
    "bamba-g1",
    "qwen3-next-k1",
}


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_tp2_gloo_matches_tp1_and_transformers(name: str, gloo_results: dict[str, Any]) -> None:
    result = gloo_results["results"][name]
    assert result["ok"], result
    assert result["max_abs_diff"] < 1e-4, result
    assert result["transformers"].startswith("MATCH"), result
    tp, tp1 = result["state_bytes"], result["state_bytes_tp1"]
    if name in ENCODER_RUNS:  # one encoder pass: every block compared, no persistent state
        assert result["blocks"] >= 3 and not result["tokens_equal"], result
        assert tp == tp1 == 0, result
        return
    assert result["tokens_equal"] and result["blocks"] == 0, result
    if name in ("kimi-linear", "bamba-g1", "qwen3-next-k1"):  # partly replicated
        assert tp1 // 2 < tp < tp1, result
    elif name in _STATE_NOT_HALVED:
        assert tp == tp1, result
    else:  # the pools are sized from the per-rank specs
        assert 2 * tp == tp1, result


def test_tp_check_exit_status_and_report(gloo_results: dict[str, Any]) -> None:
    proc = gloo_results["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("tp_check ")]
    assert len(lines) == len(TP_FAMILIES), proc.stdout
    assert all("tp=2 vs tp=1" in ln and ln.endswith("-> OK") for ln in lines), proc.stdout
    encoders = [ln for ln in lines if "(encoder)" in ln]
    assert len(encoders) == len([n for n in TP_FAMILIES if n in ENCODER_RUNS]), proc.stdout


def test_heads_that_do_not_split_name_the_family_field_and_sizes() -> None:
    from attn_core.e2e.configs import tiny_config
    from attn_core.models import specs_from_hf_config

    cfg = {**tiny_config("qwen3"), "num_attention_heads": 6, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"^qwen3 \(qwen3\): num_key_value_heads=3 .*tp_size=2"):
        specs_from_hf_config(cfg, tp_size=2)
    with pytest.raises(ValueError, match=r"^qwen3-next \(qwen3_next\): .*=16 .*tp_size=3"):
        specs_from_hf_config("qwen3-next", tp_size=3)
    # a model type only the generic dense mapping reads: its heads do not split, it is not
    # "unsupported" (that was the message, with the split error buried in front of it)
    import transformers

    arcee = transformers.ArceeConfig(
        num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, vocab_size=256,
    ).to_dict()  # fmt: skip
    with pytest.raises(ValueError, match=r"^dense \(arcee\): num_key_value_heads=3 .*=2;") as e:
        specs_from_hf_config(arcee, tp_size=2)
    assert "not supported" not in str(e.value)


def test_encoder_heads_that_do_not_split_name_the_tower_field_and_sizes() -> None:
    from attn_core.e2e.configs import run_stack, tiny_config
    from attn_core.models import specs_from_hf_config

    for name, field in (
        ("siglip-vision", "num_attention_heads"),
        ("qwen2-vl-vision", "num_heads"),
        ("qwen2.5-vl-vision", "num_heads"),
        ("whisper-encoder", "encoder_attention_heads"),
    ):
        cfg = tiny_config(name)
        stack = run_stack(name, cfg)  # Whisper: its encoder stack
        assert specs_from_hf_config(cfg, tp_size=2, stack=stack).layer_specs[0].num_heads == 2
        with pytest.raises(ValueError, match=rf"{field}=4 is not divisible by tp_size=3"):
            specs_from_hf_config(cfg, tp_size=3, stack=stack)


@pytest.mark.parametrize("name", ENCODER_MODELS)
def test_shard_model_keeps_the_ranks_encoder_heads_and_the_whole_output_bias(name: str) -> None:
    """Rank 1 of 2 keeps heads 2, 3 of every q / k / v (each third of Qwen-VL's fused qkv)
    with their biases and the same input columns of the output projection, whose bias stays
    whole (added once after the all-reduce)."""
    from attn_core.e2e.configs import build_tiny
    from attn_core.e2e.tp_shard import AllReduceLinear, _encoder_attentions, shard_model

    full, model = build_tiny(name, tp_size=1), build_tiny(name, tp_size=2)  # same seed
    shard_model(model, 1, 2)
    for before, after in zip(_encoder_attentions(full), _encoder_attentions(model), strict=True):
        D = before.head_dim
        width = before.num_heads * D
        mine = torch.arange(2 * D, 4 * D)  # heads 2, 3 of 4
        assert after.num_heads == 2 and after.head_dim == D
        if hasattr(before, "qkv"):
            rows = torch.cat([mine + j * width for j in range(3)])
            pairs = [(before.qkv, after.qkv, rows)]
            out_before, out_after = before.proj, after.proj
        else:
            names = ("q_proj", "k_proj", "v_proj")
            pairs = [(getattr(before, n), getattr(after, n), mine) for n in names]
            out_before, out_after = before.out_proj, after.out_proj
        for b, a, rows in pairs:
            assert torch.equal(a.weight, b.weight[rows])
            assert (a.bias is None) == (b.bias is None)  # Whisper's k_proj has none
            if b.bias is not None:
                assert torch.equal(a.bias, b.bias[rows])
        assert isinstance(out_after, AllReduceLinear)
        assert torch.equal(out_after.weight, out_before.weight[:, mine])
        assert torch.equal(out_after.bias, out_before.bias)


def test_shard_model_refuses_a_layout_of_another_tp_size() -> None:
    from attn_core.e2e.configs import build_tiny
    from attn_core.e2e.tp_shard import shard_model

    model = build_tiny("qwen3", tp_size=1)  # heads per rank of TP=1: sharding would halve them
    with pytest.raises(ValueError, match=r"qwen3: the layout is for tp 1, sharding for 2"):
        shard_model(model, 0, 2)


@pytest.mark.parametrize(
    ("cls_name", "module"),
    [("GPT2Config", "GPT2Attention"), ("GPTBigCodeConfig", "GPTBigCodeAttention")],
)
def test_shard_model_refuses_an_attention_it_cannot_split_by_name(
    cls_name: str, module: str
) -> None:
    """GPT-2's fused Conv1D ``c_attn`` (and GPT-BigCode's) has no sharding: the refusal names
    the layer and the module, not an AttributeError from inside the sharder."""
    import transformers

    from attn_core.e2e.configs import build_tiny
    from attn_core.e2e.tp_shard import shard_model

    cfg = getattr(transformers, cls_name)(
        n_embd=64, n_head=4, n_layer=1, vocab_size=256, n_positions=64
    ).to_dict()
    model = build_tiny("dense", tp_size=2, config=cfg)
    with pytest.raises(ValueError, match=rf"layer 0 \({module}\): no tensor-parallel sharding"):
        shard_model(model, 0, 2)


def test_head_indices_split_and_replicate() -> None:
    from attn_core.e2e.tp_shard import head_indices

    # q (4 heads of 2) | k (1 head of 2): q split, k replicated on both ranks
    assert head_indices([(8, 4), (2, 1)], 1, 2, where="w").tolist() == [4, 5, 6, 7, 8, 9]
    assert head_indices([(8, 2)], 3, 4, where="w").tolist() == [4, 5, 6, 7]  # 2 heads, 4 ranks
    with pytest.raises(ValueError, match=r"^layer 0 k: 3 heads do not split over tp 2"):
        head_indices([(6, 3)], 0, 2, where="layer 0 k")
    with pytest.raises(ValueError, match=r"2 heads are fewer than tp 3"):
        head_indices([(4, 2)], 0, 3, where="w")


def test_tp_check_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    from attn_core.e2e.tp_check import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen3,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_nccl_matches_tp1() -> None:
    proc = _torchrun("--device", "cuda", "--model", "all")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("tp_check ")]
    assert len(lines) == len(TP_FAMILIES) and all(ln.endswith("-> OK") for ln in lines)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_nccl_kernel_shapes_through_the_plugins_match_transformers() -> None:
    """bf16 at the head dims the GPU kernels serve, backends from the installed plugins: every
    family's TP=2 run against transformers (TP=1 is reported, not required: see check_family)."""
    proc = _torchrun(
        "--device", "cuda", "--model", "all", "--dtype", "bfloat16", "--shapes", "kernel",
        "--plugins", timeout=500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("tp_check ")]
    assert len(lines) == len(TP_FAMILIES) and all(ln.endswith("-> OK") for ln in lines)
