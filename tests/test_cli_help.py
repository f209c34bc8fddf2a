"""``attn ... --help`` says what the command does: the lists it claims to give are there."""

from __future__ import annotations

import pytest

from attn_core import cli
from attn_core.models import sample_names
from attn_core.specs import TARGETS


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens too: one line per help


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_explain_help_lists_the_samples_and_the_targets(capsys):
    text = _help(capsys, "explain")
    samples = sample_names()
    assert len(samples) >= 8
    assert f"a sample ({', '.join(samples)})" in text
    assert f"--target TARGET {', '.join(sorted(TARGETS))}, or auto" in text


def test_bench_help_says_tuning_data_is_written_only_when_asked(capsys):
    text = _help(capsys)
    assert "time every admissible backend per group (--write-tuning saves the times" in text
    assert "--write-tuning WRITE_TUNING" in _help(capsys, "bench")


def test_run_help_says_which_models_it_takes(capsys):
    text = _help(capsys, "run")
    assert "--model MODEL 'all', an architecture the runner drives, the path of a Hugging " in text
    assert "config.json (or of its folder) of a model type one of them covers" in text
    assert "(a folder with safetensors weights loads them)" in text
    assert "--layers LAYERS" in text and "--warmup, --no-warmup" in text


def test_run_ranks_by_the_tuning_file_its_help_says_it_takes(
    ref_registry, make_plugin, tmp_path, capsys, monkeypatch
):
    """``attn run --tuning FILE`` reaches the runner's selection: with a file that measured the
    reference faster, it serves the group; without the file, the default rule puts the plugin's
    backend first. The variable it goes through is left as it was."""
    import attn_core.e2e
    from attn_core.backend import Backend, BackendCapabilities
    from attn_core.models import specs_from_hf_config
    from attn_core.selector import ENV_TUNING, TuningData, select
    from attn_core.specs import DeviceCapabilities

    caps = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
    ref_registry.register_plugin(
        make_plugin("acme", [Backend(name="naive", capabilities=caps)]), name="acme"
    )
    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    monkeypatch.delenv(ENV_TUNING, raising=False)
    (group,) = specs_from_hf_config("qwen3", dtype="float32").groups
    tuning = TuningData()
    tuning.record("attn_core:reference", group.spec, 1.0)
    tuning.record("acme:naive", group.spec, 9.0)
    path = tmp_path / "tuning.json"
    tuning.save(str(path))
    served: list[str] = []

    class Report:
        ok = True

        def format_tail(self) -> str:
            return ""

    def run_main(model, *, registry, constraints, **kw):  # selects as the runner does
        layout = specs_from_hf_config(model, dtype="float32")
        plan = select(layout.groups, registry, DeviceCapabilities.target("cpu"), constraints)
        served.append(plan.choices[0].backend.qualified_name)
        return Report()

    monkeypatch.setattr(attn_core.e2e, "run_main", run_main)
    argv = ["run", "--model", "qwen3", "--device", "cpu", "--no-progress"]
    assert cli.main([*argv, "--tuning", str(path)]) == 0
    assert cli.main(argv) == 0
    assert served == ["attn_core:reference", "acme:naive"]
    assert ENV_TUNING not in __import__("os").environ
    assert "--tuning TUNING" in _help(capsys, "run")


def test_bench_takes_no_tuning_file(capsys):
    """bench times every admissible backend, whatever their rank: a ``--tuning`` there would be
    read by nothing, so it is not offered (``--write-tuning`` writes one)."""
    text = _help(capsys, "bench")
    assert "--tuning" not in text.replace("--write-tuning", "")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--tuning", "t.json"])
    assert exit_.value.code == 2


