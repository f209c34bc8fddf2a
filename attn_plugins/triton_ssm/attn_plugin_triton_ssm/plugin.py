"""attn-core plugin wiring of the Triton SSM kernels: backends ``triton_ssm`` (Gated DeltaNet,
KDA, Mamba2) and ``triton_ssm_mamba1`` (Mamba1) for linear layers.

Entry point ``attn_core = triton_ssm`` (qualified backend names ``triton_ssm:triton_ssm`` and
``triton_ssm:triton_ssm_mamba1``). Mamba1 is a backend of its own because its value width is 1
(one head per inner channel): advertising head dim 1 on ``triton_ssm`` would also admit Gated
DeltaNet, KDA and Mamba2 layers of that width, which those kernels are not tested for. One
context serves every layer of a linear group; per step it picks the kernels by ``batch.mode``:

============ ===================================================================================
mode         kernels
============ ===================================================================================
``decode``   ``gdn_decode`` / ``kda_decode`` / ``mamba2_decode`` / ``mamba1_decode`` and
             ``causal_conv1d_update``
             over the full padded batch (``state_indices == -1`` rows are padding); no host
             reads, so the step can be captured in a CUDA graph (graph mode ``decode``).
``prefill``  ``gdn_prefill`` / ``kda_prefill`` / ``mamba2_prefill`` / ``mamba1_scan`` over the
             packed requests,
``mixed``    a decode being a sequence of length one (the BatchBuilder does not order decodes
             first, so one varlen call covers any order). The conv runs as a vectorised gather
             in torch, planned once per step in :meth:`TritonSSMContext.prepare`.
``verify``   ``*_verify_native`` (per-token states in the workspace) or ``*_verify_replay``
             (outputs only) by ``ExecutionConstraints.spec_verify_strategy`` (default native);
             the conv runs with ``update_state=False``. :meth:`TritonSSMContext.commit_speculative`
             then writes the accepted prefix's conv and recurrent state into each slot.
============ ===================================================================================

Requests with ``has_initial_state`` False (no cached tokens) start from a zero state: the
context zeroes their slots (recurrent) / their gathered conv window before the prefill kernels.

Lightning attention (MiniMax-01, ``S = e^{-slope} S + k v^T``, ``o = S^T q * scale``) is Mamba2's
recurrence with ``dt = 1``, ``A = -slope`` (``A_log = log slope``, no softplus), ``B = k``,
``C = q * scale``, ``x = v`` and one group per head: it runs through the Mamba2 kernels (decode,
SSD prefill, per-token verify in both strategies). The gated short conv (LFM2) is ``conv1d``
alone (every mode above, ``activation=None``); its ``forward`` is refused.

The kernels (and so triton) are imported on first use, never at plugin import: ``attn list``
stays fast, and tests can set ``TRITON_INTERPRET`` first.

Test-only CPU mode: with ``ATTN_TRITON_SSM_INTERPRET=1`` in the environment when the plugin
registers, the backend advertises ``device_types={"cpu"}`` (instead of ``{"cuda"}``), sets
``TRITON_INTERPRET=1`` before importing the kernels, and runs them in Triton's interpreter on CPU
tensors. It is slow and meant for tests at small shapes only.
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from attn_core.backend import Backend, BackendCapabilities, SelfCheck
from attn_core.batch import AttentionBatch, BatchMode
from attn_core.context import WorkspaceRequirement
from attn_core.errors import BackendInputError
from attn_core.hookspecs import hookimpl
from attn_core.options import OptionSpec
from attn_core.specs import (
    DeviceCapabilities,
    ExecutionConstraints,
    GraphMode,
    LayerGroup,
    LayerKind,
    LinearVariant,
    torch_dtype,
)
from attn_plugin_triton_ssm import compat

if TYPE_CHECKING:
    from attn_core.binding import LayerAttentionBinding
    from attn_core.workspace import Workspace

__all__ = [
    "ATTN_CORE_API_VERSION",
    "BACKEND_NAME",
    "ENV_INTERPRET",
    "HEAD_DIMS",
    "MAMBA1_BACKEND_NAME",
    "MAMBA1_HEAD_DIMS",
    "MAX_SPECULATIVE_TOKENS",
    "TritonSSMContext",
    "attn_core_allocate_context",
    "attn_core_bind_forward",
    "attn_core_register_backends",
    "attn_core_self_check",
    "attn_core_workspace_requirements",
    "capabilities",
    "kernels",
    "verify_state_buffer_name",
]

ATTN_CORE_API_VERSION = "1.2"  # attn_core_self_check
BACKEND_NAME = "triton_ssm"
#: Set to ``1`` to run the kernels in Triton's CPU interpreter (tests only, see module doc).
ENV_INTERPRET = "ATTN_TRITON_SSM_INTERPRET"
#: Head dims (``head_dim`` and ``head_dim_v``) advertised: the kernels tile the state as
#: ``[next_pow2(Dk), BV]`` in registers; fla's chunk kernels take K <= 256.
HEAD_DIMS = frozenset({16, 32, 64, 128, 256})
MAMBA1_BACKEND_NAME = "triton_ssm_mamba1"
#: Mamba1's ``head_dim`` (d_state: the kernel tiles ``[BD, next_pow2(N)]``; models use 16) and
#: ``head_dim_v`` (always 1).
MAMBA1_HEAD_DIMS = frozenset({1, 8, 16, 32, 64})
MAX_SPECULATIVE_TOKENS = 7

_VERIFY_STATES = "verify_states"
_ACTIVATIONS = (None, "silu", "swish")
_kernels: ModuleType | None = None


def _interpret_requested() -> bool:
    return os.environ.get(ENV_INTERPRET, "").strip().lower() in ("1", "true", "yes", "on")


def kernels() -> ModuleType:
    """``attn_plugin_triton_ssm.kernels``, imported on first use (and so triton with it)."""
    global _kernels
    if _kernels is None:
        if _interpret_requested():
            # Must precede the first triton.jit: the decorator picks interpreter vs compiler.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from attn_plugin_triton_ssm import kernels as module

        _kernels = module
    return _kernels


# ------------------------------------------------------------------------------------------
# Advertisement
# ------------------------------------------------------------------------------------------
#: The families whose prefill runs fla-core's chunk stages: not served where fla is absent.
FLA_VARIANTS = frozenset({"gated_deltanet", "kda"})
#: The families our own kernels serve end to end, with or without fla.
OWN_VARIANTS = frozenset({"mamba2", "lightning", "short_conv"})


def capabilities(
    *, interpret: bool = False, mamba1: bool = False, fla: bool = True
) -> BackendCapabilities:
    """What the backend serves; ``interpret`` is the test-only CPU (Triton interpreter) mode,
    ``mamba1`` the ``triton_ssm_mamba1`` backend's; ``fla``: whether fla-core is importable
    (without it, not :data:`FLA_VARIANTS`)."""
    if mamba1:
        variants = {"mamba1"}
    else:
        variants = set(OWN_VARIANTS | FLA_VARIANTS) if fla else set(OWN_VARIANTS)
    return BackendCapabilities(
        kinds={"linear"},
        linear_variants=variants,
        device_types={"cpu"} if interpret else {"cuda"},
        min_compute_capability=None if interpret else (8, 0),
        dtypes={"float32", "bfloat16", "float16"},
        state_dtypes={"float32", "bfloat16"},
        head_dims=MAMBA1_HEAD_DIMS if mamba1 else HEAD_DIMS,
        graph_modes={GraphMode.NONE, GraphMode.DECODE},
        max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
        spec_verify_strategies={"native", "replay"},
    )


def _unavailable_reason(interpret: bool) -> str | None:
    """Why the kernels cannot run in this process, from metadata only (imports nothing heavy)."""
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError) as exc:  # a broken install raises here
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    if not found:
        return "triton is not importable: no module named 'triton' (pip install triton)"
    if interpret:
        return None
    if not torch.cuda.is_available():
        return (
            "no CUDA device (torch.cuda.is_available() is False); the Triton kernels need one. "
            f"For tests only, {ENV_INTERPRET}=1 runs them in Triton's CPU interpreter"
        )
    return None


#: The ``triton_ssm`` backend's options (``--option triton_ssm.ssd_states=activations``).
OPTIONS = {
    "ssd_states": OptionSpec(
        str,
        "float32",
        "the dtype the Mamba2 / lightning SSD prefill stores its entering states in between "
        "its kernels: float32 (exact as the carried state) or activations (the layer's dtype, "
        "as mamba_ssm stores them: 1.2x the prefill rate at the granite-4.0-h shape on the "
        "H200, the same error against a float32 reference there); carried and final states "
        "stay float32",
        choices=("float32", "activations"),
    ),
    "ssd_dots": OptionSpec(
        str,
        "split",
        "how the Mamba2 / lightning SSD prefill feeds its float32 factors (decay times dt, the "
        "entering state) to the 16-bit tensor-core dots: split (hi + lo halves, two dots, "
        "float32-exact operands) or activations (rounded to the layer's dtype, one dot, the "
        "entering states stored in it too, as mamba_ssm computes: about 2x the float32 "
        "reference's error for 1.2-1.4x the rate at the granite-4.0-h shape on the H200)",
        choices=("split", "activations"),
    ),
}


@hookimpl
def attn_core_register_backends(register) -> None:
    interpret = _interpret_requested()
    reason = _unavailable_reason(interpret)
    no_fla = compat.missing()
    if no_fla:
        left_out = " and ".join(sorted(FLA_VARIANTS))
        no_fla += f": {left_out} are not served (their prefill runs fla's chunk stages)"
    register(
        Backend(
            name=BACKEND_NAME,
            capabilities=capabilities(interpret=interpret, fla=no_fla is None),
            priority=100,
            description=(
                "Triton decode / speculative-verify kernels for Gated DeltaNet, KDA, Mamba2 and "
                "lightning attention (through Mamba2's), the short conv's conv, with fla-core "
                "chunked prefill" + (" (Triton CPU interpreter: tests only)" if interpret else "")
            ),
            available=reason is None,
            unavailable_reason=reason,
            # whether fla-core's internal stages (compat.py) serve GDN prefill, and why not;
            # without fla at all, which families are left out
            notes=no_fla or compat.note(),
            option_schema=OPTIONS,
        )
    )
    register(
        Backend(
            name=MAMBA1_BACKEND_NAME,
            capabilities=capabilities(interpret=interpret, mamba1=True),
            priority=100,
            description=(
                "Triton Mamba1 selective scan (decode, prefill, speculative verify) for Jamba "
                "and Falcon-Mamba" + (" (Triton CPU interpreter: tests only)" if interpret else "")
            ),
            available=reason is None,
            unavailable_reason=reason,
        )
    )


@hookimpl
def attn_core_self_check(backend: Backend, device: torch.device) -> SelfCheck | None:
    """fla's internal stages against its public chunk functions on ``device`` now rather than
    at the first prefill (``attn list --self-check``); the Mamba1 backend has none."""
    if backend.name != BACKEND_NAME:
        return None
    failed = compat.self_check_now(device)
    return None if failed is None else SelfCheck(compat.note(), failed)


# ------------------------------------------------------------------------------------------
# Allocation
# ------------------------------------------------------------------------------------------
def verify_state_buffer_name(layer_index: int) -> str:
    """Workspace key of layer ``layer_index``'s native-verify intermediate states."""
    return f"{_VERIFY_STATES}.{layer_index}"


