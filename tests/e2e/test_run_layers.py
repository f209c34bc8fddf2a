"""``attn run --layers N``: real hidden size and head layout, only the first N layers (issue 22,
item 7), and the overhead ratio line (``--overhead``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attn_core.e2e.configs import first_layers, real_size_config, tiny_config
from attn_core.models import SAMPLE_STACKS, load_sample, sample_names, specs_from_hf_config

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sample_names())
@pytest.mark.parametrize("n", [1, 2, 5])
def test_first_layers_keep_each_samples_layer_pattern(name: str, n: int) -> None:
    # every stack of a multi-stack sample is cut (the whole Whisper sample: its encoder)
    stack = SAMPLE_STACKS[name][1] if name in SAMPLE_STACKS else None
    stack = "encoder" if name == "whisper" else stack
    full = specs_from_hf_config(load_sample(name), stack=stack)
    cut = specs_from_hf_config(first_layers(load_sample(name), n), stack=stack)
    assert [s.stack for s in cut.stacks] == [s.stack for s in full.stacks]
    for full_stack, cut_stack in zip(full.stacks or (full,), cut.stacks or (cut,), strict=True):
        assert cut_stack.num_layers == n
        kept = [
            (i, s)
            for i, s in zip(full_stack.layer_indices, full_stack.layer_specs, strict=True)
            if i < n
        ]
        assert list(zip(cut_stack.layer_indices, cut_stack.layer_specs, strict=True)) == kept
        assert cut_stack.encoder_full_attention_layers == tuple(
            i for i in full_stack.encoder_full_attention_layers if i < n
        )


def test_first_layers_cut_per_layer_fields_only() -> None:
    cfg = {**load_sample("gemma-3"), "num_hidden_layers": 2, "eos_token_id": [1, 106]}
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cut = first_layers(cfg, 1)
    assert cut["layer_types"] == ["sliding_attention"] and cut["eos_token_id"] == [1, 106]
    nemotron = first_layers(load_sample("nemotron-h"), 6)
    assert nemotron["hybrid_override_pattern"] == "M-M-M-"
    assert first_layers(load_sample("bamba"), 10)["attn_layer_indices"] == [9]
    kimi = first_layers(load_sample("kimi-linear"), 5)["linear_attn_config"]  # 1-based lists
    assert (kimi["kda_layers"], kimi["full_attn_layers"]) == ([1, 2, 3, 5], [4])
    with pytest.raises(ValueError, match=r"layers=0: expected 1\.\.36"):
        first_layers(load_sample("qwen3"), 0)


def test_real_size_config_keeps_the_sample_sizes() -> None:
    cfg = real_size_config("qwen3")
    sample = load_sample("qwen3")
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert cfg[key] == sample[key]
    assert cfg["vocab_size"] == sample["vocab_size"]


def test_run_first_layers_of_a_config_with_overhead(tmp_path: Path, run_on_cpu) -> None:
    cfg = {**tiny_config("qwen3-next"), "num_hidden_layers": 8}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    report = run_on_cpu(str(path), layers=4, overhead=True)
    assert report.ok, report.format()
    (run,) = report.runs
    groups = {g["group_id"]: g["layers"] for g in run.plan["groups"]}
    assert groups == {"linear": [0, 1, 2], "full": [3]}
    assert run.overhead is not None and run.overhead.ratio > 0
    assert "overhead (eager decode step" in report.format()
    assert "note: first 4 of 8 layers, at the config's real sizes" in report.format()


def test_cli_layers_and_overhead_flags() -> None:
    from attn_core.cli import build_parser

    args = build_parser().parse_args(["run", "--layers", "2", "--overhead"])
    assert args.layers == 2 and args.overhead is True


def test_the_cli_prints_each_model_as_soon_as_it_ends(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of several real-size models takes minutes: each model's report is printed when
    that model ends, not all of them after the last one."""
    from attn_core import cli
    from attn_core.e2e import main as e2e_main

    printed_before: dict[str, str] = {}

    class _Run:
        def __init__(self, name: str) -> None:
            self.name, self.ok = name, True

        def format(self) -> str:
            return f"== report of {self.name}"

    def fake_run(name: str, **_: object) -> _Run:
        printed_before[name] = capsys.readouterr().out
        return _Run(name)

    monkeypatch.setattr(e2e_main, "run_architecture", fake_run)
    assert cli.main(["run", "--model", "qwen3,lfm2", "--no-progress", "--device", "cpu"]) == 0
    assert "== report of qwen3" in printed_before["lfm2"]
    assert "2/2 architectures match transformers" in capsys.readouterr().out


def test_first_layers_of_a_config_that_counts_its_layers_by_their_pattern() -> None:
    """A Nemotron-H config as transformers 5 writes it has layers_block_type and no
    num_hidden_layers (a property of the pattern's length): --layers refused it."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.AutoConfig.for_model(
        "nemotron_h",
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "attention"],
    ).to_dict()
    assert "num_hidden_layers" not in cfg  # the case this test is about
    cut = first_layers(cfg, 3)
    assert cut["layers_block_type"] == cfg["layers_block_type"][:3]
    assert "num_hidden_layers" not in cut
    assert specs_from_hf_config(cut).num_layers == 3
    with pytest.raises(
        ValueError, match=r"layers=7: expected 1..6 \(the config's layers_block_type"
    ):
        first_layers(cfg, 7)
