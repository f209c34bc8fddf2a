"""Lightning attention and the short conv through the runtime and the reference backend.

- The bound call a variant does not have is refused, naming the layer: ``conv1d`` of a
  lightning layer (no conv), ``forward`` of a short-conv layer (its core is the conv alone).
- The reference's fixed-shape decode step (``decode_linear_step``) equals the ragged op.
- Speculative verify keeps the accepted prefix: lightning's SSM state, the short conv's conv
  state, against running only the accepted tokens.
"""

from __future__ import annotations

import pytest
import torch

from attn_core.errors import BackendInputError
from attn_core.reference import plugin as ref
from attn_core.registry import Registry
from attn_core.specs import DeviceCapabilities, LayerSpec
from attn_core.testing.harness import Limits, Side
from attn_core.testing.workloads import Step, conv_params, layer_inputs, to_device

CPU = DeviceCapabilities.target("cpu")
LIGHTNING = LayerSpec(
    kind="linear",
    linear_variant="lightning",
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    head_dim_v=4,
    dtype="float32",
)
SHORT_CONV = LayerSpec(
    kind="linear",
    linear_variant="short_conv",
    num_heads=1,
    num_kv_heads=1,
    head_dim=12,
    conv_kernel_size=3,
    conv_channels=12,
    dtype="float32",
)


def _side(spec: LayerSpec, spec_tokens: int = 0, **kw) -> Side:
    reg = Registry(strict=True)
    reg.register_plugin(ref, name="attn_core")
    return Side(
        "reference",
        reg.resolve("attn_core:reference"),
        reg,
        spec,
        num_layers=1,
        limits=Limits(max_batch=4, max_tokens=32, max_len=32, spec_tokens=spec_tokens),
        device=torch.device("cpu"),
        device_caps=CPU,
        **kw,
    )


def test_lightning_has_no_conv_and_short_conv_has_no_forward() -> None:
    gen = torch.Generator().manual_seed(0)
    side = _side(LIGHTNING)
    batch = side.begin(Step([(0, 3)], add=(0,)))
    binding = side.runtime.binding(0)
    with pytest.raises(TypeError, match="layer 0 is linear lightning: it has no conv"):
        binding.conv1d(torch.zeros(3, 4), torch.zeros(4, 3))
    side.finish(Step([(0, 3)]), batch, None)

    side = _side(SHORT_CONV)
    batch = side.begin(Step([(0, 3)], add=(0,)))
    binding = side.runtime.binding(0)
    x = torch.randn(3, 1, 12, generator=gen)
    with pytest.raises(BackendInputError, match="forward of a short-conv layer"):
        binding.forward(x, x, x)


@pytest.mark.parametrize("spec", [LIGHTNING, SHORT_CONV], ids=["lightning", "short_conv"])
def test_decode_path_equals_ragged_path_and_verify_keeps_the_accepted_prefix(spec) -> None:
    """Two sides fed the same tokens: one decodes them one by one (fixed-shape decode path),
    the other verifies them as drafts and accepts a prefix; the states must agree."""
    gen = torch.Generator().manual_seed(1)
    conv = tuple(conv_params(spec, gen)) if spec.has_conv else None
    prompt = to_device(layer_inputs(spec, 5, gen), spec, torch.device("cpu"))
    drafts = to_device(layer_inputs(spec, 3, gen), spec, torch.device("cpu"))
    if "slope" in drafts:
        drafts["slope"] = prompt["slope"]  # one layer: one slope
    accepted = 2
    plain, spec_side = _side(spec), _side(spec, spec_tokens=2, strategy="native")
    outs = {}
    for side in (plain, spec_side):
        step = Step([(0, 5)], add=(0,))
        batch = side.begin(step)
        outs[id(side), "prefill"] = side.forward(0, prompt, None, conv=conv)[0]
        side.finish(step, batch, None)
    decoded = []
    for t in range(accepted):
        step = Step([(0, 1)])
        batch = plain.begin(step)
        one = {n: (v if n == "slope" else v[t : t + 1]) for n, v in drafts.items()}
        decoded.append(plain.forward(0, one, None, conv=conv)[0])
        plain.finish(step, batch, None)
    step = Step([(0, 3)], spec_tokens=2)
    batch = spec_side.begin(step)
    verified = spec_side.forward(0, drafts, None, conv=conv)[0]
    spec_side.finish(step, batch, torch.tensor([accepted], dtype=torch.int32))
    torch.testing.assert_close(verified[:accepted], torch.cat(decoded), atol=1e-5, rtol=1e-5)
    a, b = plain.state.state_slots.layer(0), spec_side.state.state_slots.layer(0)
    slot_a, slot_b = plain.state.slot(0), spec_side.state.slot(0)
    torch.testing.assert_close(a.conv[slot_a], b.conv[slot_b], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.ssm[slot_a], b.ssm[slot_b], atol=1e-5, rtol=1e-5)
    kept = a.ssm if spec.has_ssm_state else a.conv
    assert kept[slot_a].abs().sum() > 0  # the compared state is really written