def _strategy(constraints: ExecutionConstraints) -> str:
    return constraints.spec_verify_strategy or "native"


@hookimpl
def attn_core_workspace_requirements(
    backend: Backend,
    group: LayerGroup,
    device: DeviceCapabilities,
    constraints: ExecutionConstraints,
) -> list[WorkspaceRequirement]:
    """Native verify keeps, per layer, the state after every draft position of every request
    until ``commit_speculative``: ``[max_batch_size, k + 1, Hv, Dk, Dv]`` in the state dtype
    (``Hv * Dk * Dv * (k + 1)`` elements per request and layer; the replay strategy needs none)."""
    spec = group.spec
    k = constraints.speculative_tokens
    if k == 0 or _strategy(constraints) != "native" or not spec.has_ssm_state:
        return []
    shape = (constraints.max_batch_size, k + 1, *spec.ssm_state_shape)
    dtype = torch_dtype(spec.state_dtype)
    return [
        WorkspaceRequirement(verify_state_buffer_name(i), shape, dtype) for i in group.layer_indices
    ]


@hookimpl
def attn_core_allocate_context(backend, group, device, constraints, state, workspace):
    if group.spec.kind is not LayerKind.LINEAR:
        raise ValueError(
            f"backend {backend.qualified_name!r} serves linear layers, group "
            f"{group.group_id!r} is {group.spec.kind.value}"
        )
    return TritonSSMContext(backend, group, constraints, state, workspace)


