"""Whole-model selection with five registered plugins on a 64-layer hybrid model.

The plugins (all inline, none runs code: selection is offline, planned for a named H200):

=========== ========== ======================================================= ========
plugin      backend    serves                                                  priority
=========== ========== ======================================================= ========
attn_core   reference  every kind, CPU + CUDA, any page size, NHD, graphs none/decode  0
fastattn    flash      full, sm90+, bf16/fp16 (+fp8 KV), d64/128/256, pages 16/32/64, 100
                       NHD, every graph mode, window + soft-cap, 4 draft tokens
bigpage     paged64    full + mla, sm80+, bf16, d128/256/512/576, page 64 only,       200
                       NHD + HND, every graph mode
ssmkern     gdn        linear gated_deltanet + mamba2, sm80+, bf16, graphs none/decode 50
oldgpu      legacy     full, sm <= 8.9 only                                          150
=========== ========== ======================================================= ========
"""

from __future__ import annotations

import json
import warnings

import pytest

from attn_core.backend import Backend, BackendCapabilities
from attn_core.errors import SelectionError
from attn_core.models import specs_from_hf_config
from attn_core.registry import Registry
from attn_core.selector import Rejection, TuningData, check_backend, select, spec_key
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerSpec,
    group_layers,
)

H200 = DeviceCapabilities.target("h200")
A100 = DeviceCapabilities.target("a100")
CPU = DeviceCapabilities.target("cpu")
ALL_GRAPHS = {"none", "decode", "full"}

GLOBAL = LayerSpec(kind="full", num_heads=16, num_kv_heads=2, head_dim=256)
SLIDING = GLOBAL.with_(sliding_window=4096)
GDN = LayerSpec(
    kind="linear",
    linear_variant="gated_deltanet",
    num_heads=32,
    num_kv_heads=16,
    head_dim=128,
    head_dim_v=128,
    conv_kernel_size=4,
    conv_channels=8192,
    qk_l2norm=True,
)
MLA = LayerSpec(
    kind="mla",
    num_heads=16,
    num_kv_heads=1,
    head_dim=576,
    head_dim_v=512,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
)


def hybrid64() -> list[LayerSpec]:
    """64 layers: 3 of 4 Gated DeltaNet, the 4th full attention (alternating global/sliding)."""
    specs = []
    for i in range(64):
        if i % 4 != 3:
            specs.append(GDN)
        else:
            specs.append(GLOBAL if i % 8 == 3 else SLIDING)
    return specs


def _plugins(make_plugin):
    import attn_core.reference.plugin as ref

    def b(name, priority, **caps):
        caps.setdefault("device_types", {"cuda"})
        caps.setdefault("dtypes", {"bfloat16", "float16"})
        return Backend(name=name, capabilities=BackendCapabilities(**caps), priority=priority)

    return {
        "attn_core": ref,
        "fastattn": make_plugin(
            "fastattn",
            [
                b(
                    "flash",
                    100,
                    kinds={"full"},
                    min_compute_capability=(9, 0),
                    kv_dtypes={"bfloat16", "float16", "fp8_e4m3"},
                    head_dims={64, 128, 256},
                    page_sizes={16, 32, 64},
                    graph_modes=ALL_GRAPHS,
                    sliding_window=True,
                    logits_soft_cap=True,
                    max_speculative_tokens=4,
                )
            ],
        ),
        "bigpage": make_plugin(
            "bigpage",
            [
                b(
                    "paged64",
                    200,
                    kinds={"full", "mla"},
                    min_compute_capability=(8, 0),
                    dtypes={"bfloat16"},
                    head_dims={128, 256, 512, 576},
                    page_sizes={64},
                    kv_layouts={"NHD", "HND"},
                    graph_modes=ALL_GRAPHS,
                    sliding_window=True,
                )
            ],
        ),
        "ssmkern": make_plugin(
            "ssmkern",
            [
                b(
                    "gdn",
                    50,
                    kinds={"linear"},
                    linear_variants={"gated_deltanet", "mamba2"},
                    min_compute_capability=(8, 0),
                    dtypes={"bfloat16"},
                    graph_modes={"none", "decode"},
                    max_speculative_tokens=4,
                )
            ],
        ),
        "oldgpu": make_plugin(
            "oldgpu",
            [b("legacy", 150, kinds={"full"}, max_compute_capability=(8, 9), sliding_window=True)],
        ),
    }


@pytest.fixture
def five(make_plugin) -> Registry:
    reg = Registry(strict=True)
    for name, mod in _plugins(make_plugin).items():
        reg.register_plugin(mod, name=name)
    assert len(reg.backends) == 5
    return reg


@pytest.fixture
def groups():
    return group_layers(hybrid64())


def _allow(**kw) -> ExecutionConstraints:
    return ExecutionConstraints(downgrade="allow", **kw)


def _picked(plan) -> dict[str, str]:
    return {c.group.group_id: c.backend.qualified_name for c in plan.choices}


# ------------------------------------------------------------------------------------------
# Whole-model selection
# ------------------------------------------------------------------------------------------
def test_hybrid64_groups(groups):
    assert [(g.group_id, len(g.layer_indices)) for g in groups] == [
        ("linear", 48),
        ("full", 8),
        ("full.1", 8),
    ]


