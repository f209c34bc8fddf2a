"""GDN / KDA decode and speculative verify kernels against fla-core's naive recurrences.

Without CUDA the kernels run in Triton's CPU interpreter (see ``kernel_device``); with CUDA the
same small-shape tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEV, K  # first: picks the interpreter on a machine without CUDA
from triton_ssm_refs import delta_rule_ref

B, HK, HV, S = 3, 2, 4, 7
IDX = [5, -1, 2]  # a padding row in the middle
UNTOUCHED = [0, 1, 3, 4, 6]


def _inputs(*, T, dk, dv, kda, state_dtype, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = r(B, T, HK, dk), r(B, T, HK, dk)
    v = r(B, T, HV, dv)
    g = -torch.rand(B, T, HV, dk, generator=gen) if kda else -torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    state = (r(S, HV, dk, dv) * 0.5).to(state_dtype)
    idx = torch.tensor(IDX, dtype=torch.int32)
    to = lambda t: t.to(DEV)  # noqa: E731
    return [to(t.to(dtype)) for t in (q, k, v)] + [to(g), to(beta), to(state), to(idx)]


def _tol(state_dtype):
    return (
        dict(atol=3e-2, rtol=2e-2) if state_dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )


def _valid():
    return [(b, s) for b, s in enumerate(IDX) if s >= 0]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(("dk", "dv", "block_v"), [(16, 32, None), (32, 16, 8), (24, 20, 8)])
def test_decode_matches_fla_naive(state_dtype, kda, dk, dv, block_v):
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=dk, dv=dv, kda=kda, state_dtype=state_dtype)
    before = state.clone()
    fn = K.kda_decode if kda else K.gdn_decode
    out = fn(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, idx, block_v=block_v)
    h0 = before[idx.clamp(min=0).long()]
    o_ref, h_ref = delta_rule_ref(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), h0.cpu(), kda=kda)
    for b, s in _valid():
        torch.testing.assert_close(out[b].float().cpu(), o_ref[b, 0], **_tol(state_dtype))
        torch.testing.assert_close(state[s].float().cpu(), h_ref[b, 0], **_tol(state_dtype))
    assert torch.count_nonzero(out[1]) == 0, "padding row must get zeros"
    assert torch.equal(state[UNTOUCHED], before[UNTOUCHED]), "slots not in the batch changed"


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("programs_per_sm", [1, 2], ids=["one per SM", "two per SM"])
def test_decode_grids_compute_the_same_states(kda, programs_per_sm):
    """A persistent grid whose programs loop over several items (and prefetch the next) runs
    the same float operations per item as the default's one program per item: outputs and
    states equal the default grid's bit for bit."""
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=16, dv=32, kda=kda, state_dtype=torch.float32)
    fn = K.kda_decode if kda else K.gdn_decode
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    default_state = state.clone()
    want = fn(*args, default_state, idx, block_v=8)
    out = fn(*args, state, idx, block_v=8, programs_per_sm=programs_per_sm)
    assert torch.equal(out, want)
    assert torch.equal(state, default_state)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_decode_out_of_place_writes_the_out_slots_and_keeps_the_read_ones(kda):
    # request 0 reads slot 5 and writes slot 1; request 1 is padding (its out slot 4 stays);
    # request 2 reads slot 2 and stores nothing (-1)
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=16, dv=32, kda=kda, state_dtype=torch.float32)
    fn = K.kda_decode if kda else K.gdn_decode
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    in_place = state.clone()
    o_in = fn(*args, in_place, idx, block_v=16)
    before = state.clone()
    out_idx = torch.tensor([1, 4, -1], dtype=torch.int32, device=DEV)
    o_out = fn(*args, state, idx, block_v=16, state_indices_out=out_idx)
    assert torch.equal(o_out, o_in), "where the state goes changed the outputs"
    assert torch.equal(state[1], in_place[5]), "request 0's new state is not in its out slot"
    kept = [0, 2, 3, 4, 5, 6]  # the read slots, the padding row's out slot, the others
    assert torch.equal(state[kept], before[kept])
    with pytest.raises(ValueError, match=r"state_indices_out: expected shape \[3\]"):
        fn(*args, state, idx, state_indices_out=out_idx[:2])


