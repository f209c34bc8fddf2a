"""The ``attn`` command: what ``attn list`` shows and how ``attn explain`` reports bad settings.

The registry is replaced by a test one (``cli._registry``), so nothing depends on the plugins
installed on the machine.
"""

from __future__ import annotations

import json

import pytest

from attn_core import cli


@pytest.fixture
def use_registry(monkeypatch):
    """``use_registry(reg)``: every ``attn`` command of the test runs on ``reg``."""

    def use(reg):
        monkeypatch.setattr(cli, "_registry", lambda args: reg)
        return reg

    return use


def _explain(capsys, *extra: str) -> tuple[int, str, str]:
    rc = cli.main(["explain", "qwen3", "--target", "cpu", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_backends_option_given_twice_names_the_option(capsys, use_registry, ref_registry):
    use_registry(ref_registry)
    rc, _, err = _explain(capsys, "--backends", "full=reference,full=flash")
    assert rc == 2
    assert err.strip() == (
        "attn explain: error: --backends='full=reference,full=flash': 'full' is given twice "
        "('reference' and 'flash'); keep one"
    )


def test_explain_malformed_env_names_the_variable(capsys, use_registry, ref_registry, monkeypatch):
    use_registry(ref_registry)
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full")
    rc, _, err = _explain(capsys)
    assert rc == 2
    assert err.startswith(
        "attn explain: error: ATTN_CORE_BACKENDS='full': entry 'full' has no '='; expected "
        "KIND_OR_GROUP=BACKEND"
    )


def test_explain_backends_option_wins_over_the_variable(
    capsys, use_registry, ref_registry, monkeypatch
):
    use_registry(ref_registry)
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full=nope")
    rc, out, err = _explain(capsys, "--backends", "full=reference")
    assert (rc, err) == (0, "")
    assert "attn_core:reference" in out and "chosen (forced)" in out


def test_list_shows_quarantined_plugins_with_distribution_stage_and_reason(
    capsys, use_registry, ref_registry, make_plugin, monkeypatch
):
    def register(register):
        raise RuntimeError("GPU driver too old")

    reg = use_registry(ref_registry)
    reg.strict = False
    reg.register_plugin(
        make_plugin("acme", register=register), name="acme", distribution="attn-plugin-acme"
    )
    monkeypatch.setenv("COLUMNS", "250")  # one line per table row
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    quarantined = out[out.index("Quarantined plugins (not loaded)") :].splitlines()
    assert [c.strip() for c in quarantined[2].strip("│").split("│")] == [
        "plugin",
        "distribution",
        "stage",
        "reason",
    ]
    assert [c.strip() for c in quarantined[4].strip("│").split("│")] == [
        "acme",
        "attn-plugin-acme",
        "register",
        "attn_core_register_backends raised RuntimeError: GPU driver too old",
    ]


def test_list_prints_backend_notes_and_the_core_fast_launch_line(
    capsys, use_registry, ref_registry, make_plugin, monkeypatch
):
    """A backend's ``notes`` (its version-gated fast paths) follow its status; the core's own
    fast launch (attn_core.fast_launch) gets one line, also under ``--json``."""
    from attn_core import fast_launch
    from attn_core.backend import Backend, BackendCapabilities

    caps = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})

    def register(register):
        register(Backend("noted", caps, notes="fast plan: off (acme 9.9 not tested)"))

    reg = use_registry(ref_registry)
    reg.register_plugin(make_plugin("acme", register=register), name="acme")
    monkeypatch.setenv("COLUMNS", "250")
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "acme:noted" in line)
    assert "available; fast plan: off (acme 9.9 not tested)" in row
    assert f"core: {fast_launch.status()}" in out.splitlines()
    assert cli.main(["list", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["core"] == {"fast_launch": fast_launch.status()}
    (acme,) = [p for p in summary["plugins"] if p["name"] == "acme"]
    assert acme["backends"][0]["notes"] == "fast plan: off (acme 9.9 not tested)"


def _self_check_registry(use_registry, ref_registry, make_plugin):
    """acme:good (its check passes), acme:bad (fails), acme:plain (no check), acme:broken (the
    hook raises) and acme:odd (returns a str, not a SelfCheck); the devices asked are kept."""
    from attn_core.backend import Backend, BackendCapabilities, SelfCheck
    from attn_core.hookspecs import hookimpl

    caps = BackendCapabilities(kinds={"full"}, device_types={"cuda"}, dtypes={"bfloat16"})
    names = ("good", "bad", "plain", "broken", "odd")
    asked: list[object] = []

    def check(backend, device):
        asked.append(device)
        if backend.name == "good":
            return SelfCheck("fast thing: on (self-check passed)")
        if backend.name == "bad":
            return SelfCheck("fast thing: off (differs by 0.5)", ("fast thing: differs by 0.5",))
        if backend.name == "broken":
            raise RuntimeError("kernel image not found")
        if backend.name == "odd":
            return "passed"
        return None

    mod = make_plugin("acme", [Backend(n, caps, notes="fast thing: at first use") for n in names])
    mod.ATTN_CORE_API_VERSION = "1.2"
    mod.attn_core_self_check = hookimpl(check)
    reg = use_registry(ref_registry)
    reg.register_plugin(mod, name="acme")
    return asked


def test_list_self_check_runs_each_backends_checks_and_fails_on_a_failed_one(
    capsys, use_registry, ref_registry, make_plugin, monkeypatch
):
    """``attn list --self-check`` calls every available backend's ``attn_core_self_check`` on
    the current CUDA device, shows the notes it returns, names each failure on stderr (a hook
    that raises or returns something else counts as failed, naming plugin and backend) and
    exits 1; the reference has no check."""
    import torch

    asked = _self_check_registry(use_registry, ref_registry, make_plugin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("COLUMNS", "250")
    assert cli.main(["list", "--self-check"]) == 1
    out, err = capsys.readouterr()
    assert asked == [torch.device("cuda", 0)] * 5
    table = [line for line in out.splitlines() if line.startswith("│") and "acme:" in line]
    rows = {line.split("│")[4].strip().partition(":")[2]: line for line in table}
    assert "available; fast thing: on (self-check passed)" in rows["good"]
    assert "available; fast thing: off (differs by 0.5)" in rows["bad"]
    assert "available; fast thing: at first use" in rows["plain"]
    assert "self-check on cuda:0: acme:bad, acme:broken, acme:good, acme:odd" in out
    failed = [line for line in err.splitlines() if line.startswith("self-check FAILED")]
    assert failed[0] == "self-check FAILED acme:bad: fast thing: differs by 0.5"
    assert failed[1] == (
        "self-check FAILED acme:broken: plugin 'acme', backend 'acme:broken' failed in "
        "attn_core_self_check: RuntimeError: kernel image not found"
    )
    assert failed[2] == (
        "self-check FAILED acme:odd: plugin 'acme', backend 'acme:odd': attn_core_self_check "
        "returned str, expected an attn_core.backend.SelfCheck or None"
    )
    assert len(failed) == 3
    assert cli.main(["list", "--self-check", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["self_check"] == {
        "device": "cuda:0",
        "checked": ["acme:bad", "acme:broken", "acme:good", "acme:odd"],
    }
    (acme,) = [p for p in summary["plugins"] if p["name"] == "acme"]
    by_name = {b["name"]: b for b in acme["backends"]}
    assert by_name["acme:good"]["self_check_failed"] == []
    assert by_name["acme:bad"]["self_check_failed"] == ["fast thing: differs by 0.5"]
    assert "self_check_failed" not in by_name["acme:plain"]


def test_list_self_check_passes_where_every_check_passes(
    capsys, use_registry, ref_registry, make_plugin, monkeypatch
):
    import torch

    from attn_core.backend import Backend, BackendCapabilities, SelfCheck
    from attn_core.hookspecs import hookimpl

    caps = BackendCapabilities(kinds={"full"}, device_types={"cuda"}, dtypes={"bfloat16"})
    mod = make_plugin("acme", [Backend("good", caps)])
    mod.attn_core_self_check = hookimpl(lambda backend: SelfCheck("fast: on (checked)"))
    use_registry(ref_registry).register_plugin(mod, name="acme")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert cli.main(["list", "--self-check"]) == 0
    out, err = capsys.readouterr()
    assert "self-check on cuda:0: acme:good" in out and err == ""


def test_list_self_check_without_a_gpu_is_an_error_that_says_so(
    capsys, use_registry, ref_registry, monkeypatch
):
    import torch

    use_registry(ref_registry)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["list", "--self-check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn list: error: --self-check runs the backends' fast paths")
    assert "torch.cuda.is_available() is False" in err


def test_explain_falcon_h1_shows_both_groups_over_the_same_layers(
    capsys, use_registry, ref_registry
):
    """A parallel hybrid: the linear (Mamba2) and full groups list every layer, and a line says
    that these layers hold both ops (so the counts do not read as a double count)."""
    use_registry(ref_registry)
    assert cli.main(["explain", "falcon-h1", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (
        "parallel ops: 36 layers (layers 0-35) each hold an op of groups 'linear' and 'full'" in out
    )
    assert "group linear: linear mamba2 24q/1kv d128/64" in out
    assert "group full: full 8q/2kv d64" in out
    assert out.count("36 layers: [0, 1, 2,") == 2
    assert cli.main(["explain", "falcon-h1", "--target", "cpu", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["parallel_layers"] == list(range(36))
    layers = {g["group_id"]: g["layers"] for g in payload["groups"]}
    assert layers == {"linear": list(range(36)), "full": list(range(36))}


def _explain_model(capsys, model: str, *extra: str) -> tuple[int, str, str]:
    rc = cli.main(["explain", model, "--target", "cpu", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_a_multimodal_config_shows_every_stack(capsys, use_registry, ref_registry):
    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, "qwen2.5-vl")
    assert (rc, err) == (0, "")
    assert out.startswith(
        "model: qwen2.5-vl (Qwen2_5_VLForConditionalGeneration, stacks vision (32 layers), "
        "text (28 layers), tp=1)"
    )
    assert "group vision.encoder: encoder 16q/16kv d80" in out
    assert "group text.full: full 28q/4kv d128" in out
    rc, out, _ = _explain_model(capsys, "qwen2.5-vl", "--json")
    payload = json.loads(out)
    assert payload["stacks"] == {"vision": ["vision.encoder"], "text": ["text.full"]}
    assert [g["group_id"] for g in payload["groups"]] == ["vision.encoder", "text.full"]
    # a group of one stack can be forced by its id
    rc, out, err = _explain_model(capsys, "qwen2.5-vl", "--backends", "text.full=reference")
    assert (rc, err) == (0, "") and "chosen (forced)" in out


@pytest.mark.parametrize(
    ("cls", "head", "groups"),
    [
        (
            "Qwen3VLConfig",
            "Qwen3VLForConditionalGeneration, stacks vision (27 layers), text (32 layers)",
            {"vision.encoder": "encoder 16q/16kv d72", "text.full": "full 32q/32kv d128"},
        ),
        (
            "Qwen3VLMoeConfig",
            "Qwen3VLMoeForConditionalGeneration, stacks vision (27 layers), text (24 layers)",
            {"vision.encoder": "encoder 16q/16kv d72", "text.full": "full 16q/16kv d128"},
        ),
        (
            "Qwen3_5Config",
            "Qwen3_5ForConditionalGeneration, stacks vision (27 layers), text (32 layers)",
            {
                "vision.encoder": "encoder 16q/16kv d72",
                "text.linear": "linear gated_deltanet 32q/16kv d128",
                "text.full": "full 16q/4kv d256",
            },
        ),
        (
            "Qwen3_5MoeConfig",
            "Qwen3_5MoeForConditionalGeneration, stacks vision (27 layers), text (40 layers)",
            {
                "vision.encoder": "encoder 16q/16kv d72",
                "text.linear": "linear gated_deltanet 32q/16kv d128",
                "text.full": "full 16q/2kv d256",
            },
        ),
    ],
)
def test_explain_qwen3_vl_and_qwen3_5_show_both_stacks(
    capsys, use_registry, ref_registry, tmp_path, cls, head, groups
):
    """transformers' default configs of the four model types: the tower's and the language
    model's groups, at the sizes its config classes give."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(getattr(transformers, cls)().to_dict()))
    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, str(path))
    assert (rc, err) == (0, "")
    assert out.startswith(f"model: {path} ({head}, tp=1)")
    for group, spec in groups.items():
        assert f"group {group}: {spec}" in out
    rc, out, _ = _explain_model(capsys, str(path), "--json")
    text = [g for g in groups if g.startswith("text.")]
    assert json.loads(out)["stacks"] == {"vision": ["vision.encoder"], "text": text}


def test_explain_one_stack(capsys, use_registry, ref_registry):
    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, "qwen2.5-vl", "--stack", "text")
    assert (rc, err) == (0, "")
    assert out.startswith("model: qwen2.5-vl (Qwen2_5_VLForConditionalGeneration, 28 layers, ")
    assert "stack text" in out.splitlines()[0]
    assert "group text.full" in out and "vision.encoder" not in out


def test_explain_whisper_refuses_the_decoder_unless_the_encoder_is_asked(
    capsys, use_registry, ref_registry
):
    use_registry(ref_registry)
    rc, _, err = _explain_model(capsys, "whisper")
    assert rc == 2
    assert err.strip() == (
        "attn explain: error: whisper: cross-attention in decoder layers 0-31: no layer kind; "
        "the encoder maps alone: stack='encoder' (the sample 'whisper-encoder', `--stack "
        "encoder`); refused, not mapped in part"
    )
    for args in (("whisper", "--stack", "encoder"), ("whisper-encoder",)):
        rc, out, err = _explain_model(capsys, *args)
        assert (rc, err) == (0, ""), err
        assert "group encoder.encoder: encoder 20q/20kv d64 float16 bidirectional" in out


def test_explain_all_plans_every_architecture_run_drives(capsys, use_registry, ref_registry):
    """``attn explain all`` takes ``attn run``'s ``all``: one plan per architecture the runner
    drives, each headed by its name, nothing refused."""
    from attn_core.e2e.configs import ARCHITECTURES

    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, "all")
    assert (rc, err) == (0, "")
    heads = [line.split(" (")[0] for line in out.splitlines() if line.startswith("model: ")]
    assert heads == [f"model: {name}" for name in ARCHITECTURES]


def test_explain_a_comma_list_with_run_aliases_gives_one_json_plan_each(
    capsys, use_registry, ref_registry
):
    """A comma list, with run's spelling of a name (``qwen3_next``), as JSON: a list of the
    plans in the order given, each saying which input it answers."""
    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, "qwen3,qwen3_next", "--json")
    assert (rc, err) == (0, "")
    payloads = json.loads(out)
    assert [p["input"] for p in payloads] == ["qwen3", "qwen3-next"]
    assert [p["model"] for p in payloads] == ["Qwen3ForCausalLM", "Qwen3NextForCausalLM"]
    assert {g["group_id"] for g in payloads[1]["groups"]} == {"linear", "full"}


def test_explain_a_list_goes_on_past_a_refused_model_and_exits_2(
    capsys, use_registry, ref_registry
):
    """One refused model of a list: the others are still planned, the refusal is named on
    stderr (and in the JSON), and the exit status says that not every model was planned."""
    use_registry(ref_registry)
    rc, out, err = _explain_model(capsys, "qwen3,whisper")
    assert rc == 2
    assert out.startswith("model: qwen3 (Qwen3ForCausalLM, ")
    assert "attn explain: error: whisper: cross-attention in decoder layers 0-31" in err
    assert err.strip().endswith("attn explain: 1 of 2 models not planned: whisper")
    rc, out, _ = _explain_model(capsys, "qwen3,whisper", "--json")
    assert rc == 2
    first, second = json.loads(out)
    assert first["input"] == "qwen3" and first["groups"]
    assert second["input"] == "whisper" and "cross-attention" in second["error"]


def test_explain_accepts_what_run_accepts(capsys, use_registry, ref_registry, tmp_path):
    """Every input form ``attn run --model`` resolves (``all``, aliases, comma lists, a
    config.json and its folder) is one ``attn explain`` plans."""
    from attn_core.e2e.main import resolve_models
    from attn_core.models import load_sample

    use_registry(ref_registry)
    (tmp_path / "config.json").write_text(json.dumps(load_sample("qwen3")))
    for model in ("all", "qwen3_next,falcon_h1", str(tmp_path), str(tmp_path / "config.json")):
        assert resolve_models(model), model
        rc, out, err = _explain_model(capsys, model)
        assert (rc, err) == (0, ""), (model, err)
        assert out.startswith("model: "), model
