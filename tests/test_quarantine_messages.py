"""A quarantined plugin is named wherever its backend is asked for, and explain / run / bench warn
of it.

The paths that ask for a backend by name: ``--backends`` / ``ATTN_CORE_BACKENDS`` / ``force``
(Registry.resolve), the allow list, and the conformance kit's ``--attn-backend``. ``attn explain``,
``attn run`` and ``attn bench`` print one warning line per quarantined plugin on stderr;
``--json`` keeps stdout JSON and lists them in it.
"""

from __future__ import annotations

import json

import pytest

from attn_core import cli
from attn_core.errors import SelectionError
from attn_core.models import specs_from_hf_config
from attn_core.selector import select
from attn_core.specs import DeviceCapabilities, ExecutionConstraints
from attn_core.testing.session import KitError, build_session

REASON = "attn_core_register_backends raised RuntimeError: GPU driver too old"
ACME_WARNING = (
    "warning: plugin 'acme' (distribution attn-plugin-acme) is quarantined (stage register): "
    f"{REASON}; none of its backends can be chosen (attn list shows why)"
)


@pytest.fixture
def world(ref_registry, make_plugin, make_caps):
    """The reference, plus ``acme`` (its register hook raises) and ``old`` (API 0.9)."""

    def register(register):
        raise RuntimeError("GPU driver too old")

    reg = ref_registry
    reg.strict = False
    reg.register_plugin(
        make_plugin("acme", register=register), name="acme", distribution="attn-plugin-acme"
    )
    reg.register_plugin(make_plugin("old", api="0.9"), name="old")
    assert sorted(reg.quarantined) == ["acme", "old"]
    return reg


@pytest.fixture
def use(world, monkeypatch):
    monkeypatch.setattr(cli, "_registry", lambda args: world)
    return world


def _warnings(err: str, command: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"attn {command}: warning:")]


def test_explain_warns_once_per_quarantined_plugin_on_stderr(use, capsys):
    assert cli.main(["explain", "qwen3", "--target", "cpu"]) == 0
    out, err = capsys.readouterr()
    lines = _warnings(err, "explain")
    assert lines[0] == f"attn explain: {ACME_WARNING}"
    assert lines[1].startswith("attn explain: warning: plugin 'old' is quarantined (stage api-")
    assert len(lines) == 2 and err.count("\n") == 2  # one line each, nothing else
    assert "quarantined" not in out and "attn_core:reference" in out


def test_explain_json_keeps_stdout_json_and_lists_the_quarantined(use, capsys):
    assert cli.main(["explain", "qwen3", "--target", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    payload = json.loads(out)
    assert [q["plugin"] for q in payload["quarantined"]] == ["acme", "old"]
    assert payload["quarantined"][0] == {
        "plugin": "acme",
        "distribution": "attn-plugin-acme",
        "stage": "register",
        "reason": REASON,
    }
    assert len(_warnings(err, "explain")) == 2


def test_explain_without_quarantine_prints_no_warning(ref_registry, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_registry", lambda args: ref_registry)
    assert cli.main(["explain", "qwen3", "--target", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["quarantined"] == []


def test_run_warns_before_it_runs(use, capsys, monkeypatch):
    import attn_core.e2e

    class Report:
        ok = True

        def format(self):
            return "report"

        def format_tail(self):
            return "1/1 architectures match transformers"

    ran = []
    monkeypatch.setattr(attn_core.e2e, "run_main", lambda *a, **kw: ran.append(a) or Report())
    assert cli.main(["run", "--model", "qwen3", "--device", "cpu", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    # the head line, then each model as it ends (the stand-in reports none), then the tally
    assert ran and out.splitlines() == [
        "attn run --model qwen3  (device cpu, dtype float32)",
        "1/1 architectures match transformers",
    ]
    assert _warnings(err, "run")[0] == f"attn run: {ACME_WARNING}"
    assert len(_warnings(err, "run")) == 2


def test_forcing_a_quarantined_backend_names_the_quarantine(use, capsys):
    rc = cli.main(["explain", "qwen3", "--target", "cpu", "--backends", "full=acme:naive"])
    _, err = capsys.readouterr()
    assert rc == 2
    (error,) = [line for line in err.splitlines() if line.startswith("attn explain: error:")]
    assert error == (
        "attn explain: error: no backend named 'acme:naive' is registered: plugin 'acme' is "
        f"quarantined: {REASON} (stage register)"
    )


def test_an_allow_list_of_a_quarantined_backend_names_the_quarantine(world):
    groups = specs_from_hf_config("qwen3", dtype="float32").groups
    cpu = DeviceCapabilities.target("cpu")
    with pytest.raises(SelectionError) as info:
        select(groups, world, cpu, ExecutionConstraints(allow={"acme:naive"}))
    message = str(info.value)
    assert "[not_allowed]" in message
    assert message.splitlines()[-1] == (
        "  allow list entry 'acme:naive': no backend named 'acme:naive' is registered: plugin "
        f"'acme' is quarantined: {REASON} (stage register)"
    )
    # an entry that names nothing at all says so too
    with pytest.raises(SelectionError, match=r"allow list entry 'nobody': no backend"):
        select(groups, world, cpu, ExecutionConstraints(allow={"nobody"}))
    # an allow list that admits a backend is not second-guessed
    plan = select(groups, world, cpu, ExecutionConstraints(allow={"acme:naive", "reference"}))
    assert {c.backend.qualified_name for c in plan.choices} == {"attn_core:reference"}


def test_the_kit_names_the_quarantine_once(world):
    with pytest.raises(KitError) as info:
        build_session(backend_name="acme:naive", registry=world, device="cpu")
    message = str(info.value)
    assert message == (
        "--attn-backend=acme:naive: no backend named 'acme:naive' is registered: plugin 'acme' "
        f"is quarantined: {REASON} (stage register)"
    )


def test_the_kit_lists_the_quarantined_for_a_name_it_cannot_place(world):
    with pytest.raises(KitError) as info:
        build_session(backend_name="naive", registry=world, device="cpu")
    message = str(info.value)
    assert "no backend named 'naive' is registered" in message
    assert f"quarantined plugins: acme (register): {REASON}; old (api-version): " in message


BENCH = ["bench", "--model", "qwen3", "--device", "cpu", "--batch", "1", "--context", "8"]


def test_bench_warns_and_forcing_a_quarantined_backend_names_the_quarantine(use, capsys):
    """bench times every admissible backend: a plugin missing from its table is said, and a
    forced backend of that plugin fails naming the quarantine, before anything is timed."""
    rc = cli.main([*BENCH, "--iters", "1", "--backends", "full=acme:naive"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert _warnings(err, "bench")[0] == f"attn bench: {ACME_WARNING}"
    (error,) = [line for line in err.splitlines() if line.startswith("attn bench: error:")]
    assert error == (
        "attn bench: error: no backend named 'acme:naive' is registered: plugin 'acme' is "
        f"quarantined: {REASON} (stage register)"
    )


def test_run_with_a_forced_quarantined_backend_names_the_quarantine(use, capsys):
    """Through the real runner (not a stand-in): the plan it makes for the model fails."""
    argv = ["run", "--model", "qwen3", "--device", "cpu", "--no-progress", "--prompts", "1"]
    rc = cli.main([*argv, "--max-new-tokens", "1", "--backends", "full=acme:naive"])
    _, err = capsys.readouterr()
    assert rc == 2
    (error,) = [line for line in err.splitlines() if line.startswith("attn run: error:")]
    assert error == (
        "attn run: error: no backend named 'acme:naive' is registered: plugin 'acme' is "
        f"quarantined: {REASON} (stage register)"
    )