def test_decode_options_scale_no_l2norm_strided_inputs():
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=16, dv=16, kda=False, state_dtype=torch.float32)
    before = state.clone()
    # q and k as views into one fused projection: outer strides differ from a packed tensor.
    qk = torch.cat([q[:, 0], k[:, 0]], dim=-1)
    qv, kv = qk[..., :16], qk[..., 16:]
    assert not qv.is_contiguous()
    out = K.gdn_decode(qv, kv, v[:, 0], g[:, 0], beta[:, 0], state, idx, scale=0.3,
                       use_qk_l2norm=False)  # fmt: skip
    o_ref, h_ref = delta_rule_ref(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                  before[[5, 0, 2]].cpu(), kda=False, scale=0.3,
                                  l2norm=False)  # fmt: skip
    for b, s in _valid():
        torch.testing.assert_close(out[b].cpu(), o_ref[b, 0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[s].cpu(), h_ref[b, 0], atol=1e-4, rtol=1e-4)


def test_decode_writes_into_given_out_bf16_activations():
    q, k, v, g, beta, state, idx = _inputs(
        T=1, dk=16, dv=16, kda=False, state_dtype=torch.float32, dtype=torch.bfloat16
    )
    out = torch.full((B, HV, 16), 7.0, dtype=torch.bfloat16, device=DEV)
    before = state.clone()
    res = K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, idx, out=out)
    assert res is out
    o_ref, _ = delta_rule_ref(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                              before[[5, 0, 2]].cpu(), kda=False)  # fmt: skip
    torch.testing.assert_close(out[0].float().cpu(), o_ref[0, 0], atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_verify_native_outputs_and_intermediate_states(state_dtype, kda):
    T = 4
    q, k, v, g, beta, state, idx = _inputs(T=T, dk=16, dv=32, kda=kda, state_dtype=state_dtype)
    before = state.clone()
    inter = torch.zeros(B, T, HV, 16, 32, dtype=torch.float32, device=DEV)
    fn = K.kda_verify_native if kda else K.gdn_verify_native
    out = fn(q, k, v, g, beta, state, idx, inter)
    assert torch.equal(state, before), "verify must not write the slot"
    h0 = before[idx.clamp(min=0).long()]
    o_ref, h_ref = delta_rule_ref(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), h0.cpu(), kda=kda)
    tol = dict(atol=2e-4, rtol=2e-4)  # fp32 intermediates; h0 rounded identically on both sides
    for b, _ in _valid():
        torch.testing.assert_close(out[b].cpu(), o_ref[b], **tol)
        torch.testing.assert_close(inter[b].cpu(), h_ref[b], **tol)
    assert torch.count_nonzero(out[1]) == 0
    assert torch.count_nonzero(inter[1]) == 0, "padding row must not store states"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_native_and_replay_commit_identical_for_every_accepted_count(state_dtype, kda):
    T = 3
    q, k, v, g, beta, state, idx = _inputs(T=T, dk=16, dv=16, kda=kda, state_dtype=state_dtype)
    h0 = state[idx.clamp(min=0).long()].clone()
    _, h_ref = delta_rule_ref(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), h0.cpu(), kda=kda)
    native = K.kda_verify_native if kda else K.gdn_verify_native
    replay = K.kda_verify_replay if kda else K.gdn_verify_replay
    replay_commit = K.kda_replay_commit if kda else K.gdn_replay_commit
    inter = torch.empty(B, T, HV, 16, 16, dtype=state_dtype, device=DEV)
    out_native = native(q, k, v, g, beta, state, idx, inter)
    out_replay = replay(q, k, v, g, beta, state, idx)
    assert torch.equal(out_native, out_replay)
    for n in range(T + 1):
        num_acc = torch.tensor([n, T, max(n - 1, 0)], dtype=torch.int32, device=DEV)
        s_native, s_replay = state.clone(), state.clone()
        K.gdn_commit(inter, num_acc, s_native, idx)
        replay_commit(q, k, v, g, beta, num_acc, s_replay, idx)
        assert torch.equal(s_native, s_replay), f"num_accepted={num_acc.tolist()}"
        assert torch.equal(s_native[UNTOUCHED], state[UNTOUCHED])
        for b, s in _valid():
            n_b = int(num_acc[b])
            want = h0[b].float().cpu() if n_b == 0 else h_ref[b, n_b - 1]
            torch.testing.assert_close(s_native[s].float().cpu(), want, **_tol(state_dtype))


def test_decode_equals_one_token_verify_plus_commit():
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=16, dv=16, kda=False, state_dtype=torch.float32)
    s1, s2 = state.clone(), state.clone()
    o1 = K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s1, idx)
    inter = torch.empty(B, 1, HV, 16, 16, device=DEV)
    o2 = K.gdn_verify_native(q, k, v, g, beta, s2, idx, inter)
    K.gdn_commit(inter, torch.ones(B, dtype=torch.int32, device=DEV), s2, idx)
    assert torch.equal(o1, o2[:, 0])
    assert torch.equal(s1, s2)


def test_errors_name_expected_and_got():
    q, k, v, g, beta, state, idx = _inputs(T=1, dk=16, dv=16, kda=False, state_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"g: expected shape \[3, 4\].*got \[3, 4, 16\]"):
        K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], torch.zeros(3, 4, 16, device=DEV), beta[:, 0],
                     state, idx)  # fmt: skip
    with pytest.raises(ValueError, match=r"ssm_state: expected shape \[\*, 4, 16, 16\]"):
        K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state[:, :2], idx)
    with pytest.raises(TypeError, match=r"ssm_state: expected dtype.*got float16"):
        K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.half(), idx)
    with pytest.raises(ValueError, match="multiple of key heads"):
        K.gdn_decode(q[:, 0, :1].repeat(1, 3, 1), k[:, 0, :1].repeat(1, 3, 1), v[:, 0],
                     g[:, 0], beta[:, 0], state, idx)  # fmt: skip
    with pytest.raises(ValueError, match=r"state_indices: expected shape \[3\]"):
        K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, idx[:2])
    with pytest.raises(ValueError, match="last 2 dim"):
        K.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                     state.transpose(2, 3).contiguous().transpose(2, 3), idx)  # fmt: skip