def test_whole_model_selection(five, groups):
    plan = select(groups, five, H200, _allow())
    assert _picked(plan) == {
        "linear": "ssmkern:gdn",
        "full": "fastattn:flash",
        "full.1": "fastattn:flash",
    }
    assert plan.page_size == 16 and plan.kv_layout == "NHD"
    full = plan.choice("full")
    assert full.outranked == ("attn_core:reference",)
    by = full.rejections_by_backend()
    assert [r.code for r in by["bigpage:paged64"]] == ["page_size"]
    assert by["bigpage:paged64"][0].fix == "page_size 16 -> 64"
    assert [r.code for r in by["oldgpu:legacy"]] == ["compute_capability"]
    assert [r.code for r in by["ssmkern:gdn"]] == ["kind"]
    assert set(full.downgraded_from) == {"bigpage:paged64", "oldgpu:legacy"}
    d = plan.to_dict()
    assert d["groups"][1]["layers"] == list(range(3, 64, 8))


def test_qwen3_next_sample(five):
    layout = specs_from_hf_config("qwen3-next")
    plan = select(layout.groups, five, H200, _allow())
    assert _picked(plan) == {"linear": "ssmkern:gdn", "full": "fastattn:flash"}


def test_selection_is_deterministic(five, groups, make_plugin):
    first = select(groups, five, H200, _allow()).to_dict()
    assert select(groups, five, H200, _allow()).to_dict() == first
    # registration order does not matter
    reg = Registry(strict=True)
    for name, mod in reversed(list(_plugins(make_plugin).items())):
        reg.register_plugin(mod, name=name)
    assert select(groups, reg, H200, _allow()).to_dict() == first


def test_equal_priority_ties_break_on_qualified_name(make_plugin, make_caps):
    reg = Registry(strict=True)
    for vendor in ("zeta", "alpha", "mid"):
        reg.register_plugin(
            make_plugin(vendor, [Backend(name="k", capabilities=make_caps(), priority=5)]),
            name=vendor,
        )
    spec = LayerSpec(kind="full", num_heads=2, num_kv_heads=1, head_dim=8, dtype="float32")
    plan = select(group_layers([spec]), reg, CPU)
    assert plan.choices[0].backend.qualified_name == "alpha:k"
    assert plan.choices[0].outranked == ("mid:k", "zeta:k")


# ------------------------------------------------------------------------------------------
# Model-wide settings: page size, layout, graph mode
# ------------------------------------------------------------------------------------------
def test_requested_page_64_admits_page64_backend(five, groups):
    plan = select(groups, five, H200, _allow(page_size=64))
    assert plan.page_size == 64
    assert _picked(plan)["full"] == "bigpage:paged64"
    assert _picked(plan)["full.1"] == "bigpage:paged64"


def test_page64_only_group_forces_page64_for_every_group(five):
    # The MLA group has only paged64 (reference not allowed): every KV group moves to page 64.
    specs = [GDN, GLOBAL, MLA, GDN, SLIDING, MLA]
    allow = {"paged64", "flash", "gdn"}
    plan = select(group_layers(specs), five, H200, _allow(allow=allow))
    assert plan.page_size == 64
    assert _picked(plan) == {
        "linear": "ssmkern:gdn",
        "full": "bigpage:paged64",
        "mla": "bigpage:paged64",
        "full.1": "bigpage:paged64",
    }


def test_page64_only_backend_rejected_when_page_is_pinned(five):
    specs = [GDN, GLOBAL, MLA]
    allow = {"paged64", "flash", "gdn"}
    with pytest.raises(SelectionError) as info:
        select(group_layers(specs), five, H200, _allow(allow=allow, page_size=16))
    msg = str(info.value)
    assert "no backend can serve layer group 'mla'" in msg
    assert "page_size=16" in msg
    assert "[page_size]" in msg and "fix: page_size 16 -> 64" in msg


def test_kv_layout_hnd(five, groups):
    plan = select(groups, five, H200, _allow(kv_layout="HND"))
    assert plan.kv_layout == "HND" and plan.page_size == 64
    assert _picked(plan)["full"] == "bigpage:paged64"
    rs = check_backend(
        five.resolve("flash"), GLOBAL, H200, ExecutionConstraints(), page_size=16, kv_layout="HND"
    )
    assert [(r.code, r.fix) for r in rs] == [("kv_layout", "kv_layout HND -> NHD")]


def test_graph_mode_full_has_no_linear_backend(five, groups):
    with pytest.raises(SelectionError) as info:  # the policy does not lower the graph mode
        select(groups, five, H200, ExecutionConstraints(graph_mode="full", downgrade="error"))
    msg = str(info.value)
    assert "layer group 'linear'" in msg and "graph_mode=full" in msg
    assert msg.count("fix: graph_mode full -> decode") == 2  # ssmkern:gdn and the reference
    assert "graph mode decode would admit every group" in msg
    plan = select(groups, five, H200, _allow(graph_mode="full"))  # lowered, silently
    assert plan.constraints.graph_mode is GraphMode.DECODE
    assert plan.graph_mode_requested is GraphMode.FULL
    assert _picked(plan)["linear"] == "ssmkern:gdn"
    plan = select(groups, five, H200, _allow(graph_mode="decode"))
    assert plan.constraints.graph_mode is GraphMode.DECODE
    assert _picked(plan)["linear"] == "ssmkern:gdn"


