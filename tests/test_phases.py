"""Per-phase plans: a backend per layer group and phase (prefill / mixed, decode, verify).

The plugins are inline stand-ins planned offline for a named H200 (none runs code):

=========== ========== ================================================== =================
plugin      backend    serves                                             priority
=========== ========== ================================================== =================
attn_core   reference  every kind and phase, any page size                ranked last
fa3         fa3        full, sm90, pages 16/64, every phase               90, decode 60
flashinfer  flashinfer full, sm80+, pages 16/64, every phase              100
=========== ========== ================================================== =================

and, where a test needs them, ``dec64`` (decode only, page size 64 only) and ``prefonly``
(prefill only). The timing tables are stand-ins; the ranking logic they feed is the real one.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest

from attn_core.backend import Backend, BackendCapabilities
from attn_core.errors import SelectionError
from attn_core.registry import Registry
from attn_core.selector import (
    TuningData,
    check_backend,
    phase_mapping_from_plan,
    planned_phases,
    select,
)
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec, Phase, group_layers

H200 = DeviceCapabilities.target("h200")
FULL = LayerSpec(kind="full", num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
GDN = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    head_dim_v=64,
    conv_kernel_size=4,
    conv_channels=1024,
)


def _backend(name: str, priority: int, **caps) -> Backend:
    caps.setdefault("kinds", {"full"})
    caps.setdefault("device_types", {"cuda"})
    caps.setdefault("dtypes", {"bfloat16", "float16"})
    caps.setdefault("page_sizes", {16, 64})
    caps.setdefault("max_speculative_tokens", 8)
    return Backend(name=name, capabilities=BackendCapabilities(**caps), priority=priority)


FA3 = _backend("fa3", 90, min_compute_capability=(9, 0), phase_priority={"decode": 60})
FLASHINFER = _backend("flashinfer", 100, min_compute_capability=(8, 0))


@pytest.fixture
def registry(make_plugin):
    def make(*extra: tuple[str, Backend]) -> Registry:
        import attn_core.reference.plugin as ref

        reg = Registry(strict=True)
        reg.register_plugin(ref, name="attn_core")
        for plugin, backend in (("fa3", FA3), ("flashinfer", FLASHINFER), *extra):
            reg.register_plugin(make_plugin(plugin, [backend]), name=plugin)
        return reg

    return make


def _plan(reg, specs=(FULL,), **kw):
    kw.setdefault("downgrade", "allow")
    return select(group_layers(list(specs)), reg, H200, ExecutionConstraints(**kw))


def _phases(plan, group="full") -> dict[str, str]:
    return dict(phase_mapping_from_plan(plan)[group])


def _explained(plan) -> str:
    """``attn explain``'s text of ``plan`` with the table borders and line breaks gone: a
    cell's text wraps wherever the table's column widths put it."""
    from attn_core.cli import format_plan

    return re.sub(r"[\s│┌┐└┘├┤┬┴┼─]+", " ", format_plan(plan))


def _tuning(times: dict[tuple[str, str, int], float], spec: LayerSpec = FULL) -> TuningData:
    """A stand-in timing table: {(backend, phase, step size): us}; the size is a batch in
    decode / verify and a token count in prefill."""
    t = TuningData(device=H200.short())
    for (backend, phase, size), us in times.items():
        key = {"tokens": size} if phase == "prefill" else {"batch": size}
        t.record(backend, spec, us, phase=phase, **key)
    return t


# ------------------------------------------------------------------------------------------
# Capabilities
# ------------------------------------------------------------------------------------------
def test_phase_capabilities_default_to_every_phase_at_the_backend_priority():
    b = _backend("x", 70)
    assert b.capabilities.phases == frozenset(Phase)
    assert [b.priority_for(p) for p in Phase] == [70, 70, 70]
    assert FA3.priority_for("decode") == 60 and FA3.priority_for(Phase.PREFILL) == 90
    assert FA3.capabilities.phase_priority == ((Phase.DECODE, 60),)


@pytest.mark.parametrize(
    ("caps", "message"),
    [
        ({"phases": set()}, r"phases=set\(\): a backend must serve at least one phase"),
        ({"phases": {"decoding"}}, r"phases: 'decoding' is not one of"),
        ({"phase_priority": {"decod": 1}}, r"phase_priority: 'decod' is not one of"),
        ({"phase_priority": {"decode": "high"}}, r"phase_priority: decode: 'high' is not an int"),
        ({"phase_priority": 5}, r"phase_priority=5: expected a mapping"),
        (
            {"feature_priority": {"sink": {"decode": 1}}},
            r"feature_priority: 'sink' is not a feature",
        ),
        (
            {"feature_priority": {"sinks": {"decod": 1}}},
            r"feature_priority\['sinks'\]: 'decod' is not one of",
        ),
        (
            {"feature_priority": {"sinks": {"decode": 1.5}}},
            r"feature_priority\['sinks'\]: decode: 1.5 is not an int",
        ),
        ({"feature_priority": ["sinks"]}, r"feature_priority=\['sinks'\]: expected a mapping"),
    ],
)
def test_bad_phase_capabilities_name_the_field(caps, message):
    with pytest.raises(ValueError, match=message):
        _backend("x", 0, **caps)


def test_a_backend_that_does_not_serve_a_phase_is_rejected_for_it_with_code_phase():
    prefonly = _backend("prefonly", 200, phases={"prefill"})
    cons = ExecutionConstraints()
    assert check_backend(prefonly, FULL, H200, cons, phase=Phase.PREFILL, local=False) == []
    (r,) = check_backend(prefonly, FULL, H200, cons, phase=Phase.DECODE, local=False)
    assert (r.code, r.reason, r.fix) == ("phase", "serves the prefill phase, not decode", None)


# ------------------------------------------------------------------------------------------
# The default rule per phase
# ------------------------------------------------------------------------------------------
def test_the_plan_chooses_per_phase_by_phase_priority(registry):
    fast_prefill = _backend("pf", 150, min_compute_capability=(9, 0), phase_priority={"decode": 10})
    plan = _plan(registry(("pf", fast_prefill)))
    assert _phases(plan) == {"prefill": "pf:pf", "decode": "flashinfer:flashinfer"}
    choice = plan.choice("full")
    # .backend (and mapping_from_plan) keep meaning the prefill / mixed backend
    assert choice.backend.qualified_name == "pf:pf"
    assert plan.backend_for("full").qualified_name == "pf:pf"
    assert plan.backend_for("full", "decode").qualified_name == "flashinfer:flashinfer"
    decode = choice.phase_choice("decode")
    assert decode.outranked == ("fa3:fa3", "pf:pf", "attn_core:reference")
    assert [b.qualified_name for b in choice.backends] == ["pf:pf", "flashinfer:flashinfer"]


def test_flashinfer_outranks_fa3_at_decode_by_default(registry):
    """The fa3 plugin's own declaration: 90 at prefill, 60 at decode and verify (it is 1.2x-10x
    slower than FlashInfer at decode on the H200)."""
    from attn_plugin_fa3 import plugin as fa3_plugin

    real = fa3_plugin.make_backend(available=True)
    assert real.priority_for("prefill") == 90
    assert real.priority_for("decode") == real.priority_for("verify") == 60  # below 100
    reg = registry()
    plan = _plan(reg, deny={"flashinfer"})
    assert _phases(plan) == {"prefill": "fa3:fa3", "decode": "fa3:fa3"}
    plan = _plan(reg)
    assert _phases(plan)["decode"] == "flashinfer:flashinfer"


def test_verify_is_planned_only_with_speculative_tokens(registry):
    reg = registry()
    assert planned_phases(group_layers([FULL])[0], ExecutionConstraints()) == (
        Phase.PREFILL,
        Phase.DECODE,
    )
    assert set(_phases(_plan(reg))) == {"prefill", "decode"}
    plan = _plan(reg, speculative_tokens=3)
    assert set(_phases(plan)) == {"prefill", "decode", "verify"}
    d = plan.to_dict()
    assert d["phases"] == ["prefill", "decode", "verify"]
    group = d["groups"][0]
    assert set(group["phases"]) == {"prefill", "decode", "verify"}
    assert group["phases"]["prefill"]["backend"] == group["backend"]  # the existing key stays
    assert group["phases"]["decode"]["rejected"] == group["rejected"]
    json.dumps(d)  # JSON-serialisable


def test_an_encoder_group_plans_its_prefill_phase_only(registry):
    enc = LayerSpec(kind="encoder", num_heads=4, num_kv_heads=4, head_dim=64, causal=False)
    plan = _plan(registry(), specs=(enc,))
    assert plan.choice("encoder").planned_phases == (Phase.PREFILL,)
    # the runtime asks for every phase: an unplanned one is the prefill backend
    assert plan.choice("encoder").backend_for_phase("decode").qualified_name == (
        "attn_core:reference"
    )


def test_a_hand_made_choice_serves_every_phase_and_is_allocated_for_them(registry):
    """A GroupChoice without phases (the conformance kit's, a server's own) is served by its one
    backend in every phase: its context must be allocated for the draft tokens and the graph
    mode of the run (it was allocated for prefill only: no native-verify workspace)."""
    from attn_core.selector import GroupChoice, constraints_for_phases

    group = group_layers([FULL])[0]
    choice = GroupChoice(group, FLASHINFER, (), ())
    assert choice.phases_served_by(FLASHINFER.qualified_name) == tuple(Phase)
    assert choice.phases_served_by(FA3.qualified_name) == ()
    cons = ExecutionConstraints(speculative_tokens=3, graph_mode="decode")
    served = constraints_for_phases(cons, choice.phases_served_by(FLASHINFER.qualified_name))
    assert (served.speculative_tokens, served.graph_mode.value) == (3, "decode")


def test_a_phase_only_backend_serves_its_phase_and_is_no_downgrade_elsewhere(registry):
    dec = _backend("deconly", 300, min_compute_capability=(9, 0), phases={"decode"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no downgrade warning for prefill
        plan = _plan(registry(("deconly", dec)), downgrade="warn")
    assert _phases(plan) == {"prefill": "flashinfer:flashinfer", "decode": "deconly:deconly"}
    prefill = plan.choice("full").phase_choice("prefill")
    assert [r.code for r in prefill.rejections_by_backend()["deconly:deconly"]] == ["phase"]
    assert prefill.downgraded_from == ()


def test_every_phase_backend_shares_the_page_size(registry):
    """A backend that serves only page size 64 is rejected for page size 16, and no phase pairs
    it with a backend at another page size."""
    dec64 = _backend("dec64", 300, min_compute_capability=(9, 0), page_sizes={64})
    plan = _plan(registry(("dec64", dec64)))
    assert plan.page_size == 16  # the model's own page size: every group and phase has one
    for p in plan.choice("full").phases:
        assert p.backend.qualified_name != "dec64:dec64"
        codes = [r.code for r in p.rejections_by_backend()["dec64:dec64"]]
        # at 64 the reference serves the other phases: the selector only preferred the model's
        # page size, which the page_size rejection's fix says how to change
        assert codes == ["page_size"]
    plan = _plan(registry(("dec64", dec64)), page_size=64)
    assert set(_phases(plan).values()) == {"dec64:dec64"}


def test_a_faster_phase_backend_that_cannot_share_the_state_says_so(make_plugin):
    """dec64 (decode only, page size 64 only) ranks first for decode, but at page size 64 no
    backend serves prefill (the reference is denied, flashinfer and fa3 serve 16 only): the
    decode phase falls back to flashinfer with a shared_state rejection naming why."""
    dec64 = _backend(
        "dec64", 300, min_compute_capability=(9, 0), page_sizes={64}, phases={"decode"}
    )
    fi16 = _backend("flashinfer", 100, min_compute_capability=(8, 0), page_sizes={16})
    fa16 = _backend("fa3", 90, min_compute_capability=(9, 0), page_sizes={16})
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, b in (("flashinfer", fi16), ("fa3", fa16), ("dec64", dec64)):
        reg.register_plugin(make_plugin(plugin, [b]), name=plugin)
    plan = _plan(reg, deny={"reference"})
    assert plan.page_size == 16
    assert _phases(plan) == {"prefill": "flashinfer:flashinfer", "decode": "flashinfer:flashinfer"}
    decode = plan.choice("full").phase_choice("decode")
    by = decode.rejections_by_backend()["dec64:dec64"]
    assert [r.code for r in by] == ["page_size", "shared_state"]
    shared = by[1]
    assert "ranks above flashinfer:flashinfer for decode but cannot share" in shared.reason
    assert "page_size 16" in shared.reason and "under page_size 64" in shared.reason
    assert "layer group 'full' has no backend for prefill" in shared.reason
    # prefill: dec64 does not serve the phase at all, so nothing about sharing
    prefill = plan.choice("full").phase_choice("prefill")
    assert "shared_state" not in [r.code for r in prefill.rejections_by_backend()["dec64:dec64"]]


def test_a_faster_phase_backend_that_reads_another_kv_layout_says_so(make_plugin):
    """The KV layout branch of the shared-state check: dechnd (decode only, layout HND only)
    ranks first for decode, but under HND no backend serves prefill (the reference is denied,
    flashinfer and fa3 read NHD only): decode stays on flashinfer, and dechnd's shared_state
    rejection names both layouts and the phase that has no backend under its own."""
    dechnd = _backend(
        "dechnd", 300, min_compute_capability=(9, 0), kv_layouts={"HND"}, phases={"decode"}
    )
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, b in (("flashinfer", FLASHINFER), ("fa3", FA3), ("dechnd", dechnd)):
        reg.register_plugin(make_plugin(plugin, [b]), name=plugin)
    plan = _plan(reg, deny={"reference"})
    assert (plan.page_size, plan.kv_layout) == (16, "NHD")
    assert _phases(plan) == {"prefill": "flashinfer:flashinfer", "decode": "flashinfer:flashinfer"}
    decode = plan.choice("full").phase_choice("decode")
    by = decode.rejections_by_backend()["dechnd:dechnd"]
    assert [r.code for r in by] == ["kv_layout", "shared_state"]
    assert "reads KV in layout HND, the run uses NHD" in by[0].reason
    shared = by[1].reason
    assert "ranks above flashinfer:flashinfer for decode but cannot share" in shared
    assert "(page_size 16, kv_layout NHD)" in shared  # what the plan shares
    assert "under page_size 16, kv_layout HND, which it serves" in shared  # what it reads
    assert "layer group 'full' has no backend for prefill" in shared
    prefill = plan.choice("full").phase_choice("prefill")
    assert "shared_state" not in [r.code for r in prefill.rejections_by_backend()["dechnd:dechnd"]]


def test_a_faster_phase_backend_that_stores_another_kv_dtype_says_so(registry):
    """The KV dtype is no setting the selector picks for the shared state: it is the run's (its
    ``kv_dtype``, else the model's), and every phase's backend is held to it. A faster decode
    backend that stores only fp8 KV is rejected for the dtype, naming both; no shared_state
    rejection (no other dtype is tried)."""
    decfp8 = _backend(
        "decfp8", 300, min_compute_capability=(9, 0), kv_dtypes={"fp8_e4m3"}, phases={"decode"}
    )
    plan = _plan(registry(("decfp8", decfp8)))
    assert _phases(plan) == {"prefill": "flashinfer:flashinfer", "decode": "flashinfer:flashinfer"}
    decode = plan.choice("full").phase_choice("decode")
    by = decode.rejections_by_backend()["decfp8:decfp8"]
    assert [r.code for r in by] == ["kv_dtype"]
    assert "stores KV as fp8_e4m3, the run asks for bfloat16" in by[0].reason


def test_the_downgrade_policy_names_the_phase(registry):
    old = _backend("old", 500, max_compute_capability=(8, 9), phases={"decode"})
    _plan(registry(("old", old)), downgrade="error", deny={"old"})  # denied: no downgrade
    with pytest.raises(SelectionError, match=r"falls back to flashinfer:flashinfer in the decode"):
        _plan(registry(("old", old)), downgrade="error")


# ------------------------------------------------------------------------------------------
# Measured ranking per phase
# ------------------------------------------------------------------------------------------
def test_tuning_ranks_each_phase(registry):
    """Measured: fa3 faster at prefill, flashinfer at decode (the default rule would give
    flashinfer both)."""
    tuning = _tuning(
        {
            ("fa3:fa3", "prefill", 1): 100.0,
            ("fa3:fa3", "prefill", 64): 400.0,
            ("flashinfer:flashinfer", "prefill", 1): 120.0,
            ("flashinfer:flashinfer", "prefill", 64): 480.0,
            ("fa3:fa3", "decode", 1): 50.0,
            ("fa3:fa3", "decode", 64): 30.0,
            ("flashinfer:flashinfer", "decode", 1): 5.0,
            ("flashinfer:flashinfer", "decode", 64): 25.0,
        }
    )
    plan = select(
        group_layers([FULL]),
        registry(),
        H200,
        ExecutionConstraints(downgrade="allow"),
        tuning=tuning,
    )
    assert _phases(plan) == {"prefill": "fa3:fa3", "decode": "flashinfer:flashinfer"}
    choice = plan.choice("full")
    assert choice.tuned_us == pytest.approx(200.0)  # geometric mean of 100 and 400
    assert choice.phase_choice("decode").tuned_us == pytest.approx((5.0 * 25.0) ** 0.5)
    assert choice.phase_choice("decode").outranked == ("fa3:fa3", "attn_core:reference")


def test_tuning_compares_the_buckets_every_candidate_has_within_the_batch_limit(registry):
    """fa3 was also measured at 256 requests (slow there); flashinfer was not. Ranked on the
    shared buckets (1 and 64), fa3 wins; 256 counts for neither."""
    times = {
        ("fa3:fa3", "decode", 1): 10.0,
        ("fa3:fa3", "decode", 64): 10.0,
        ("fa3:fa3", "decode", 256): 10_000.0,
        ("flashinfer:flashinfer", "decode", 1): 20.0,
        ("flashinfer:flashinfer", "decode", 64): 20.0,
    }
    plan = select(
        group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=_tuning(times)
    )
    assert _phases(plan)["decode"] == "fa3:fa3"
    assert plan.choice("full").phase_choice("decode").tuned_us == pytest.approx(10.0)
    # a plan of at most 8 requests per step can hit only the bucket of 1
    times[("fa3:fa3", "decode", 1)] = 30.0
    plan = select(
        group_layers([FULL]),
        registry(),
        H200,
        ExecutionConstraints(max_batch_size=8),
        tuning=_tuning(times),
    )
    assert _phases(plan)["decode"] == "flashinfer:flashinfer"


def test_forced_phase_overrides_win_over_tuning(registry):
    tuning = _tuning(
        {
            ("fa3:fa3", "prefill", 8): 10.0,
            ("flashinfer:flashinfer", "prefill", 8): 20.0,
            ("fa3:fa3", "decode", 8): 50.0,
            ("flashinfer:flashinfer", "decode", 8): 5.0,
        }
    )
    reg = registry()

    def phases(force, **kw):
        cons = ExecutionConstraints(force=force, downgrade="allow", **kw)
        return _phases(select(group_layers([FULL]), reg, H200, cons, tuning=tuning))

    assert phases({}) == {"prefill": "fa3:fa3", "decode": "flashinfer:flashinfer"}
    assert phases({"decode:full": "fa3"}) == {"prefill": "fa3:fa3", "decode": "fa3:fa3"}
    assert phases("prefill:full=flashinfer") == {
        "prefill": "flashinfer:flashinfer",
        "decode": "flashinfer:flashinfer",
    }
    # a bare phase: that phase of every group
    assert phases({"decode": "fa3"})["decode"] == "fa3:fa3"
    # an old key: every phase; a phase-qualified key wins over it
    assert phases({"full": "flashinfer"}) == {
        "prefill": "flashinfer:flashinfer",
        "decode": "flashinfer:flashinfer",
    }
    assert phases({"full": "flashinfer", "decode:full": "fa3"}) == {
        "prefill": "flashinfer:flashinfer",
        "decode": "fa3:fa3",
    }
    got = phases({"verify:full": "fa3"}, speculative_tokens=2)
    assert got["verify"] == "fa3:fa3"
    plan = select(
        group_layers([FULL]), reg, H200, ExecutionConstraints(force={"decode:full": "fa3"})
    )
    choice = plan.choice("full")
    assert choice.phase_choice("decode").forced and not choice.forced
    codes = [
        r.code
        for r in choice.phase_choice("decode").rejections_by_backend()["flashinfer:flashinfer"]
    ]
    assert codes == ["not_forced"]


def test_forced_phase_keys_from_the_environment(registry, monkeypatch):
    reg = registry()
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "decode:full=fa3,prefill=flashinfer")
    plan = _plan(reg)
    assert _phases(plan) == {"prefill": "flashinfer:flashinfer", "decode": "fa3:fa3"}
    # an explicit entry wins over the variable's for the same key
    plan = _plan(reg, force={"decode:full": "flashinfer"})
    assert _phases(plan)["decode"] == "flashinfer:flashinfer"


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("decod:full=fa3", "has 'decod' before ':', which is not a phase"),
        ("decode:ful=fa3", "names 'ful' after 'decode:': no layer kind and no group"),
        ("prefil=fa3", "names no layer kind and no group of this model, and no phase"),
    ],
)
def test_malformed_phase_entries_name_the_entry(registry, monkeypatch, entry, problem):
    reg = registry()
    monkeypatch.setenv("ATTN_CORE_BACKENDS", entry)
    with pytest.raises(SelectionError) as info:
        _plan(reg)
    assert str(info.value).startswith(f"ATTN_CORE_BACKENDS={entry!r}: entry '{entry}' {problem}")
    monkeypatch.delenv("ATTN_CORE_BACKENDS")
    with pytest.raises(SelectionError) as info:
        _plan(reg, force=entry)
    assert f"'{entry}' {problem}" in str(info.value)


def test_a_forced_phase_backend_that_cannot_serve_is_an_error_naming_the_phase(registry):
    prefonly = _backend("prefonly", 10, phases={"prefill"})
    with pytest.raises(SelectionError) as info:
        _plan(registry(("prefonly", prefonly)), force="decode:full=prefonly")
    msg = str(info.value)
    assert msg.startswith(
        "forced backend 'prefonly' cannot serve layer group 'full' in the decode phase"
    )
    assert "[phase] serves the prefill phase, not decode" in msg


def test_a_phase_key_forces_every_group_strictly(registry, make_plugin):
    """'decode=flashinfer' on a hybrid model forces the linear group's decode too: an error,
    never a silent skip; 'decode:full=...' is the way to force one kind."""
    reg = registry()
    with pytest.raises(SelectionError, match=r"forced backend 'flashinfer'.*group 'linear' in the"):
        _plan(reg, specs=(GDN, FULL), force="decode=flashinfer")
    plan = _plan(reg, specs=(GDN, FULL), force="decode:full=fa3")
    assert _phases(plan, "full")["decode"] == "fa3:fa3"


# ------------------------------------------------------------------------------------------
# The tuning file
# ------------------------------------------------------------------------------------------
def test_tuning_file_format_3_round_trip(tmp_path):
    t = _tuning({("fa3:fa3", "decode", 1): 5.0, ("fa3:fa3", "prefill", 4096): 7.5})
    t.record("flashinfer:flashinfer", FULL, 3.0)  # every phase, every step size
    path = tmp_path / "tuning.json"
    t.save(path)
    payload = json.loads(path.read_text())
    assert payload["format"] == 3
    # prefill is bucketed by query tokens per step, decode by requests
    assert {
        (e["backend"], e["phase"], e.get("batch"), e.get("tokens")) for e in payload["entries"]
    } == {
        ("fa3:fa3", "decode", 1, None),
        ("fa3:fa3", "prefill", None, 4096),
        ("flashinfer:flashinfer", None, None, None),
    }
    back = TuningData.load(path)
    assert back.times_us == t.times_us and back.device == H200.short()
    assert back.time("fa3:fa3", FULL, Phase.DECODE) == 5.0
    assert back.time("fa3:fa3", FULL, Phase.VERIFY) is None
    assert back.time("flashinfer:flashinfer", FULL, Phase.VERIFY) == 3.0


def test_recording_prefill_by_requests_or_decode_by_tokens_is_refused():
    t = TuningData()
    with pytest.raises(ValueError, match=r"fa3:fa3 prefill: steps are bucketed by tokens.*batch=4"):
        t.record("fa3:fa3", FULL, 1.0, phase="prefill", batch=4)
    with pytest.raises(ValueError, match=r"decode: steps are bucketed by requests.*tokens=64"):
        t.record("fa3:fa3", FULL, 1.0, phase="decode", tokens=64)


def test_a_format_2_file_keeps_its_prefill_times_without_buckets(tmp_path):
    """Format 2 bucketed prefill by requests per step: read as one size-less time per backend
    (the geometric mean), so it ranks prefill but never switches it by a wrong unit."""
    from attn_core.selector import spec_key

    spec = json.loads(spec_key(FULL))
    entries = [
        {"backend": "fa3:fa3", "spec": spec, "phase": "prefill", "batch": 1, "us": 4.0},
        {"backend": "fa3:fa3", "spec": spec, "phase": "prefill", "batch": 16, "us": 9.0},
        {"backend": "fa3:fa3", "spec": spec, "phase": "decode", "batch": 16, "us": 2.0},
    ]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({"format": 2, "device": "h200", "entries": entries}))
    t = TuningData.load(path)
    assert t.points("fa3:fa3", FULL, Phase.PREFILL) == {None: pytest.approx(6.0)}
    assert t.points("fa3:fa3", FULL, Phase.DECODE) == {16: 2.0}


def test_tuning_file_format_1_still_reads_for_every_phase(tmp_path, registry):
    from attn_core.selector import spec_key

    path = tmp_path / "v1.json"
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "device": "h200",
                "entries": [
                    {"backend": "fa3:fa3", "spec": json.loads(spec_key(FULL)), "us": 1.0},
                    {
                        "backend": "flashinfer:flashinfer",
                        "spec": json.loads(spec_key(FULL)),
                        "us": 2.0,
                    },
                ],
            }
        )
    )
    t = TuningData.load(path)
    assert t.time("fa3:fa3", FULL, Phase.DECODE) == 1.0
    plan = select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=t)
    assert _phases(plan) == {"prefill": "fa3:fa3", "decode": "fa3:fa3"}


def test_tuning_data_that_times_nothing_of_the_plan_is_said(registry):
    """Entries for another model's spec (or an unregistered backend name) ranked nothing and
    the plan fell back to priorities without a word; a file that times some group says
    nothing."""
    other = FULL.with_(num_heads=FULL.num_heads * 2)
    t = TuningData()
    t.record("fa3:fa3", other, 1.0, phase="decode", batch=1)
    t.record("fa3:fa3x", FULL, 1.0, phase="decode", batch=1)
    with pytest.warns(UserWarning, match="the tuning data times no group of this plan"):
        select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=t)
    t.record("fa3:fa3", FULL, 1.0, phase="decode", batch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=t)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"format": 4, "entries": []}, r"format 4, expected 3 \(or 2, 1\)"),
        (
            {"format": 2, "entries": [{"backend": "x", "spec": {}, "us": 1, "phase": "decoding"}]},
            r"entry 0 .* is malformed",
        ),
    ],
)
def test_a_bad_tuning_file_is_an_error_naming_it(tmp_path, payload, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=message):
        TuningData.load(path)


_ENTRY = {"backend": "fa3:fa3", "spec": {}, "phase": "decode", "batch": 8, "us": 10.0}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"cannot read it: .*No such file"),  # no file
        ("{oops", r"not JSON: Expecting property name"),
        ("[1, 2]", r"expected a JSON object with format and entries, got list"),
        ('{"format": 3, "device": "h200"}', r"expected a JSON object with format and entries"),
        ('{"format": 3, "entries": null}', r"entries: expected a list, got NoneType"),
        ('{"format": 3, "entries": ["x"]}', r"entry 0 \('x'\) is malformed"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "us": 0.0}]}), r"us: a time > 0"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "us": -5.0}]}), r"us: a time > 0"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "us": float("nan")}]}), r"us: a time > 0"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "batch": 0}]}), r"batch: an int >= 1"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "batch": 8.7}]}), r"batch: an int >= 1"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "batch": float("inf")}]}),
         r"batch: an int >= 1"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "us": True}]}), r"us: a time > 0"),
        (json.dumps({"format": 3, "entries": [{**_ENTRY, "us": "50"}]}), r"us: a time > 0"),
        (
            json.dumps(
                {"format": 3, "entries": [{**_ENTRY, "points": [{"context": 2048, "us": 0}]}]}
            ),
            r"points: .*a time > 0",
        ),
    ],
    ids=[
        "missing", "not-json", "list", "no-entries", "null-entries", "str-entry", "zero-us",
        "negative-us", "nan-us", "zero-batch", "float-batch", "inf-batch", "bool-us", "str-us",
        "zero-point",
    ],
)  # fmt: skip
def test_an_unreadable_or_unphysical_tuning_file_is_refused_naming_it(tmp_path, content, message):
    """Each of these used to end in a traceback (a missing file, a list, null entries), a
    ZeroDivisionError in ranking (a time of 0) or a silently wrong plan (a negative or NaN
    time ranked first)."""
    path = tmp_path / "tuning.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        TuningData.load(path)
    assert f"tuning file {path}" in str(err.value)


# ------------------------------------------------------------------------------------------
# attn explain
# ------------------------------------------------------------------------------------------
def test_explain_shows_every_phase(registry):
    from attn_core.cli import format_plan

    tuning = _tuning({("fa3:fa3", "decode", 8): 1.0, ("flashinfer:flashinfer", "decode", 8): 2.0})
    plan = select(
        group_layers([FULL]),
        registry(),
        H200,
        ExecutionConstraints(speculative_tokens=2, downgrade="allow"),
        tuning=tuning,
    )
    text = format_plan(plan)
    assert (
        "prefill / mixed steps: flashinfer:flashinfer; decode steps: fa3:fa3; speculative "
        "verify steps: flashinfer:flashinfer"
    ) in text
    assert "  decode steps:\n" in text  # its own table: it differs from prefill
    assert "(tuned: 1.0 us)" in text
    assert (
        "speculative verify steps: flashinfer:flashinfer, the same candidates and reasons as "
        "prefill / mixed steps"
    ) in text


def test_cli_backends_forces_a_phase_and_json_shows_every_phase(registry, monkeypatch, capsys):
    from attn_core import cli

    reg = registry()
    monkeypatch.setattr(cli, "_registry", lambda args: reg)
    argv = ["explain", "qwen3", "--target", "h200", "--json", "--spec-tokens", "2"]
    assert cli.main([*argv, "--backends", "decode:full=fa3"]) == 0
    d = json.loads(capsys.readouterr().out)
    (group,) = d["groups"]
    assert group["backend"] == "flashinfer:flashinfer"  # the existing key: prefill / mixed
    assert {p: v["backend"] for p, v in group["phases"].items()} == {
        "prefill": "flashinfer:flashinfer",
        "decode": "fa3:fa3",
        "verify": "flashinfer:flashinfer",
    }
    assert group["phases"]["decode"]["forced"] and not group["forced"]
    assert d["phases"] == ["prefill", "decode", "verify"]
    # a malformed phase key names the flag's entry
    assert cli.main([*argv, "--backends", "decod:full=fa3"]) == 2
    err = capsys.readouterr().err
    assert "'decod:full=fa3' has 'decod' before ':', which is not a phase" in err


# ------------------------------------------------------------------------------------------
# Per step-size bucket
# ------------------------------------------------------------------------------------------
CROSSING = {
    # fa3 faster for few requests, flashinfer for many (decode); one winner at prefill
    # (prefill sizes are tokens per step)
    ("fa3:fa3", "decode", 1): 5.0,
    ("fa3:fa3", "decode", 16): 9.0,
    ("fa3:fa3", "decode", 64): 40.0,
    ("flashinfer:flashinfer", "decode", 1): 10.0,
    ("flashinfer:flashinfer", "decode", 16): 12.0,
    ("flashinfer:flashinfer", "decode", 64): 20.0,
    ("fa3:fa3", "prefill", 1): 50.0,
    ("fa3:fa3", "prefill", 64): 90.0,
    ("flashinfer:flashinfer", "prefill", 1): 40.0,
    ("flashinfer:flashinfer", "prefill", 64): 80.0,
}


def test_tuning_with_crossing_backends_switches_per_step_size_bucket(registry):
    plan = select(
        group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=_tuning(CROSSING)
    )
    decode = plan.choice("full").phase_choice("decode")
    # buckets 1, 16, 64: bounds isqrt(1 * 16) = 4, isqrt(16 * 64) = 32, then max_batch_size
    assert [(bound, b.qualified_name) for bound, b in decode.by_step_size] == [
        (32, "fa3:fa3"),
        (256, "flashinfer:flashinfer"),
    ]
    assert [decode.backend_for_step(n).qualified_name for n in (1, 32, 33, 999)] == [
        "fa3:fa3",
        "fa3:fa3",
        "flashinfer:flashinfer",
        "flashinfer:flashinfer",
    ]
    # the aggregate still names one backend: geomean (5*9*40)^(1/3) = 12.2 < 13.4
    assert decode.backend.qualified_name == "fa3:fa3"
    assert decode.tuned_us == pytest.approx((5.0 * 9.0 * 40.0) ** (1 / 3))
    assert plan.choice("full").phase_choice("prefill").by_step_size == ()  # one winner
    assert {b.qualified_name for b in plan.choice("full").backends} == {
        "flashinfer:flashinfer",
        "fa3:fa3",
    }
    entry = plan.to_dict()["groups"][0]["phases"]["decode"]["by_step_size"]
    assert entry == [
        {"max": 32, "unit": "requests", "backend": "fa3:fa3"},
        {"max": 256, "unit": "requests", "backend": "flashinfer:flashinfer"},
    ]
    text = _explained(plan)
    assert "by step size (tuned): <= 32 requests: fa3:fa3; <= 256 requests:" in text


def test_prefill_switches_by_tokens_per_step_up_to_max_num_tokens(registry):
    """fa3 faster for short prefill steps, flashinfer for long ones: buckets 1024 and 16384
    tokens, bound isqrt(1024 * 16384) = 4096, the last one reaching the run's
    max_num_tokens (not its max_batch_size)."""
    times = {
        ("fa3:fa3", "prefill", 1024): 10.0,
        ("fa3:fa3", "prefill", 16384): 300.0,
        ("flashinfer:flashinfer", "prefill", 1024): 14.0,
        ("flashinfer:flashinfer", "prefill", 16384): 200.0,
    }
    cons = ExecutionConstraints(max_batch_size=64, max_num_tokens=32768)
    plan = select(group_layers([FULL]), registry(), H200, cons, tuning=_tuning(times))
    prefill = plan.choice("full").phase_choice("prefill")
    assert [(bound, b.qualified_name) for bound, b in prefill.by_step_size] == [
        (4096, "fa3:fa3"),
        (32768, "flashinfer:flashinfer"),
    ]
    assert prefill.backend_for_step(4097).qualified_name == "flashinfer:flashinfer"
    entry = plan.to_dict()["groups"][0]["phases"]["prefill"]["by_step_size"]
    assert {e["unit"] for e in entry} == {"tokens"}
    text = _explained(plan)
    assert "by step size (tuned): <= 4096 tokens: fa3:fa3; <= 32768 tokens:" in text, text


def test_no_bucket_switching_when_forced_or_within_one_bucket(registry):
    forced = ExecutionConstraints(force={"decode:full": "flashinfer"})
    plan = select(group_layers([FULL]), registry(), H200, forced, tuning=_tuning(CROSSING))
    assert plan.choice("full").phase_choice("decode").by_step_size == ()
    # a run of at most 8 requests per step can hit only the bucket of 1: fa3, no switching
    small = ExecutionConstraints(max_batch_size=8)
    plan = select(group_layers([FULL]), registry(), H200, small, tuning=_tuning(CROSSING))
    decode = plan.choice("full").phase_choice("decode")
    assert decode.by_step_size == () and decode.backend.qualified_name == "fa3:fa3"


# ------------------------------------------------------------------------------------------
# Each phase is held to the demands its own steps make
# ------------------------------------------------------------------------------------------
def test_graph_mode_decode_binds_the_decode_and_verify_phases_only(registry):
    """Under graph mode ``decode`` prefill and mixed steps run eagerly: a prefill backend that
    cannot be captured serves them; decode (and verify, whose uniform steps a server may
    capture) still need the mode. Under ``full`` every phase is captured."""
    eager = _backend("eagerpre", 300, min_compute_capability=(9, 0))  # graph_modes {none}
    reg = registry(("eagerpre", eager))
    plan = _plan(reg, graph_mode="decode", speculative_tokens=2)
    assert plan.constraints.graph_mode.value == "decode"  # not lowered
    phases = _phases(plan)
    assert phases["prefill"] == "eagerpre:eagerpre"
    assert phases["decode"] != "eagerpre:eagerpre" and phases["verify"] != "eagerpre:eagerpre"
    codes = [r.code for r in plan.choice("full").phase_choice("decode").rejected
             if r.backend == "eagerpre:eagerpre"]  # fmt: skip
    assert codes == ["graph_mode"]
    assert check_backend(eager, FULL, H200, ExecutionConstraints(graph_mode="full"),
                         phase=Phase.PREFILL)[0].code == "graph_mode"  # fmt: skip


def test_draft_tokens_bind_the_verify_phase_only(registry):
    """A backend that verifies no draft tokens can still serve prefill and decode of a run that
    verifies; the verify phase goes to one that can."""
    nospec = _backend("nospec", 300, min_compute_capability=(9, 0), max_speculative_tokens=0)
    plan = _plan(registry(("nospec", nospec)), speculative_tokens=4)
    phases = _phases(plan)
    assert phases["prefill"] == phases["decode"] == "nospec:nospec"
    assert phases["verify"] == "flashinfer:flashinfer"
    rejected = plan.choice("full").phase_choice("verify").rejections_by_backend()["nospec:nospec"]
    assert [r.code for r in rejected] == ["speculative"]


# ------------------------------------------------------------------------------------------
# A bucket whose points disagree on the fastest backend
# ------------------------------------------------------------------------------------------
def _shaped_tuning(times: dict[tuple[str, str, int, int], float]) -> TuningData:
    """{(backend, phase, batch, context): us} through :func:`record_measured`, as ``attn bench``
    and bench/bench_tuned_plans.py record a grid."""
    from attn_core.bench import record_measured

    t = TuningData(device=H200.short())
    by: dict[tuple[str, str], list[tuple[int, int, float]]] = {}
    for (backend, phase, batch, context), us in times.items():
        by.setdefault((backend, phase), []).append((batch, context, us))
    for (backend, phase), measured in by.items():
        record_measured(t, backend, FULL, Phase(phase), measured)
    return t


# One decode request at three context lengths: flashinfer is fastest at short contexts, fa3 at
# long ones (as a kernel without a split-KV path loses at long context). By the bucket's
# geometric mean flashinfer wins ((10 * 10 * 400)^(1/3) = 34 against 45), and then loses 4x
# at 64k; fa3 loses at most 3x, at 2k.
SHORT_VS_LONG = {
    ("flashinfer:flashinfer", "decode", 1, 2048): 10.0,
    ("flashinfer:flashinfer", "decode", 1, 16384): 10.0,
    ("flashinfer:flashinfer", "decode", 1, 65536): 400.0,
    ("fa3:fa3", "decode", 1, 2048): 30.0,
    ("fa3:fa3", "decode", 1, 16384): 30.0,
    ("fa3:fa3", "decode", 1, 65536): 100.0,
    # a second bucket where the two agree, so that the buckets are compared point by point
    ("flashinfer:flashinfer", "decode", 64, 2048): 50.0,
    ("fa3:fa3", "decode", 64, 2048): 80.0,
}


def test_a_bucket_goes_to_the_backend_with_the_smallest_worst_ratio_over_its_points(registry):
    tuning = _shaped_tuning(SHORT_VS_LONG)
    assert tuning.shapes("fa3:fa3", FULL, Phase.DECODE, 1) == {
        2048: 30.0,
        16384: 30.0,
        65536: 100.0,
    }
    plan = select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=tuning)
    decode = plan.choice("full").phase_choice("decode")
    assert decode.backend_for_step(1).qualified_name == "fa3:fa3"
    assert decode.backend_for_step(64).qualified_name == "flashinfer:flashinfer"


def test_prefill_buckets_compare_their_request_splits(registry):
    """4096 tokens as one request (fa3 1.5x faster) or as four of 1024 (flashinfer 1.19x
    faster) and as sixteen of 256 (flashinfer 2x faster): flashinfer loses least."""
    times = {
        ("fa3:fa3", "prefill", 1, 4096): 100.0,
        ("fa3:fa3", "prefill", 4, 1024): 158.0,
        ("fa3:fa3", "prefill", 16, 256): 200.0,
        ("flashinfer:flashinfer", "prefill", 1, 4096): 150.0,
        ("flashinfer:flashinfer", "prefill", 4, 1024): 132.0,
        ("flashinfer:flashinfer", "prefill", 16, 256): 100.0,
    }
    tuning = _shaped_tuning(times)
    assert tuning.shapes("fa3:fa3", FULL, Phase.PREFILL, 4096) == {1: 100.0, 4: 158.0, 16: 200.0}
    plan = select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=tuning)
    prefill = plan.choice("full").phase_choice("prefill")
    assert prefill.backend.qualified_name == "flashinfer:flashinfer"
    assert prefill.by_step_size == ()  # one bucket, one backend


def test_bucket_points_survive_the_tuning_file(tmp_path, registry):
    tuning = _shaped_tuning(SHORT_VS_LONG)
    path = tmp_path / "tuning.json"
    tuning.save(path)
    entries = json.loads(path.read_text())["entries"]
    fa3_b1 = next(e for e in entries if e["backend"] == "fa3:fa3" and e["batch"] == 1)
    assert fa3_b1["points"] == [
        {"context": 2048, "us": 30.0},
        {"context": 16384, "us": 30.0},
        {"context": 65536, "us": 100.0},
    ]
    assert fa3_b1["us"] == pytest.approx((30.0 * 30.0 * 100.0) ** (1 / 3))
    loaded = TuningData.load(path)
    assert loaded.shape_us == tuning.shape_us
    plan = select(group_layers([FULL]), registry(), H200, ExecutionConstraints(), tuning=loaded)
    assert (
        plan.choice("full").phase_choice("decode").backend_for_step(1).qualified_name == "fa3:fa3"
    )


# ------------------------------------------------------------------------------------------
# A slower path for one layer feature
# ------------------------------------------------------------------------------------------
SINKS_LAYER = LayerSpec(
    kind="full", num_heads=64, num_kv_heads=8, head_dim=64, page_size=16, has_sinks=True
)


def test_a_feature_priority_ranks_the_backend_lower_for_layers_with_that_feature(make_plugin):
    """A backend whose sinks path is slower (feature_priority sinks 50) under another (90,
    decode 60) for a layer with sinks, in every phase; a layer without sinks keeps its 100."""
    import attn_core.reference.plugin as ref

    slow_sinks = _backend(
        "flashinfer", 100, sinks=True, feature_priority={"sinks": dict.fromkeys(Phase, 50)}
    )
    fa3 = _backend("fa3", 90, sinks=True, phase_priority={"decode": 60, "verify": 60})
    assert slow_sinks.priority_for("decode", SINKS_LAYER) == 50
    assert slow_sinks.priority_for("decode", FULL) == 100
    assert slow_sinks.priority_for("decode") == 100
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    reg.register_plugin(make_plugin("fa3", [fa3]), name="fa3")
    reg.register_plugin(make_plugin("flashinfer", [slow_sinks]), name="flashinfer")
    plan = _plan(reg, specs=(SINKS_LAYER, FULL), speculative_tokens=2)
    groups = phase_mapping_from_plan(plan)
    sinks_group = next(g for g in plan.choices if g.group.spec.has_sinks).group.group_id
    plain_group = next(g for g in plan.choices if not g.group.spec.has_sinks).group.group_id
    assert set(dict(groups[sinks_group]).values()) == {"fa3:fa3"}
    assert dict(groups[plain_group]) == {
        "prefill": "flashinfer:flashinfer",
        "decode": "flashinfer:flashinfer",
        "verify": "flashinfer:flashinfer",
    }
    # without fa3 the slower sinks path still outranks the reference
    alone = Registry(strict=True)
    alone.register_plugin(ref, name="attn_core")
    alone.register_plugin(make_plugin("flashinfer", [slow_sinks]), name="flashinfer")
    plan = _plan(alone, specs=(SINKS_LAYER,))
    assert set(_phases(plan, plan.choices[0].group.group_id).values()) == {"flashinfer:flashinfer"}


# gpt-oss's sliding layers on the H200 (us): 4096 prefill tokens as one request, fa3 is faster;
# as four of 1024, flashinfer; at 8192 tokens fa3 both ways.
SPLITS = {
    ("fa3:fa3", "prefill", 1, 4096): 100.0,
    ("fa3:fa3", "prefill", 4, 1024): 158.4,
    ("flashinfer:flashinfer", "prefill", 1, 4096): 150.0,
    ("flashinfer:flashinfer", "prefill", 4, 1024): 132.7,
    ("fa3:fa3", "prefill", 1, 8192): 187.2,
    ("fa3:fa3", "prefill", 4, 2048): 300.0,
    ("flashinfer:flashinfer", "prefill", 1, 8192): 275.6,
    ("flashinfer:flashinfer", "prefill", 4, 2048): 310.0,
}


def test_a_prefill_bucket_whose_request_splits_disagree_switches_by_requests(registry):
    cons = ExecutionConstraints(max_batch_size=64, max_num_tokens=16384)
    plan = select(group_layers([FULL]), registry(), H200, cons, tuning=_shaped_tuning(SPLITS))
    prefill = plan.choice("full").phase_choice("prefill")
    # token buckets 4096 and 8192: bound isqrt(4096 * 8192) = 5792; requests 1 and 4: bound 2
    assert [(a, m, r, b.qualified_name) for a, m, r, b in prefill.by_requests] == [
        (0, 5792, 2, "fa3:fa3"),
        (0, 5792, 64, "flashinfer:flashinfer"),
    ]
    assert prefill.by_step_size == ()  # fa3 loses least in both buckets
    assert prefill.backend.qualified_name == "fa3:fa3"
    assert [
        prefill.backend_for_step(t, r).qualified_name
        for t, r in ((4096, 1), (4096, 4), (4000, 3), (12000, 1), (8192, 4))
    ] == ["fa3:fa3", "flashinfer:flashinfer", "flashinfer:flashinfer", "fa3:fa3", "fa3:fa3"]
    assert prefill.backend_for_step(4096).qualified_name == "fa3:fa3"  # by tokens alone
    assert {b.qualified_name for b in plan.choice("full").backends} == {
        "fa3:fa3",
        "flashinfer:flashinfer",
    }
    entry = plan.to_dict()["groups"][0]["phases"]["prefill"]["by_requests"]
    assert entry[0] == {
        "tokens_above": 0,
        "tokens_max": 5792,
        "requests_max": 2,
        "backend": "fa3:fa3",
    }
    text = _explained(plan)
    assert "by requests (tuned): 1-5792 tokens, <= 2 requests: fa3:fa3;" in text, text
    assert "1-5792 tokens, <= 64 requests: flashinfer:flashinfer" in text, text
    # flashinfer, not "ranked lower", with its measured time
    assert "flashinfer:flashinfer serves some steps (tuned: " in text, text


def test_a_two_request_split_moves_the_request_bound(registry):
    """With 1, 2 and 4 requests timed, the bounds are isqrt(1 * 2) = 1 and isqrt(2 * 4) = 2:
    the H200 run that had only 1 and 4 put 2 x 2048 with the single request (fa3, 1.209x the
    fastest); timed, 2 requests go with 4 (flashinfer)."""
    shapes = dict(SPLITS) | {
        ("fa3:fa3", "prefill", 2, 2048): 140.0,
        ("flashinfer:flashinfer", "prefill", 2, 2048): 115.8,
        ("fa3:fa3", "prefill", 2, 4096): 240.0,
        ("flashinfer:flashinfer", "prefill", 2, 4096): 290.0,
    }
    cons = ExecutionConstraints(max_batch_size=64, max_num_tokens=16384)
    plan = select(group_layers([FULL]), registry(), H200, cons, tuning=_shaped_tuning(shapes))
    prefill = plan.choice("full").phase_choice("prefill")
    assert [(a, m, r, b.qualified_name) for a, m, r, b in prefill.by_requests] == [
        (0, 5792, 1, "fa3:fa3"),
        (0, 5792, 64, "flashinfer:flashinfer"),
    ]
    assert [
        prefill.backend_for_step(t, r).qualified_name
        for t, r in ((4096, 1), (4096, 2), (4096, 4), (8192, 2))
    ] == ["fa3:fa3", "flashinfer:flashinfer", "flashinfer:flashinfer", "fa3:fa3"]


def test_measured_leads_within_the_tie_band_go_to_the_default_rule(registry):
    """fa3 measured 1 % ahead of flashinfer (within ``MEASURED_TIE``) is a tie that the
    default rule decides (flashinfer's priority 100 over fa3's 90): at the phase, in a bucket
    and in a prefill request split. On an H100, a 0.6 % tuning lead of fa3 at 16384 prefill
    tokens came out a 5.6 % loss in the check. A 5 % lead is measured, and fa3 keeps it."""
    cons = ExecutionConstraints(max_batch_size=64, max_num_tokens=16384)

    def prefill(fa3_one_request: float, fa3_decode: float):
        times = {
            ("fa3:fa3", "prefill", 1, 4096): fa3_one_request,
            ("flashinfer:flashinfer", "prefill", 1, 4096): 100.0,
            ("fa3:fa3", "prefill", 4, 1024): 100.5,
            ("flashinfer:flashinfer", "prefill", 4, 1024): 100.0,
            ("fa3:fa3", "decode", 8, 2048): fa3_decode,
            ("flashinfer:flashinfer", "decode", 8, 2048): 50.0,
            ("fa3:fa3", "decode", 64, 2048): fa3_decode,
            ("flashinfer:flashinfer", "decode", 64, 2048): 50.0,
        }
        plan = select(group_layers([FULL]), registry(), H200, cons, tuning=_shaped_tuning(times))
        return plan.choice("full").phase_choice("prefill"), plan.choice("full").phase_choice(
            "decode"
        )

    tied, tied_decode = prefill(99.0, 49.5)
    assert tied.backend.qualified_name == "flashinfer:flashinfer"
    assert tied.by_requests == () and tied.by_step_size == ()
    assert tied_decode.backend.qualified_name == "flashinfer:flashinfer"
    # explain and the JSON give the measured time of each candidate ranked lower, and say
    # where a faster one lost a tie
    assert dict(tied_decode.outranked_us) == {"fa3:fa3": pytest.approx(49.5)}
    assert tied_decode.to_dict()["outranked_us"] == {"fa3:fa3": pytest.approx(49.5)}
    plan = select(
        group_layers([FULL]),
        registry(),
        H200,
        cons,
        tuning=_tuning(
            {("fa3:fa3", "decode", 8): 49.5, ("flashinfer:flashinfer", "decode", 8): 50.0}
        ),
    )
    text = _explained(plan)
    assert "flashinfer:flashinfer chosen (tuned: 50.0 us)" in text, text
    assert (
        "fa3:fa3 admissible, ranked lower (tuned: 49.5 us: a lead under 2 %, a tie the default "
        "rule decided)" in text
    ), text
    led, led_decode = prefill(95.0, 47.5)
    assert [(m, r, b.qualified_name) for _, m, r, b in led.by_requests] == [
        (16384, 2, "fa3:fa3"),
        (16384, 64, "flashinfer:flashinfer"),
    ]
    assert led_decode.backend.qualified_name == "fa3:fa3"


def test_no_request_switching_when_prefill_steps_are_captured(make_plugin):
    """Graph mode full replays a captured prefill graph for other request counts: no
    by_requests (the token buckets still switch)."""
    import attn_core.reference.plugin as ref

    graphs = {"none", "decode", "full"}
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for name, prio in (("fa3", 90), ("flashinfer", 100)):
        reg.register_plugin(
            make_plugin(name, [_backend(name, prio, graph_modes=graphs)]), name=name
        )
    cons = ExecutionConstraints(max_batch_size=64, max_num_tokens=16384, graph_mode="full")
    plan = select(group_layers([FULL]), reg, H200, cons, tuning=_shaped_tuning(SPLITS))
    assert plan.constraints.graph_mode.value == "full"
    assert plan.choice("full").phase_choice("prefill").by_requests == ()


def test_a_backend_that_cannot_serve_the_model_is_no_downgrade(make_plugin):
    """A head dim the backend does not serve is what the model is, not a run setting: the
    reference serving a d256 layer is no downgrade from a d128-only kernel (it warned, and
    --downgrade error refused a valid plan). A page size it does not take still is one."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    d128 = _backend("d128", 100, head_dims={128}, page_sizes={16})
    reg.register_plugin(make_plugin("d128", [d128]), name="d128")
    d256 = LayerSpec(kind="full", num_heads=32, num_kv_heads=8, head_dim=256, page_size=16)
    plan = _plan(reg, specs=(d256,), downgrade="error")
    choice = plan.choice("full").phase_choice("decode")
    assert choice.backend.qualified_name == "attn_core:reference"
    assert choice.downgraded_from == ()
    with pytest.raises(SelectionError, match="downgrade"):
        _plan(reg, specs=(FULL,), downgrade="error", page_size=64)


def test_a_deny_entry_that_names_no_backend_warns_that_it_excludes_nothing(registry):
    """--deny flashinfr (a typo) was accepted without a word, and flashinfer still served."""
    with pytest.warns(
        UserWarning, match="deny list entry 'flashinfr' excludes nothing: no backend"
    ):
        plan = _plan(registry(), deny=frozenset({"flashinfr"}))
    assert _phases(plan)["decode"] == "flashinfer:flashinfer"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(registry(), deny=frozenset({"fa3"}))  # a real one: no warning


@pytest.mark.parametrize("key", ["linear", "decode:mla"])
def test_a_forced_kind_the_model_has_no_layers_of_warns_that_it_applies_to_none(registry, key):
    """--backends linear=reference on a model of full-attention layers only was accepted
    without a word (a server's shared setting may name kinds a model lacks: a warning)."""
    with pytest.warns(UserWarning, match=rf"forced entry '{key}=reference' applies to no layer"):
        plan = _plan(registry(), force={key: "reference"})
    assert _phases(plan)["decode"] == "flashinfer:flashinfer"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(registry(), force={"decode:full": "fa3"})  # one that applies: no warning