@hookimpl
def attn_core_bind_forward(backend, context):
    return context.forward


# ------------------------------------------------------------------------------------------
# The context
# ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _VarlenPlan:
    """Host-planned metadata of a prefill / mixed step, shared by every layer of the group.

    ``N`` = requests with at least one new token (zero-length requests are dropped), ``T`` =
    real tokens, ``K`` = conv kernel size.

    :ivar rows: ``[N]`` int64 device, batch rows of those requests (None: all ``num_reqs``).
    :ivar slots: ``[N]`` int32 device, their state slots (``slots_long``: int64 copy).
    :ivar cu_seqlens: ``[N + 1]`` int64 device; ``cu_seqlens_cpu`` the same on the host. One
        tensor object for every layer of the step: fla memoises its chunk indices by argument
        identity, so the layers after the first reuse them.
    :ivar fresh: ``[F]`` int64 device, positions (in ``0..N-1``) of requests with no cached
        tokens (``has_initial_state`` False): their state starts at zero. None when ``F == 0``.
    :ivar conv_src: ``[K, T]`` int64 device: for tap ``j`` of token ``i``, the row of the
        extended input ``[x (T rows) | initial conv windows (N * (K-1) rows)]`` it reads.
    :ivar conv_final: ``[N * (K-1)]`` int64 device: rows of the extended input that form each
        request's new conv state, request-major, oldest first.
    """

    rows: torch.Tensor | None
    slots: torch.Tensor
    slots_long: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    fresh: torch.Tensor | None
    conv_src: torch.Tensor
    conv_final: torch.Tensor
    num_seqs: int
    num_tokens: int