# ------------------------------------------------------------------------------------------
# Ranking by tuning data, then priority
# ------------------------------------------------------------------------------------------
def test_tuning_data_ranks_before_priority(five, groups, tmp_path, monkeypatch):
    tuning = TuningData(device=H200.short())
    tuning.record("attn_core:reference", GLOBAL, 5.0)  # measured faster than flash (unmeasured)
    plan = select(groups, five, H200, _allow(), tuning=tuning)
    assert _picked(plan)["full"] == "attn_core:reference"
    assert plan.choice("full").tuned_us == 5.0
    assert _picked(plan)["full.1"] == "fastattn:flash"  # no data for the sliding spec
    tuning.record("fastattn:flash", GLOBAL, 3.0)
    assert _picked(select(groups, five, H200, _allow(), tuning=tuning))["full"] == "fastattn:flash"
    # the same through a saved file named by ATTN_CORE_TUNING
    path = tmp_path / "tuning.json"
    tuning.record("fastattn:flash", GLOBAL, 9.0)
    tuning.save(path)
    assert TuningData.load(path).times_us == tuning.times_us
    monkeypatch.setenv("ATTN_CORE_TUNING", str(path))
    assert _picked(select(groups, five, H200, _allow()))["full"] == "attn_core:reference"


def test_a_tuning_file_from_before_a_spec_field_still_matches(tmp_path):
    """A file written before ``attention_chunk_size`` existed lacks the field: its times hold
    for the layer with the field unset (not silently for no layer), and never for a chunked one."""
    tuning = TuningData(device=H200.short())
    tuning.record("fastattn:flash", GLOBAL, 3.0)
    path = tmp_path / "tuning.json"
    tuning.save(path)
    payload = json.loads(path.read_text())
    for entry in payload["entries"]:
        del entry["spec"]["attention_chunk_size"]
    path.write_text(json.dumps(payload))
    assert TuningData.load(path).times_us == tuning.times_us
    chunked = spec_key(GLOBAL.with_(attention_chunk_size=64))
    assert all(key[1] != chunked for key in TuningData.load(path).times_us)


# ------------------------------------------------------------------------------------------
# Overrides
# ------------------------------------------------------------------------------------------
def test_force_per_kind_and_group(five, groups):
    plan = select(groups, five, H200, _allow(force="full=reference,linear=attn_core:reference"))
    assert set(_picked(plan).values()) == {"attn_core:reference"}
    assert all(c.forced for c in plan.choices)
    plan = select(groups, five, H200, _allow(force="full.1=attn_core:reference"))
    assert _picked(plan)["full.1"] == "attn_core:reference"
    assert _picked(plan)["full"] == "fastattn:flash"
    rejected = plan.choice("full.1").rejections_by_backend()["fastattn:flash"]
    assert [r.code for r in rejected] == ["not_forced"]


def test_env_forces_and_explicit_wins(five, groups, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "linear=reference,full=reference")
    plan = select(groups, five, H200, _allow())
    assert set(_picked(plan).values()) == {"attn_core:reference"}
    plan = select(groups, five, H200, _allow(force="linear=gdn"))
    assert _picked(plan)["linear"] == "ssmkern:gdn"
    assert _picked(plan)["full"] == "attn_core:reference"


def test_env_key_given_twice_is_an_error_naming_both_values(five, groups, monkeypatch):
    # Before: the pairs were sorted and the alphabetically last one ('reference') won silently.
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full=reference,full=flash")
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow())
    msg = str(info.value)
    assert msg.startswith("ATTN_CORE_BACKENDS='full=reference,full=flash': ")
    assert "'full' is given twice ('reference' and 'flash')" in msg


@pytest.mark.parametrize(
    ("value", "entry", "why"),
    [
        ("full=flash,linearreference", "linearreference", "has no '='"),
        ("full=flash, =reference", "=reference", "names no layer kind or group before '='"),
        ("full=, linear=gdn", "full=", "names no backend after '='"),
    ],
)
def test_malformed_env_entry_names_the_variable_and_the_entry(
    five, groups, monkeypatch, value, entry, why
):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", value)
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow())
    msg = str(info.value)
    assert msg.startswith(f"ATTN_CORE_BACKENDS={value!r}: entry {entry!r} {why}")
    assert "KIND_OR_GROUP=BACKEND" in msg


def test_env_key_that_names_no_kind_or_group_names_the_variable(five, groups, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "ful=flash,linear=gdn")
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow())
    msg = str(info.value)
    assert msg.startswith("ATTN_CORE_BACKENDS='ful=flash,linear=gdn': entry 'ful=flash' names ")
    assert "no layer kind and no group of this model" in msg
    assert "'full.1'" in msg and "'linear'" in msg  # the keys it could have meant


def test_env_forced_unknown_backend_names_the_variable(five, groups, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full=fa9")
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow())
    msg = str(info.value)
    assert msg.startswith("ATTN_CORE_BACKENDS='full=fa9': entry 'full=fa9': no backend named 'fa9'")
    assert "fastattn:flash" in msg


