"""BackendCapabilities: the fields a backend must state, and what a missing one does.

``device_types`` and ``dtypes`` have no default: a default would silently narrow a backend (a CPU
backend that left ``device_types`` out used to be CUDA-only, a float32 one that left ``dtypes``
out was never chosen for a float32 model). Leaving one out is an error that names the field, and
a plugin that does it is quarantined with that error as its reason.
"""

from __future__ import annotations

import pytest

from attn_core.backend import Backend, BackendCapabilities
from attn_core.selector import check_backend
from attn_core.specs import DeviceCapabilities, ExecutionConstraints, LayerSpec


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"dtypes": {"float32"}}, "device_types"),
        ({"device_types": {"cpu"}}, "dtypes"),
    ],
)
def test_a_required_field_left_out_is_an_error_naming_it(given, missing):
    with pytest.raises(ValueError) as info:
        BackendCapabilities(kinds={"full"}, **given)
    message = str(info.value)
    assert message.startswith(f"BackendCapabilities: {missing} is required")
    assert "there is no default" in message
    example = "{'cpu', 'cuda'}" if missing == "device_types" else "{'bfloat16', 'float16'}"
    assert example in message


def test_both_left_out_names_both():
    with pytest.raises(ValueError, match=r"device_types and dtypes are required"):
        BackendCapabilities(kinds={"full"})


@pytest.mark.parametrize("field", ["device_types", "dtypes"])
def test_none_is_not_any_for_a_required_field(field):
    given = {"device_types": {"cpu"}, "dtypes": {"float32"}, field: None}
    with pytest.raises(ValueError, match=rf"{field}=None: .*name them"):
        BackendCapabilities(kinds={"full"}, **given)


@pytest.mark.parametrize("field", ["device_types", "dtypes"])
def test_an_empty_required_field_is_an_error(field):
    given = {"device_types": {"cpu"}, "dtypes": {"float32"}, field: set()}
    with pytest.raises(ValueError, match=rf"{field}=set\(\): .*at least one"):
        BackendCapabilities(kinds={"full"}, **given)


def test_a_cpu_float32_backend_stated_explicitly_is_chosen_on_cpu():
    caps = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
    backend = Backend(name="naive", capabilities=caps, plugin="acme")
    spec = LayerSpec(kind="full", num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    cpu = DeviceCapabilities.target("cpu")
    assert check_backend(backend, spec, cpu, ExecutionConstraints()) == []


def test_a_plugin_that_leaves_device_types_out_is_quarantined_saying_why(registry, make_plugin):
    def register(register):
        caps = BackendCapabilities(kinds={"full"}, dtypes={"float32"})  # a CPU backend, it meant
        register(Backend(name="naive", capabilities=caps))

    registry.register_plugin(make_plugin("acme", register=register), name="acme")
    assert "acme" not in registry.plugins
    q = registry.quarantined["acme"]
    assert q.stage == "register"
    assert "BackendCapabilities: device_types is required" in q.reason


@pytest.mark.parametrize("field", ["distinct_value_head_dim", "sinks", "causal"])
def test_a_flag_that_is_not_a_bool_is_an_error_naming_it(field):
    """A string such as "no" is truthy: taken as given it would declare what the author meant
    to deny."""
    with pytest.raises(ValueError, match=rf"{field}='no': expected True or False"):
        BackendCapabilities(
            kinds={"full"}, device_types={"cpu"}, dtypes={"float32"}, **{field: "no"}
        )


def test_available_that_is_not_a_bool_is_an_error_naming_it():
    """``available="False"`` is truthy: the backend was selected although its plugin said it
    could not run."""
    caps = BackendCapabilities(kinds={"full"}, device_types={"cpu"}, dtypes={"float32"})
    with pytest.raises(ValueError, match=r"Backend 'x': available='False': expected True or False"):
        Backend(name="x", capabilities=caps, available="False", unavailable_reason="no driver")