def _plan_varlen(
    batch: AttentionBatch, state_indices: torch.Tensor, conv_kernel: int, device: torch.device
) -> _VarlenPlan:
    n = batch.num_reqs
    qsl = batch.query_start_loc_cpu[: n + 1].astype(np.int64)
    lens = np.diff(qsl)
    keep = np.flatnonzero(lens > 0)
    L = lens[keep]
    N, T, W = len(keep), int(qsl[-1]), conv_kernel - 1
    starts = qsl[keep]
    cu = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(L, out=cu[1:])
    fresh = np.flatnonzero(batch.context_lens_cpu[:n][keep] == 0)

    def source(req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # pos indexes seq_b = (initial window, W entries) ++ (the request's new tokens)
        return np.where(pos < W, T + req * W + pos, starts[req] + pos - W)

    tok_req = np.repeat(np.arange(N), L)
    tok_pos = np.arange(T) - cu[tok_req]
    conv_src = np.stack([source(tok_req, tok_pos + j) for j in range(conv_kernel)])
    req = np.repeat(np.arange(N), W)
    conv_final = source(req, L[req] + np.tile(np.arange(W), N))
    # one host-to-device copy for every index array of the step
    packed = np.concatenate([conv_src.reshape(-1), conv_final, cu, keep, fresh])
    dev = torch.from_numpy(packed).to(device, non_blocking=True)
    o = conv_src.size
    conv_src_d = dev[:o].view(conv_kernel, T)
    conv_final_d = dev[o : o + N * W]
    o += N * W
    cu_d = dev[o : o + N + 1]
    o += N + 1
    rows = dev[o : o + N] if n > N else None
    o += N
    fresh_d = dev[o:] if len(fresh) else None
    si = state_indices[:n]
    slots = si if rows is None else si.index_select(0, rows)
    return _VarlenPlan(
        rows=rows,
        slots=slots,
        slots_long=slots.long(),
        cu_seqlens=cu_d,
        cu_seqlens_cpu=torch.from_numpy(cu),
        fresh=fresh_d,
        conv_src=conv_src_d,
        conv_final=conv_final_d,
        num_seqs=N,
        num_tokens=T,
    )


@dataclass(slots=True)
class _PendingCommit:
    """What one layer's verify left for :meth:`TritonSSMContext.commit_speculative`."""

    linear_state: Any  # the layer's LinearStateLayer (.conv, .ssm)
    conv_x: torch.Tensor | None = None  # [n, K1, C] conv inputs
    conv_weight: torch.Tensor | None = None
    intermediate: torch.Tensor | None = None  # native: [n, K1, Hv, Dk, Dv]
    replay: dict[str, torch.Tensor] | None = None  # replay: the [n, K1, ...] verify inputs
    replay_params: dict[str, torch.Tensor | None] | None = None  # Mamba2: A_log, D, dt_bias
    scale: float = 1.0


class TritonSSMContext:
    """Per-group context: kernels picked by batch mode; see the module docstring.

    :param backend: the ``triton_ssm`` backend.
    :param group: a linear layer group.
    :param constraints: the run's demands (``spec_verify_strategy``, speculative tokens).
    :param state: the core's persistent state; layers reach their slots through
        ``layer.linear_state`` (``.conv [S, C, K-1]``, ``.ssm [S, Hv, Dk, Dv]``).
    :param workspace: holds ``verify_states.<layer>`` for native verify.
    """

    def __init__(
        self,
        backend: Backend,
        group: LayerGroup,
        constraints: ExecutionConstraints,
        state: Any,
        workspace: Workspace | None,
    ) -> None:
        self.backend = backend
        self.group = group
        self.spec = group.spec
        variant = group.spec.linear_variant
        if variant is None:  # LayerSpec refuses a linear layer without one
            raise ValueError(f"group {group.group_id!r}: a linear layer without a linear_variant")
        self.variant = variant
        # lightning attention has no conv: a width-1 plan (no conv window) costs nothing
        self._conv_kernel = group.spec.conv_dims[1] if group.spec.has_conv else 1
        # Mamba2 and lightning attention (Mamba2 with dt = 1, no softplus) share the SSD kernels
        self._ssd = variant in (LinearVariant.MAMBA2, LinearVariant.LIGHTNING)
        #: the SSD prefill's entering states in the activations' dtype (option ssd_states)
        self._ssd_states_in_activations = backend.option("ssd_states") == "activations"
        #: the SSD prefill's float32 dot operands split in hi + lo halves (option ssd_dots)
        self._ssd_precise = backend.option("ssd_dots") == "split"
        self._dt_softplus = variant is LinearVariant.MAMBA2
        self._ones: torch.Tensor | None = None  # lightning's dt = 1, [max_num_tokens, H]
        #: per layer, the last lightning slope that passed its check (held weakly, so a new
        #: tensor at a freed one's address is not taken for it) and its in-place count then
        self._slope_checked: dict[int, tuple[weakref.ref[torch.Tensor], int | None]] = {}
        self.constraints = constraints
        self.strategy = _strategy(constraints)
        self.state = state
        self.workspace = workspace
        self.batch: AttentionBatch | None = None
        self._state_indices: torch.Tensor  # the prepared batch's, set (and checked) in prepare
        self.K = kernels()
        self._plan: _VarlenPlan | None = None
        self._pending: dict[int, _PendingCommit] = {}
        self._pending_step: int | None = None

    # -- life cycle ------------------------------------------------------------------------
    def prepare(self, batch: AttentionBatch) -> None:
        """Record ``batch``; for prefill / mixed steps plan the varlen metadata (host work)."""
        state_indices = batch.state_indices
        if state_indices is None:
            self._bad("batch.state_indices", "a batch built with linear state slots", None)
        self.batch = batch
        self._state_indices = state_indices
        self._pending.clear()
        self._pending_step = None
        self._plan = None
        if batch.mode in (BatchMode.PREFILL, BatchMode.MIXED):
            self._plan = _plan_varlen(batch, state_indices, self._conv_kernel, state_indices.device)

    def update(self, batch: AttentionBatch) -> None:
        """Before a graph replay: decode kernels read the BatchBuilder's persistent metadata
        buffers directly, so recording the batch is all a decode step needs."""
        self.prepare(batch)

    # -- conv ------------------------------------------------------------------------------
    def conv1d(
        self,
        layer: LayerAttentionBinding,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        activation: str | None = "silu",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv with the layer's conv state.

        :param x: ``[T, C]`` (``T`` = ``batch.padded_tokens``), last dim contiguous.
        :param weight: ``[C, K]``; ``bias`` ``[C]`` or None.
        :param out: ``[T, C]`` in ``x.dtype`` or None.
        :returns: ``[T, C]`` (rows past the real tokens are untouched in prefill / verify).
        """
        batch = self._batch()
        if activation not in _ACTIVATIONS:
            self._bad("conv activation", list(_ACTIVATIONS), activation)
        conv_state = layer.linear_state.conv
        mode = batch.mode
        if out is None and mode is not BatchMode.DECODE and batch.padded_tokens > batch.num_tokens:
            out = torch.empty_like(x)  # the result has every padded row (theirs: untouched)
        if mode is BatchMode.DECODE:
            return self.K.causal_conv1d_update(
                x, conv_state, weight, bias, self._state_indices, activation=activation, out=out
            )
        if mode is BatchMode.VERIFY:
            n, k1 = batch.num_reqs, batch.spec_tokens + 1
            x3 = x[: n * k1].unflatten(0, (n, k1))
            out3 = None if out is None else out[: n * k1].unflatten(0, (n, k1))
            y = self.K.causal_conv1d_update(
                x3,
                conv_state,
                weight,
                bias,
                self._state_indices[:n],
                activation=activation,
                update_state=False,
                out=out3,
            )
            pending = self._pending_for(layer, batch)
            pending.conv_x = x3.clone()  # the caller may reuse x before the commit
            pending.conv_weight = weight
            return out if out is not None else y.flatten(0, 1)
        return self._conv_varlen(x, weight, bias, conv_state, activation, out)

    def _varlen_plan(self) -> _VarlenPlan:
        """The plan prepare() made for this prefill / mixed step."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(
                f"group {self.group.group_id!r}: no varlen plan for a "
                f"{self._batch().mode.value} step (prepare plans prefill and mixed steps)"
            )
        return plan

    def _conv_varlen(self, x, weight, bias, conv_state, activation, out) -> torch.Tensor:
        plan = self._varlen_plan()
        T, C = plan.num_tokens, x.shape[1]
        W = conv_state.shape[-1]
        init = conv_state.index_select(0, plan.slots)  # [N, C, W]
        if plan.fresh is not None:
            init.index_fill_(0, plan.fresh, 0)
        ext = torch.cat([x[:T].float(), init.transpose(1, 2).reshape(-1, C).float()])
        w = weight.float()
        y = ext.index_select(0, plan.conv_src[0]) * w[:, 0]
        for j in range(1, weight.shape[1]):
            y.addcmul_(ext.index_select(0, plan.conv_src[j]), w[:, j])
        if bias is not None:
            y += bias.float()
        if activation is not None:
            y = torch.nn.functional.silu(y)
        if W:
            final = ext.index_select(0, plan.conv_final).view(plan.num_seqs, W, C)
            conv_state.index_copy_(0, plan.slots_long, final.transpose(1, 2).to(conv_state.dtype))
        if out is None:
            return y.to(x.dtype)
        out[:T].copy_(y)
        return out

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        layer: LayerAttentionBinding,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        **inputs: Any,
    ) -> torch.Tensor:
        """One layer (layouts of :mod:`attn_core.context`): GDN / KDA take ``g``, ``beta``;
        Mamba2 takes ``q=C [T, G, N]``, ``k=B [T, G, N]``, ``v=x [T, H, P]`` and ``dt [T, H]``,
        ``A_log [H]``, optional ``D [H]``, ``dt_bias [H]``. Returns ``[T, Hv, Dv]``."""
        batch = self._batch()
        if self.variant is LinearVariant.SHORT_CONV:
            self._bad(
                f"layer {layer.layer_index}: forward of a short-conv layer",
                "binding.conv1d only (the gated short conv has no recurrent state)",
                "a forward call",
            )
        self._check_inputs(inputs, layer.layer_index)
        mode = batch.mode
        if out is None and mode is not BatchMode.DECODE and batch.padded_tokens > batch.num_tokens:
            # the kernels compute the real tokens' rows; the result has every padded row
            out = torch.empty_like(v)
        if self.variant is LinearVariant.LIGHTNING:
            q, k, v, inputs = self._lightning_as_ssd(layer, q, k, v, inputs)
        ssm = layer.linear_state.ssm
        if mode is BatchMode.DECODE:
            return self._decode(layer, q, k, v, out, ssm, self._state_indices, inputs)
        if mode is BatchMode.VERIFY:
            return self._verify(layer, q, k, v, out, ssm, batch, inputs)
        return self._prefill(layer, q, k, v, out, ssm, inputs)

    def _lightning_as_ssd(self, layer, q, k, v, inputs):
        """Lightning attention's inputs in Mamba2's form: ``C = q * scale``, ``B = k``,
        ``x = v``, ``dt = 1`` (a cached ones buffer, so a captured decode step allocates
        nothing), ``A_log = log(slope)``; returns ``(C, B, x, inputs)``."""
        T, H = v.shape[0], v.shape[1]
        ones = self._ones
        if ones is None or ones.shape[0] < T or ones.shape[1] != H or ones.device != v.device:
            rows = max(T, self.constraints.max_num_tokens)
            ones = self._ones = torch.ones(rows, H, dtype=torch.float32, device=v.device)
        scale = layer.scale
        c = q if scale == 1.0 else (q.float() * scale).to(q.dtype)
        ssd = {"dt": ones[:T], "A_log": torch.log(inputs["slope"].float()), "D": None}
        return c, k, v, {**ssd, "dt_bias": None}

    def _decode(self, layer, q, k, v, out, ssm, idx, inputs) -> torch.Tensor:
        K = self.K
        if self.variant is LinearVariant.MAMBA1:
            y = K.mamba1_decode(
                v[..., 0], inputs["dt"], inputs["A_log"], k[:, 0], q[:, 0], ssm, idx,
                D=inputs.get("D"), dt_bias=inputs.get("dt_bias"),
                out=None if out is None else out[..., 0],
            )  # fmt: skip
            return y[..., None] if out is None else out
        if self._ssd:
            return K.mamba2_decode(
                v, inputs["dt"], inputs["A_log"], k, q, ssm, idx,
                D=inputs.get("D"), dt_bias=inputs.get("dt_bias"),
                dt_softplus=self._dt_softplus, out=out,
            )  # fmt: skip
        fn = K.kda_decode if self.variant is LinearVariant.KDA else K.gdn_decode
        return fn(
            q, k, v, inputs["g"], inputs["beta"], ssm, idx,
            scale=layer.scale, use_qk_l2norm=self.spec.qk_l2norm, out=out,
        )  # fmt: skip

    def _prefill(self, layer, q, k, v, out, ssm, inputs) -> torch.Tensor:
        plan = self._varlen_plan()
        T = plan.num_tokens
        if plan.fresh is not None:  # has_initial_state False: start from zeros
            ssm.index_fill_(0, plan.slots_long.index_select(0, plan.fresh), 0)
        out_t = None if out is None else out[:T]
        if self.variant is LinearVariant.MAMBA1:
            y = self.K.mamba1_scan(
                v[:T, :, 0], inputs["dt"][:T], inputs["A_log"], k[:T, 0], q[:T, 0], ssm,
                plan.slots, cu_seqlens=plan.cu_seqlens, D=inputs.get("D"),
                dt_bias=inputs.get("dt_bias"), out=None if out_t is None else out_t[..., 0],
            )  # fmt: skip
            return y[..., None] if out is None else out
        if self._ssd:
            y = self.K.mamba2_prefill(
                v[:T], inputs["dt"][:T], inputs["A_log"], k[:T], q[:T], ssm, plan.slots,
                plan.cu_seqlens, D=inputs.get("D"), dt_bias=inputs.get("dt_bias"),
                dt_softplus=self._dt_softplus,
                cu_seqlens_cpu=plan.cu_seqlens_cpu,  # host offsets: no device sync
                states_dtype=v.dtype if self._ssd_states_in_activations else None,
                precise=self._ssd_precise, out=out_t,
            )  # fmt: skip
            return y if out is None else out
        fn = self.K.kda_prefill if self.variant is LinearVariant.KDA else self.K.gdn_prefill
        y = fn(
            q[:T], k[:T], v[:T], inputs["g"][:T], inputs["beta"][:T], ssm, plan.slots,
            plan.cu_seqlens, scale=layer.scale, use_qk_l2norm=self.spec.qk_l2norm, out=out_t,
            cu_seqlens_cpu=plan.cu_seqlens_cpu,
        )  # fmt: skip
        return y if out is None else out

    def _verify(self, layer, q, k, v, out, ssm, batch, inputs) -> torch.Tensor:
        n, k1 = batch.num_reqs, batch.spec_tokens + 1
        t = n * k1
        idx = self._state_indices[:n]

        def split(x: torch.Tensor) -> torch.Tensor:
            return x[:t].unflatten(0, (n, k1))

        out3 = None if out is None else split(out)
        pending = self._pending_for(layer, batch)
        pending.scale = layer.scale
        if self.variant is LinearVariant.MAMBA1:
            toks = {"x": v[:t, :, 0], "dt": inputs["dt"][:t], "B": k[:t, 0], "C": q[:t, 0]}
            params = {n_: inputs.get(n_) for n_ in ("A_log", "D", "dt_bias")}
            inter = self._intermediate(layer, n, k1) if self.strategy == "native" else None
            cu = torch.arange(0, t + 1, k1, dtype=torch.int32, device=idx.device)
            # the tile kernel in both strategies (lanes=False): native's per-token states need
            # it, and a verify's outputs must be the same bits whichever strategy commits
            y = self.K.mamba1_scan(
                toks["x"], toks["dt"], params["A_log"], toks["B"], toks["C"], ssm, idx,
                cu_seqlens=cu, D=params["D"],
                dt_bias=params["dt_bias"], intermediate_states=inter, update_state=False,
                out=None if out is None else out[:t, :, 0], lanes=False,
            )  # fmt: skip
            if inter is not None:
                pending.intermediate = inter
            else:
                pending.replay = {name: x.clone() for name, x in toks.items()}
            pending.replay_params = params
            return out if out is not None else y[..., None]
        if self._ssd:
            toks = {"x": split(v), "dt": split(inputs["dt"]), "B": split(k), "C": split(q)}
            params = {n_: inputs.get(n_) for n_ in ("A_log", "D", "dt_bias")}
            inter = self._intermediate(layer, n, k1) if self.strategy == "native" else None
            y = self._mamba2_steps(toks, params, ssm, idx, None, out3, inter)
            if inter is not None:
                pending.intermediate = inter
            else:
                pending.replay = {name: x.clone() for name, x in toks.items()}
            pending.replay_params = params
        else:
            toks = {
                "q": split(q), "k": split(k), "v": split(v), "g": split(inputs["g"]),
                "beta": split(inputs["beta"]),
            }  # fmt: skip
            kda = self.variant is LinearVariant.KDA
            common = dict(scale=layer.scale, use_qk_l2norm=self.spec.qk_l2norm, out=out3)
            args = (*toks.values(), ssm, idx)
            if self.strategy == "native":
                inter = self._intermediate(layer, n, k1)
                fn = self.K.kda_verify_native if kda else self.K.gdn_verify_native
                y = fn(*args, inter, **common)
                pending.intermediate = inter
            else:
                fn = self.K.kda_verify_replay if kda else self.K.gdn_verify_replay
                y = fn(*args, **common)
                pending.replay = {name: x.clone() for name, x in toks.items()}
        return out if out is not None else y.flatten(0, 1)

    def _mamba2_steps(self, toks, params, ssm, idx, num_accepted, out3, inter) -> torch.Tensor:
        """Mamba2 has no multi-token kernel: run the decode kernel once per draft position on a
        scratch copy of the slots (rows ``0..n-1``). With ``num_accepted`` (replay commit) row
        ``b`` only takes its first ``num_accepted[b]`` steps and the scratch is written back."""
        n, k1 = toks["x"].shape[:2]
        rows = torch.arange(n, dtype=torch.int32, device=idx.device)
        scratch = ssm.index_select(0, idx.long())
        y = out3 if out3 is not None else torch.empty_like(toks["x"])
        for i in range(k1):
            step_rows = rows if num_accepted is None else torch.where(num_accepted > i, rows, -1)
            self.K.mamba2_decode(
                toks["x"][:, i], toks["dt"][:, i], params["A_log"], toks["B"][:, i],
                toks["C"][:, i], scratch, step_rows, D=params["D"], dt_bias=params["dt_bias"],
                dt_softplus=self._dt_softplus,
                out=y[:, i] if num_accepted is None else torch.empty_like(y[:, i]),
            )  # fmt: skip
            if inter is not None:
                inter[:, i].copy_(scratch)
        if num_accepted is not None:
            ssm.index_copy_(0, idx.long(), scratch)
        return y

    def _intermediate(self, layer, n: int, k1: int) -> torch.Tensor:
        name = verify_state_buffer_name(layer.layer_index)
        if self.workspace is None or name not in self.workspace:
            self._bad(
                "native speculative verify workspace",
                f"buffer {name!r} (set ExecutionConstraints.speculative_tokens >= {k1 - 1})",
                "none was allocated",
            )
        buf = self.workspace[name]
        if buf.shape[0] < n or buf.shape[1] < k1:
            self._bad(f"workspace {name!r} capacity", f">= [{n}, {k1}, ...]", list(buf.shape[:2]))
        if buf.shape[1] != k1:
            # Fewer drafts than declared: a packed buffer of the right shape from the front.
            return buf.view(-1)[: n * k1 * buf[0, 0].numel()].view(n, k1, *buf.shape[2:])
        return buf[:n]

    def _pending_for(self, layer, batch: AttentionBatch) -> _PendingCommit:
        self._pending_step = batch.step
        pending = self._pending.get(layer.layer_index)
        if pending is None:
            pending = _PendingCommit(layer.linear_state)
            self._pending[layer.layer_index] = pending
        return pending

    # -- speculative commit ----------------------------------------------------------------
    def commit_speculative(self, batch: AttentionBatch, num_accepted: torch.Tensor) -> None:
        """Keep the state after each request's accepted tokens.

        :param batch: the verify batch this context was prepared with (other modes: no-op).
        :param num_accepted: ``[>= num_reqs]`` int, tokens kept per request, ``1..k+1``.
            A host tensor is checked (no sync); a device tensor is clamped into ``0..k+1``
            (``0`` leaves the slot unchanged).
        """
        if batch.mode is not BatchMode.VERIFY:
            return
        if self._pending_step is not None and batch.step != self._pending_step:
            self._bad("commit batch", f"the verify batch of step {self._pending_step}", batch.step)
        n, k1 = batch.num_reqs, batch.spec_tokens + 1
        if num_accepted.dim() != 1 or num_accepted.shape[0] < n:
            self._bad("num_accepted shape", f"[{n}]", list(num_accepted.shape))
        if num_accepted.device.type == "cpu":
            acc_host = num_accepted[:n]
            if bool(((acc_host < 1) | (acc_host > k1)).any()):
                self._bad("num_accepted", f"values in 1..{k1}", acc_host.tolist())
        if batch.state_indices is None:
            self._bad("batch.state_indices", "a batch built with linear state slots", None)
        idx = batch.state_indices[:n]
        acc = num_accepted[:n].to(idx.device, torch.int32, non_blocking=True).clamp(0, k1)
        K = self.K
        for pending in self._pending.values():
            st = pending.linear_state
            if pending.conv_x is not None:
                K.causal_conv1d_commit(pending.conv_x, acc, st.conv, pending.conv_weight, idx)
            if pending.intermediate is not None:
                commit = K.mamba1_commit if self.variant is LinearVariant.MAMBA1 else K.gdn_commit
                commit(pending.intermediate, acc, st.ssm, idx)
            elif pending.replay is not None:
                r = pending.replay
                if self.variant is LinearVariant.MAMBA1:
                    p = pending.replay_params or {}
                    K.mamba1_replay_commit(
                        r["x"], r["dt"], p["A_log"], r["B"], r["C"], acc, st.ssm, idx,
                        D=p.get("D"), dt_bias=p.get("dt_bias"),
                    )  # fmt: skip
                elif self._ssd:
                    self._mamba2_steps(r, pending.replay_params, st.ssm, idx, acc, None, None)
                else:
                    fn = (
                        K.kda_replay_commit
                        if self.variant is LinearVariant.KDA
                        else K.gdn_replay_commit
                    )
                    fn(
                        r["q"], r["k"], r["v"], r["g"], r["beta"], acc, st.ssm, idx,
                        scale=pending.scale, use_qk_l2norm=self.spec.qk_l2norm,
                    )  # fmt: skip
        self._pending.clear()
        self._pending_step = None

    # -- checks ----------------------------------------------------------------------------
    def _batch(self) -> AttentionBatch:
        if self.batch is None:
            raise RuntimeError(
                f"group {self.group.group_id!r}: forward before prepare(batch) on the "
                f"{self.backend.qualified_name} context"
            )
        return self.batch

    def _check_inputs(self, inputs: dict[str, Any], layer: int) -> None:
        """The variant's inputs are given (their shapes the binding checked before the call)."""
        need: tuple[str, ...] = ("g", "beta")
        if self.variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
            need = ("dt", "A_log")
        elif self.variant is LinearVariant.LIGHTNING:
            need = ("slope",)
        if any(inputs.get(n) is None for n in need):
            missing = [n for n in need if inputs.get(n) is None]
            self._bad(f"{self.variant.value} inputs", list(need), f"missing {missing}", layer)
        if self.variant is LinearVariant.LIGHTNING:
            self._check_slope(inputs["slope"], layer)

    def _check_slope(self, slope: torch.Tensor, layer: int) -> None:
        """Lightning's kernels decay a head's state by ``e^(-slope)`` a token through
        ``A_log = log(slope)``, which is NaN for a negative slope (a state that grows): refuse
        one, or a NaN. The values are read on the host once per slope tensor and in-place
        count (a layer's constant slope costs one device sync, at its first step, and is
        checked again if changed in place through it or a view; a write through an unrelated
        tensor over the same memory is not seen); a step being captured into a CUDA graph
        cannot read them and is not checked."""
        version = compat.tensor_version(slope)
        checked = self._slope_checked.get(layer)
        if checked is not None and checked[0]() is slope and checked[1] == version:
            return
        if slope.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        bad = ~(slope >= 0)  # NaN compares false
        if bool(bad.any()):
            heads = bad.nonzero().flatten().tolist()
            shown = ", ".join(f"head {h}: {slope[h].item():g}" for h in heads[:4])
            expected = "slope >= 0 in every head (the state decays by e^-slope a token)"
            self._bad("lightning slope", expected, shown + " ..." * (len(heads) > 4), layer)
        self._slope_checked[layer] = (weakref.ref(slope), version)

    def _bad(self, what: str, expected: object, got: object, layer: int | None = None) -> NoReturn:
        raise BackendInputError(
            group=self.group.group_id,
            backend=self.backend.qualified_name,
            what=what if layer is None else f"layer {layer}: {what}",
            expected=expected,
            got=got,
        )