def test_env_forced_backend_that_cannot_serve_says_it_came_from_the_variable(
    five, groups, monkeypatch
):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full=legacy")
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow())
    msg = str(info.value)
    assert msg.startswith(
        "forced backend 'legacy' (from ATTN_CORE_BACKENDS='full=legacy') cannot serve layer "
        "group 'full'"
    )
    assert "compute capability <= 8.9" in msg


def test_explicit_force_errors_do_not_blame_the_variable(five, groups, monkeypatch):
    monkeypatch.setenv("ATTN_CORE_BACKENDS", "full=reference")
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow(force="full=legacy"))
    msg = str(info.value)
    assert msg.startswith("forced backend 'legacy' cannot serve layer group 'full'")
    assert "ATTN_CORE_BACKENDS" not in msg


def test_forced_backend_that_cannot_serve_is_an_error(five, groups):
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, _allow(force="full=legacy"))
    msg = str(info.value)
    assert "forced backend 'legacy' cannot serve layer group 'full'" in msg
    assert "oldgpu:legacy" in msg and "compute capability <= 8.9" in msg
    assert "fastattn:flash" not in msg  # never silently replaced; other candidates not listed


def test_force_key_that_names_no_kind_or_group_is_an_error(five, groups):
    with pytest.raises(SelectionError, match="'ful'"):
        select(groups, five, H200, _allow(force="ful=flash"))


def test_forcing_an_unknown_backend_lists_registered(five, groups):
    with pytest.raises(SelectionError, match=r"no backend named 'fa9'.*fastattn:flash"):
        select(groups, five, H200, _allow(force="full=fa9"))


def test_nothing_fits_lists_every_candidate(five, groups):
    with pytest.raises(SelectionError) as info:
        select(groups, five, CPU, _allow(deny={"reference"}))
    msg = str(info.value)
    assert msg.startswith("no backend can serve layer group 'linear'")
    for b in five.backends:
        assert f"  {b.qualified_name}:" in msg
    assert "[denied] in the deny list" in msg
    assert "[device_type] runs on cuda, the device is cpu" in msg
    assert "[kind] cannot serve this model: kind linear (serves full)" in msg


def test_empty_registry_says_install_a_plugin(registry, groups):
    with pytest.raises(SelectionError, match="no backend is registered"):
        select(groups, registry, H200)


# ------------------------------------------------------------------------------------------
# Downgrade policy
# ------------------------------------------------------------------------------------------
def test_downgrade_error(five, groups):
    with pytest.raises(SelectionError) as info:
        select(groups, five, H200, ExecutionConstraints(downgrade="error"))
    msg = str(info.value)
    assert "falls back to fastattn:flash (priority 100)" in msg
    assert "bigpage:paged64: [page_size]" in msg and "[downgrade policy: error]" in msg


def test_downgrade_warn(five, groups):
    with pytest.warns(UserWarning) as record:
        plan = select(groups, five, H200, ExecutionConstraints(downgrade="warn"))
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2  # one per full-attention group, none for the linear group
    assert messages[0].startswith("layer group 'full' (")
    assert messages[1].startswith("layer group 'full.1' (")
    assert all("falls back to fastattn:flash (priority 100)" in m for m in messages)
    assert _picked(plan)["full"] == "fastattn:flash"


def test_downgrade_allow_is_silent(five, groups):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(groups, five, H200, ExecutionConstraints(downgrade="allow"))


def test_forced_or_denied_backends_are_not_downgrades(five, groups):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(
            groups,
            five,
            H200,
            ExecutionConstraints(downgrade="error", force="full=flash", deny={"legacy"}),
        )
        select(
            groups,
            five,
            H200,
            ExecutionConstraints(downgrade="error", page_size=64, deny={"legacy"}),
        )


# ------------------------------------------------------------------------------------------
# The reference ranks last, and falling back to it is a downgrade
# ------------------------------------------------------------------------------------------
SMALL = LayerSpec(kind="full", num_heads=2, num_kv_heads=1, head_dim=8, dtype="float32")