def test_every_option_of_every_command_says_what_it_does():
    """A flag listed without a word leaves its meaning and default to guessing."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    bare = [
        f"attn {name} {'/'.join(action.option_strings) or action.dest}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.dest != "help" and not (action.help or "").strip()
    ]
    assert not bare, bare


@pytest.mark.parametrize("command", ["run", "bench"])
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("bogus", "expected a torch device (cpu, cuda, cuda:N), got 'bogus'"),
        ("meta", "expected cpu or cuda[:N], got 'meta'"),
        ("cuda", "'cuda': this machine has no CUDA device"),
    ],
)
def test_a_device_this_machine_does_not_have_is_a_usage_error(
    capsys, monkeypatch, command, device, message
):
    """These ended in tracebacks (a bad name, CUDA on a machine without it), or blamed the
    model's config."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--model", "qwen3", "--device", device])
    assert exit_info.value.code == 2
    assert f"argument --device: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["", ",", " , "])
def test_explain_of_no_model_is_refused_as_run_refuses_it(capsys, model):
    """It printed nothing and exited 0 (--json: [])."""
    assert cli.main(["explain", model, "--target", "h200"]) == 2
    assert f"model={model!r}: expected 'all' or one of" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["{oops", ""], ids=["broken", "empty"])
def test_a_config_file_that_is_not_json_is_named(tmp_path, capsys, content):
    """The parser's own message ("Expecting value: line 1 column 1") named no file."""
    path = tmp_path / "config.json"
    path.write_text(content)
    assert cli.main(["explain", str(path), "--target", "h200"]) == 2
    assert f"{path}: not a JSON config: Expecting" in capsys.readouterr().err


def test_explain_heads_a_group_with_the_page_size_the_plan_keeps_its_kv_in(capsys):
    """--page-size 64 showed 'page size: 64' on the device line and 'page16' (the model's
    default) in the group's header."""
    assert cli.main(["explain", "qwen3", "--target", "h200", "--page-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "page size: 64" in out and "group full: full 32q/8kv d128 bfloat16 page64" in out, out


def test_run_prints_the_selectors_warnings_as_its_own_lines(monkeypatch, capsys):
    """attn run and attn bench printed the selector's warnings as raw UserWarnings, with the
    library's file, line and source line; explain printed them as its own lines."""
    import warnings as _warnings

    from attn_core import cli

    def warn_and_return(args):
        _warnings.warn("deny list entry 'flashinfr' excludes nothing", stacklevel=1)
        _warnings.warn("a library's own warning", DeprecationWarning, stacklevel=1)
        return 0

    parser = cli.build_parser()
    args = parser.parse_args(["run", "--model", "qwen3", "--device", "cpu"])
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: args)
    monkeypatch.setattr(args, "func", warn_and_return)
    with _warnings.catch_warnings():
        _warnings.simplefilter("always")
        assert cli.main(["run"]) == 0
    err = capsys.readouterr().err
    assert "attn run: warning: deny list entry 'flashinfr' excludes nothing\n" in err, err
    assert "UserWarning" not in err, err
    # another category goes to Python's own display (pytest's record here), not our line
    assert "a library's own warning" not in err, err


@pytest.mark.parametrize("flag", ["--allow", "--deny"])
@pytest.mark.parametrize("value", ["", ",", " , "])
def test_a_backend_list_that_names_no_backend_is_a_usage_error(capsys, flag, value):
    """--allow '' (or ',') planned with every backend, as if the flag were absent."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["explain", "qwen3", "--target", "h200", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {value!r} names no backend" in capsys.readouterr().err


def test_bench_help_says_which_models_it_takes(capsys):
    """It said 'as for explain', but bench takes one model, not 'all' or a comma list."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "as for explain" not in text
    assert "one model" in text
    assert cli.main(["bench", "--model", "all"]) == 2


@pytest.mark.parametrize(
    "flag", [["--graph-mode", "full"], ["--max-batch", "4"], ["--max-tokens", "64"]]
)
def test_run_offers_no_constraint_it_would_override(capsys, flag):
    """attn run listed --graph-mode, --max-batch and --max-tokens but planned with --graphs
    and its own sizes: --graph-mode full --downgrade error ran without graphs, quietly."""
    text = _help(capsys, "run")
    assert flag[0] not in text and "--graphs" in text
    with pytest.raises(SystemExit) as info:
        cli.main(["run", *flag])
    assert info.value.code == 2
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