def _with_reference(make_plugin, *backends: tuple[str, int, dict]) -> Registry:
    """The reference and one plugin per ``(plugin name, priority, capability overrides)``."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    for plugin, priority, overrides in backends:
        caps = BackendCapabilities(
            **{"kinds": {"full"}, "device_types": {"cpu"}, "dtypes": {"float32"}, **overrides}
        )
        backend = Backend(name="k", capabilities=caps, priority=priority)
        reg.register_plugin(make_plugin(plugin, [backend]), name=plugin)
    return reg


@pytest.mark.parametrize("priority", [0, -1, -100])
def test_the_reference_ranks_last_whatever_the_priority_and_name(make_plugin, priority):
    reg = _with_reference(make_plugin, ("aaa", priority, {}), ("zzz", priority - 1, {}))
    choice = select(group_layers([SMALL]), reg, CPU).choices[0]
    assert choice.backend.qualified_name == "aaa:k"
    assert choice.outranked == ("zzz:k", "attn_core:reference")
    assert choice.downgraded_from == ()


@pytest.mark.parametrize("priority", [0, -5])
def test_falling_back_to_the_reference_is_a_downgrade_at_any_priority(make_plugin, priority):
    reg = _with_reference(make_plugin, ("zzz", priority, {"device_types": {"cuda"}}))
    groups = group_layers([SMALL])
    with pytest.warns(UserWarning) as record:
        choice = select(groups, reg, CPU, ExecutionConstraints(downgrade="warn")).choices[0]
    assert choice.backend.qualified_name == "attn_core:reference"
    assert choice.downgraded_from == ("zzz:k",)
    (message,) = [str(w.message) for w in record]
    assert "falls back to attn_core:reference (the reference, ranked last)" in message
    assert "higher-ranked backends were rejected: zzz:k: [device_type]" in message
    assert "priority" not in message  # a priority below the reference's 0 is no "higher" one
    with pytest.raises(SelectionError, match=r"\[downgrade policy: error\]"):
        select(groups, reg, CPU, ExecutionConstraints(downgrade="error"))


def test_a_rejected_reference_is_no_downgrade(make_plugin):
    # The reference has no graph mode full; a plugin below its priority serves the group.
    reg = _with_reference(make_plugin, ("low", -1, {"graph_modes": ALL_GRAPHS}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = select(
            group_layers([SMALL]),
            reg,
            CPU,
            ExecutionConstraints(downgrade="error", graph_mode="full"),
        )
    choice = plan.choices[0]
    assert choice.backend.qualified_name == "low:k"
    assert choice.downgraded_from == ()
    assert [r.code for r in choice.rejections_by_backend()["attn_core:reference"]] == ["graph_mode"]


# ------------------------------------------------------------------------------------------
# The downgrade policy lowers the graph mode: full -> decode -> none
# ------------------------------------------------------------------------------------------
def _graphs(make_plugin, *backends: tuple[str, int, set[str]], reference=True) -> Registry:
    """Stand-in full-attention backends on the CPU, each ``(plugin, priority, graph modes)``."""
    import attn_core.reference.plugin as ref

    reg = Registry(strict=True)
    if reference:
        reg.register_plugin(ref, name="attn_core")  # graph modes none and decode
    for plugin, priority, modes in backends:
        caps = BackendCapabilities(
            kinds={"full"}, device_types={"cpu"}, dtypes={"float32"}, graph_modes=modes
        )
        backend = Backend(name="k", capabilities=caps, priority=priority)
        reg.register_plugin(make_plugin(plugin, [backend]), name=plugin)
    return reg


def test_graph_mode_full_is_lowered_to_decode_with_a_warning(make_plugin):
    reg = _graphs(make_plugin, ("fast", 10, {"none", "decode"}))
    with pytest.warns(UserWarning) as record:
        plan = select(group_layers([SMALL]), reg, CPU, ExecutionConstraints(graph_mode="full"))
    assert plan.constraints.graph_mode is GraphMode.DECODE
    assert plan.graph_mode_requested is GraphMode.FULL
    assert plan.to_dict()["graph_mode"] == "decode"
    assert plan.to_dict()["graph_mode_requested"] == "full"
    assert _picked(plan) == {"full": "fast:k"}
    (message,) = [str(w.message) for w in record]
    assert message.startswith("graph mode lowered full -> decode: ")
    assert "no backend can serve layer group 'full'" in message
    assert "  fast:k:\n    - [graph_mode]" in message
    assert "  attn_core:reference:\n    - [graph_mode]" in message


def test_graph_mode_is_lowered_as_far_as_needed(make_plugin):
    reg = _graphs(make_plugin, ("eager", 0, {"none"}), reference=False)
    with pytest.warns(UserWarning, match="graph mode lowered full -> none: "):
        plan = select(group_layers([SMALL]), reg, CPU, ExecutionConstraints(graph_mode="full"))
    assert plan.constraints.graph_mode is GraphMode.NONE
    with pytest.warns(UserWarning, match="graph mode lowered decode -> none: "):
        plan = select(group_layers([SMALL]), reg, CPU, ExecutionConstraints(graph_mode="decode"))
    assert plan.constraints.graph_mode is GraphMode.NONE


def test_graph_mode_is_kept_when_every_group_has_a_backend_under_it(make_plugin):
    # The best backend lacks graph mode full, a lower one has it: the run keeps what it asked
    # for, and the backend downgrade warns as ever.
    reg = _graphs(make_plugin, ("top", 10, {"none", "decode"}), ("capt", 5, ALL_GRAPHS))
    with pytest.warns(UserWarning) as record:
        plan = select(group_layers([SMALL]), reg, CPU, ExecutionConstraints(graph_mode="full"))
    assert plan.constraints.graph_mode is GraphMode.FULL and plan.graph_mode_requested is None
    assert _picked(plan) == {"full": "capt:k"}
    assert plan.choices[0].downgraded_from == ("top:k",)
    (message,) = [str(w.message) for w in record]
    assert "falls back to capt:k (priority 5)" in message


def test_graph_mode_lowering_is_silent_under_allow(make_plugin):
    reg = _graphs(make_plugin, ("fast", 10, {"none", "decode"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = select(
            group_layers([SMALL]),
            reg,
            CPU,
            ExecutionConstraints(graph_mode="full", downgrade="allow"),
        )
    assert plan.constraints.graph_mode is GraphMode.DECODE


def test_graph_mode_lowering_is_refused_under_error(make_plugin):
    reg = _graphs(make_plugin, ("fast", 10, {"none", "decode"}))
    with pytest.raises(SelectionError) as info:
        select(
            group_layers([SMALL]),
            reg,
            CPU,
            ExecutionConstraints(graph_mode="full", downgrade="error"),
        )
    msg = str(info.value)
    assert msg.startswith("no backend can serve layer group 'full'")
    assert "graph_mode=full" in msg and "fast:k:" in msg
    assert (
        "graph mode decode would admit every group, but the downgrade policy is error: "
        "the graph mode is not lowered (run with graph mode decode, or downgrade warn) "
        "[downgrade policy: error]"
    ) in msg


def test_graph_mode_lowering_that_does_not_help_reports_the_requested_mode(make_plugin):
    reg = _graphs(make_plugin, ("fast", 10, {"none", "decode"}), reference=False)
    spec = SMALL.with_(dtype="float16")  # served by nothing, in any graph mode
    with pytest.raises(SelectionError) as info:
        select(group_layers([spec]), reg, CPU, ExecutionConstraints(graph_mode="full"))
    msg = str(info.value)
    assert "graph_mode=full" in msg and "[graph_mode]" in msg and "[dtype]" in msg
    assert "would admit" not in msg


# ------------------------------------------------------------------------------------------
# Reason codes and fixes, one backend at a time
# ------------------------------------------------------------------------------------------
def _codes(caps: dict, spec: LayerSpec, device=H200, constraints=None, **kw) -> list[tuple]:
    caps.setdefault("kinds", {spec.kind.value})
    # A CUDA backend of the 16-bit dtypes unless the test says otherwise (no defaults in core).
    caps.setdefault("device_types", {"cuda"})
    caps.setdefault("dtypes", {"bfloat16", "float16"})
    backend = Backend(name="b", capabilities=BackendCapabilities(**caps), plugin="t")
    rs = check_backend(backend, spec, device, constraints or ExecutionConstraints(), **kw)
    assert all(isinstance(r, Rejection) and r.backend == "t:b" for r in rs)
    return [(r.code, r.fix) for r in rs]


def _reasons(caps: dict, spec: LayerSpec, device=H200, constraints=None) -> list[str]:
    caps.setdefault("kinds", {spec.kind.value})
    caps.setdefault("device_types", {"cuda"})
    caps.setdefault("dtypes", {"bfloat16", "float16"})
    backend = Backend(name="b", capabilities=BackendCapabilities(**caps), plugin="t")
    rs = check_backend(backend, spec, device, constraints or ExecutionConstraints())
    return [str(r) for r in rs]


def test_reason_head_dim_cannot_serve_the_model_and_proposes_no_change():
    """A head dim is the model's: no hint proposes another one (issue 24 item 5)."""
    spec = GLOBAL.with_(head_dim=256)
    assert _reasons({"head_dims": {128, 64, 96}}, spec) == [
        "[head_dim] cannot serve this model: head_dim 256 (serves 64, 96, 128)"
    ]
    assert _codes({"head_dims": {64, 128}}, spec) == [("head_dim", None)]
    assert _reasons({"head_dims": {576}}, MLA) == [
        "[head_dim] cannot serve this model: head_dim_v 512 (serves 576)"
    ]


def test_values_of_another_width_need_the_capability():
    """A full layer with head_dim_v != head_dim (MiMo-V2-Flash) is refused by a backend that
    does not declare distinct_value_head_dim, even where both widths are in its head_dims (a
    kernel that assumes equal K and V strides would read the cache wrong); MLA is exempt."""
    spec = GLOBAL.with_(head_dim=128, head_dim_v=64)
    assert _reasons({"head_dims": {64, 128}}, spec) == [
        "[head_dim_v] cannot serve this model: head_dim_v 64 beside head_dim 128 (serves values "
        "as wide as queries and keys only)"
    ]
    assert _codes({"head_dims": {64, 128}, "distinct_value_head_dim": True}, spec) == []
    assert _codes({"head_dims": {576, 512}}, MLA) == []
    # a linear layer's key and value widths are its variant's (OLMo-Hybrid's GDN: 96 and 192)
    wide = GDN.with_(head_dim=96, head_dim_v=192)
    assert _codes({"linear_variants": {"gated_deltanet"}}, wide) == []


def test_reason_page_size():
    assert _codes({"page_sizes": {64, 128}}, GLOBAL) == [("page_size", "page_size 16 -> 64")]
    assert _codes({"page_sizes": {64}}, GLOBAL, page_size=64) == []
    # linear layers keep no paged KV: page sizes never reject them
    assert _codes({"page_sizes": {64}, "linear_variants": {"gated_deltanet"}}, GDN) == []


def test_reason_lists_are_sorted_numerically():
    backend = Backend(
        name="b",
        capabilities=BackendCapabilities(
            kinds={"full"},
            device_types={"cuda"},
            dtypes={"bfloat16", "float16"},
            page_sizes={128, 16, 32},
        ),
        plugin="t",
    )
    (r,) = check_backend(backend, GLOBAL.with_(page_size=8), H200, ExecutionConstraints())
    assert r.reason == "serves page sizes 16, 32, 128, the run uses 8"
    denied = ExecutionConstraints(allow={"zeta", "alpha", "t:x"})
    (r,) = check_backend(backend, GLOBAL, H200, denied)
    assert r.reason == "not in the allow list (alpha, t:x, zeta)"


def test_reason_compute_capability():
    got = _codes({"min_compute_capability": (9, 0)}, GLOBAL, device=A100)
    assert got == [("compute_capability", "a GPU with compute capability >= 9.0")]
    got = _codes({"max_compute_capability": (8, 9)}, GLOBAL, device=H200)
    assert got == [("compute_capability", "a GPU with compute capability <= 8.9")]
    got = _codes({}, GLOBAL, device=CPU)
    assert got == [("device_type", "run on a cuda device")]


def test_reason_dtype_is_the_models():
    spec = GLOBAL.with_(dtype="float32")
    assert _codes({"dtypes": {"bfloat16", "float16"}}, spec) == [("dtype", None)]
    assert _reasons({"dtypes": {"float16", "bfloat16"}}, spec) == [
        "[dtype] cannot serve this model: dtype float32 (serves bfloat16, float16)"
    ]


def test_reason_kv_dtype_fp8():
    fp8 = ExecutionConstraints(kv_dtype="fp8")
    assert _codes({}, GLOBAL, constraints=fp8) == [("kv_dtype", "kv_dtype fp8_e4m3 -> bfloat16")]
    assert _codes({"kv_dtypes": {"bfloat16", "fp8_e4m3"}}, GLOBAL, constraints=fp8) == []
    got = _codes({"kv_dtypes": {"fp8_e4m3"}}, GLOBAL, device=A100, constraints=fp8)
    assert got == [("device_fp8", None)]
    # linear layers keep no KV: an fp8 KV run does not reject a linear backend
    assert _codes({"linear_variants": {"gated_deltanet"}}, GDN, constraints=fp8) == []


def test_reason_kv_dtype_must_follow_dtype():
    """A backend without mixed KV dtypes serves fp16 over an fp16 cache and fp8 KV under any
    compute dtype, but not fp16 queries over a bf16 cache."""
    caps = {"dtypes": {"bfloat16", "float16"}, "kv_dtypes": {"bfloat16", "float16", "fp8_e4m3"}}
    strict = {**caps, "mixed_kv_dtypes": False}
    mixed = GLOBAL.with_(dtype="float16", kv_dtype="bfloat16")
    assert _codes(strict, mixed) == [("kv_dtype", "kv_dtype bfloat16 -> float16")]
    assert _codes(caps, mixed) == []
    assert _codes(strict, GLOBAL.with_(dtype="float16", kv_dtype="float16")) == []
    assert _codes(strict, GLOBAL.with_(dtype="float16", kv_dtype="fp8_e4m3")) == []


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"has_sinks": True}, "sinks"),
        ({"sliding_window": 128}, "sliding_window"),
        ({"attention_chunk_size": 64}, "chunked_attention"),
        ({"logits_soft_cap": 30.0}, "soft_cap"),
        ({"causal": False}, "non_causal"),
    ],
)
def test_reason_attention_features(change, code):
    assert _codes({}, GLOBAL.with_(**change)) == [(code, None)]
    (reason,) = _reasons({}, GLOBAL.with_(**change))
    assert reason.startswith(f"[{code}] cannot serve this model: "), reason


def test_reason_texts_of_model_features():
    assert _reasons({}, GLOBAL.with_(sliding_window=128)) == [
        "[sliding_window] cannot serve this model: sliding window 128 "
        "(serves full-context attention only)"
    ]
    assert _reasons({}, GLOBAL.with_(attention_chunk_size=64)) == [
        "[chunked_attention] cannot serve this model: chunked attention (chunks of 64 tokens) "
        "(has no chunk mask and takes no local virtual batches)"
    ]
    assert _reasons({"chunked_attention": True}, GLOBAL.with_(attention_chunk_size=64)) == []
    assert _reasons({}, GLOBAL.with_(logits_soft_cap=30.0)) == [
        "[soft_cap] cannot serve this model: logits soft-cap 30 (serves uncapped logits only)"
    ]
    assert _reasons({}, GLOBAL.with_(has_sinks=True)) == [
        "[sinks] cannot serve this model: attention sinks (serves attention without sinks only)"
    ]
    assert _reasons({}, GLOBAL.with_(causal=False)) == [
        "[non_causal] cannot serve this model: bidirectional attention (serves causal only)"
    ]
    assert _reasons({"causal": False, "non_causal": True}, GLOBAL) == [
        "[causal] cannot serve this model: causal attention (serves bidirectional only)"
    ]
    assert _reasons({"kinds": {"mla", "full"}}, GDN) == [
        "[kind] cannot serve this model: kind linear (serves full, mla)"
    ]


def test_run_time_knobs_keep_their_hints():
    """Page size, graph mode, KV dtype, draft tokens and the device are the run's to change."""
    assert _codes({"page_sizes": {64}}, GLOBAL) == [("page_size", "page_size 16 -> 64")]
    assert _codes({}, GLOBAL, constraints=ExecutionConstraints(graph_mode="full")) == [
        ("graph_mode", "graph_mode full -> none")
    ]
    assert _codes({}, GLOBAL, device=CPU) == [("device_type", "run on a cuda device")]
    assert _codes({"kv_dtypes": {"float16"}}, GLOBAL) == [
        ("kv_dtype", "kv_dtype bfloat16 -> float16")
    ]


def test_reason_linear_and_speculative():
    mamba = GDN.with_(linear_variant="mamba2")
    assert _codes({"linear_variants": {"gated_deltanet"}}, mamba) == [("linear_variant", None)]
    assert _reasons({"linear_variants": {"kda", "gated_deltanet"}}, mamba) == [
        "[linear_variant] cannot serve this model: linear variant mamba2 "
        "(serves gated_deltanet, kda)"
    ]
    spec3 = ExecutionConstraints(speculative_tokens=3)
    got = _codes(
        {"linear_variants": {"gated_deltanet"}, "max_speculative_tokens": 2}, GDN, constraints=spec3
    )
    assert got == [("speculative", "speculative_tokens 3 -> 2")]
    replay = ExecutionConstraints(speculative_tokens=2, spec_verify_strategy="replay")
    got = _codes(
        {"linear_variants": {"gated_deltanet"}, "max_speculative_tokens": 2},
        GDN,
        constraints=replay,
    )
    assert got == [("spec_verify_strategy", "spec_verify_strategy replay -> native")]
    bf16_state = GDN.with_(state_dtype="bfloat16")
    got = _codes({"linear_variants": {"gated_deltanet"}}, bf16_state)
    assert got == [("state_dtype", None)]
    assert _reasons({"linear_variants": {"gated_deltanet"}}, bf16_state) == [
        "[state_dtype] cannot serve this model: state dtype bfloat16 (serves float32)"
    ]


def test_reason_unavailable_and_lists():
    caps = BackendCapabilities(kinds={"full"}, device_types={"cuda"}, dtypes={"bfloat16"})
    b = Backend(
        name="b",
        capabilities=caps,
        plugin="t",
        available=False,
        unavailable_reason="flashinfer is not importable: No module named 'flashinfer'",
    )
    (r,) = check_backend(b, GLOBAL, H200, ExecutionConstraints())
    assert r.code == "unavailable" and "No module named 'flashinfer'" in str(r)
    ok = Backend(name="b", capabilities=caps, plugin="t")
    assert [
        r.code for r in check_backend(ok, GLOBAL, H200, ExecutionConstraints(deny={"t:b"}))
    ] == ["denied"]
    assert [r.code for r in check_backend(ok, GLOBAL, H200, ExecutionConstraints(allow={"x"}))] == [
        "not_allowed"
    ]
    assert [
        r.code for r in check_backend(ok, GLOBAL, H200, ExecutionConstraints(deterministic=True))
    ] == ["deterministic"]


def test_explain_says_the_graph_mode_was_lowered(make_plugin):
    from attn_core.cli import format_plan

    reg = _graphs(make_plugin, ("fast", 10, {"none", "decode"}))
    plan = select(group_layers([SMALL]), reg, CPU, _allow(graph_mode="full"))
    assert "graph mode: decode (lowered from full)   " in format_plan(plan)
    plan = select(group_layers([SMALL]), reg, CPU, _allow(graph_mode="decode"))
    assert "graph mode: decode   " in format_plan(plan)


def test_tuning_from_another_device_or_graph_mode_is_named_in_a_warning(five, groups, tmp_path):
    """A tuning file keeps the device and the graph mode it was timed under; a plan for another
    device, or a run with another graph mode, warns that its ranking is foreign (and still
    uses it)."""
    tuning = TuningData(device=H200.short(), graph_mode="none")
    tuning.record("attn_core:reference", GLOBAL, 5.0)
    path = tmp_path / "tuning.json"
    tuning.save(path)
    loaded = TuningData.load(path)
    assert (loaded.device, loaded.graph_mode) == (H200.short(), "none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same device and graph mode: silent
        select(groups, five, H200, _allow(), tuning=loaded)
    h100 = DeviceCapabilities.target("h100")
    with pytest.warns(
        UserWarning, match=r"measured on NVIDIA H200 .*, the plan is for NVIDIA H100"
    ):
        plan = select(groups, five, h100, _allow(), tuning=loaded)
    assert _picked(plan)["full"] == "attn_core:reference"  # still ranked by it
    with pytest.warns(UserWarning, match=r"timed under graph mode none, the run asks for decode"):
        select(groups, five, H200, _allow(graph_mode="decode"), tuning=loaded)


def test_step_size_buckets_out_of_order_are_refused(make_caps):
    """A step runs on the first bucket whose bound holds it: with the bounds out of order a
    step of 4 went to the backend of the 64 bucket, in silence."""
    from attn_core.selector import PhaseChoice
    from attn_core.specs import Phase

    big, small = (Backend(name=n, capabilities=make_caps()) for n in ("big", "small"))
    kw = dict(phase=Phase.DECODE, backend=big, rejected=(), outranked=())
    with pytest.raises(ValueError, match=r"by_step_size bounds \[64, 8\]: expected ascending"):
        PhaseChoice(**kw, by_step_size=((64, big), (8, small)))
    choice = PhaseChoice(**kw, by_step_size=((8, small), (64, big)))
    assert choice.backend_for_step(4).name == "small" and choice.backend_for_step(9).name == "big"
