"""Every use of fla-core's internals and Triton's by this plugin, in one module, gated by the
installed release (fla-core) or checked against public numbers (Triton).

Public fla-core API (any release in the declared range): ``fla.ops.gated_delta_rule``'s
``chunk_gated_delta_rule`` and ``fla.ops.kda``'s ``chunk_kda`` (chunked prefill over a gathered
dense state), ``fla.ops.simple_gla``'s ``chunk_simple_gla`` (Mamba2's SSD) and the naive
recurrences the CPU fallback runs (:func:`public_chunk`, :func:`public_simple_gla`,
:func:`naive_recurrences`).

Internal fla-core stages (only for a release in :data:`TESTED_STAGES`, whose sources the slot pass
was written against): the Gated DeltaNet and KDA prefills that read and write the state slots in
place (``kernels.gdn_chunk``) run fla's chunk-local cumsum, intra-chunk WY representation and output
pass around the plugin's own state pass; the output pass's Triton kernel is launched directly, into
the layer's output buffer (:func:`_output_pass_into`), and so, for the GDN pass that folds
``recompute_w_u`` in (the default for batches that fill the GPU), is the fused kkt-and-solve
kernel (:func:`_kkt_solve_into`); with the plugin's own solve (``solve="ours"``) only
``recompute_w_u`` (``fla.ops.gated_delta_rule.wy_fast``) of the intra stage runs. Those functions
live in fla's internal modules (GDN: ``fla.ops.common.chunk_o``,
``fla.ops.gated_delta_rule.chunk_fwd``; KDA: ``fla.ops.kda.chunk_intra``, ``fla.ops.gla.chunk``;
both: ``fla.ops.utils``), whose names and keyword arguments change between releases. :func:`stages`
gives a family's functions (:data:`KINDS`: ``"gdn"``, ``"kda"``), or why not: another release, an
import that fails, or a failed self-check. The self-check (GPU only, once per process and family,
before its first slot-pass prefill) runs the slot pass against fla's public function
(``chunk_gated_delta_rule``, ``chunk_kda``) on a tiny case (GDN's both ways: with ``w`` and
``u`` stored and with ``recompute_w_u`` folded in); if the outputs or final states differ,
or it raises, that family's prefill gathers and scatters around the public function instead.
``attn list`` shows which (:func:`note`).

Triton internals (only on a release in :data:`TESTED_TRITON`; read at first use on a CUDA
device, never at import): the opt-in shared-memory limit per block the kernels' tilings are
fitted to (:func:`max_shared_memory`), and a warmed-up kernel's shared memory
(:func:`kernel_shared_memory`). Both are checked against what they must be and fall back to a
safe public value, which ``attn list`` names (:func:`note`); on another release the fallback
serves without reading them.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any, ClassVar, Literal

import torch
from packaging.version import InvalidVersion, Version

__all__ = [
    "DISTRIBUTION",
    "KINDS",
    "PUBLIC",
    "REQUIREMENT",
    "TESTED_STAGES",
    "TESTED_TRITON",
    "Kind",
    "distribution_version",
    "kernel_shared_memory",
    "max_shared_memory",
    "missing",
    "naive_recurrences",
    "note",
    "public_chunk",
    "public_simple_gla",
    "self_check",
    "self_check_now",
    "slot_pass_reason",
    "stages",
    "tensor_version",
    "triton_note",
]

DISTRIBUTION = "fla-core"
#: The plugin's declared fla-core range (its pyproject.toml), for the message where fla is absent.
REQUIREMENT = "fla-core>=0.6.0,<0.7"
#: fla-core releases whose internal stage functions (names, keyword arguments, chunk size) the
#: slot pass was written against and checked on.
TESTED_STAGES = frozenset({"0.6.0"})
#: Triton minor releases (the plugin's declared range) whose driver utilities and compiled-kernel
#: metadata :func:`max_shared_memory` and :func:`kernel_shared_memory` read.
TESTED_TRITON = ("3.6", "3.7", "3.8", "3.9")


def missing() -> str | None:
    """Why fla cannot serve at all (its module is not importable), else None: then the
    families whose prefill runs fla's chunk stages (and on the CPU its naive recurrences)
    have nothing to run. Looks the module up without importing it."""
    import importlib.util

    try:
        found = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):  # a broken install raises here
        found = False
    if found:
        return None
    return f"fla-core is not installed (pip install '{REQUIREMENT}')"


def distribution_version() -> str | None:
    """The installed ``fla-core`` distribution's version; None where there is none."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def _gate() -> str | None:
    version = distribution_version()
    if version is None:
        return f"no {DISTRIBUTION} distribution found"
    try:
        normal = str(Version(version))
    except InvalidVersion:
        return f"fla-core version {version!r} is not a version"
    if normal not in TESTED_STAGES:
        tested = ", ".join(sorted(TESTED_STAGES))
        return f"fla-core {version} is not a release the slot pass was tested on ({tested})"
    return None


#: The prefill families whose slot pass runs fla's internal stages: Gated DeltaNet and KDA.
Kind = Literal["gdn", "kda"]
KINDS: tuple[Kind, ...] = ("gdn", "kda")
#: Each family's public fla function: what its self-check compares against and what runs
#: (with the gather/scatter) when its stages are off.
PUBLIC: dict[Kind, str] = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda"}
_SHOWN: dict[Kind, str] = {"gdn": "GDN", "kda": "KDA"}


class _State:
    """What was found, for the process, per family (tests reset it)."""

    stages: ClassVar[dict[Kind, dict[str, Any]]] = {}
    #: why the internal stages are off ("" on); a family absent: not looked up yet
    reason: ClassVar[dict[Kind, str]] = {}
    #: the self-check: a family absent not run, "" passed, else why it failed
    check: ClassVar[dict[Kind, str]] = {}

    #: per CUDA device index: the shared-memory limit used, and why Triton's was not ("" it was)
    shared_memory: ClassVar[dict[int, tuple[int, str]]] = {}
    #: why a compiled kernel's shared memory could not be read ("" it could, or was not asked)
    unsized: ClassVar[str] = ""

    @classmethod
    def reset(cls) -> None:
        cls.stages, cls.reason, cls.check, cls.shared_memory = {}, {}, {}, {}
        cls.unsized = ""


def _import_stages(kind: Kind) -> dict[str, Any]:
    """fla's internal functions the ``kind`` slot pass runs (raises ImportError)."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    common = {
        "cumsum": chunk_local_cumsum,
        "RCP_LN2": RCP_LN2,
        "chunk_indices": prepare_chunk_indices,
        "chunk_offsets": prepare_chunk_offsets,
    }
    if kind == "kda":
        from fla.ops.gla.chunk import chunk_gla_fwd_kernel_o
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra

        return {
            **common,
            "intra": chunk_kda_fwd_intra,
            "output_into": _output_pass_into(chunk_gla_fwd_kernel_o, kda=True),
        }
    from fla.ops.common.chunk_o import chunk_fwd_kernel_o
    from fla.ops.gated_delta_rule.chunk_fwd import (
        chunk_gated_delta_rule_fwd_intra,
        chunk_gated_delta_rule_fwd_kkt_solve_kernel,
    )
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    return {
        **common,
        "intra": chunk_gated_delta_rule_fwd_intra,
        "recompute_w_u": recompute_w_u_fwd,
        "kkt_solve_into": _kkt_solve_into(chunk_gated_delta_rule_fwd_kkt_solve_kernel),
        "output_into": _output_pass_into(chunk_fwd_kernel_o, kda=False),
    }


def _kkt_solve_into(kernel: Any) -> Callable[..., torch.Tensor]:
    """fla-core 0.6.0's fused ``beta k k^T`` and triangular solve of Gated DeltaNet
    (``chunk_gated_delta_rule_fwd_kkt_solve_kernel``, the first half of
    ``chunk_gated_delta_rule_fwd_intra`` at chunk 64), launched as that function launches it but
    into a given ``Ai``: the state pass folds the second half (``recompute_w_u``) in, so only
    ``Ai`` is wanted. fla zero-fills ``Ai`` first; the kernel stores each chunk's lower
    triangle of 16-row blocks only, and the state pass reads no other entries, so ``Ai`` may
    come uninitialised.

    The returned ``kkt_solve_into(Ai, *, k, g, beta, cu_seqlens, chunk_indices, chunk_size)``
    takes ``[1, T, ...]`` tensors as the stage functions do (``Ai`` ``[1, T, HV, chunk_size]``
    in k's dtype, chunk_size 64) and returns ``Ai``."""

    def kkt_solve_into(Ai, *, k, g, beta, cu_seqlens, chunk_indices, chunk_size):
        B, T, H, K = k.shape
        HV = beta.shape[2]
        kernel[(len(chunk_indices), B * HV)](
            k=k, g=g, beta=beta, A=Ai, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T,
            H=H, HV=HV, K=K, BT=chunk_size, BC=16,
        )  # fmt: skip
        return Ai

    return kkt_solve_into


def _output_pass_into(kernel: Any, *, kda: bool) -> Callable[..., torch.Tensor]:
    """fla-core 0.6.0's output pass (GDN: ``chunk_fwd_o``'s ``chunk_fwd_kernel_o``; KDA:
    ``chunk_gla_fwd_o_gk``'s ``chunk_gla_fwd_kernel_o``) launched as those functions launch it,
    but into a given ``o``: theirs allocate the output, which the layer would then copy into
    its own buffer (at T = 8192 with 32 heads of 128, 7 % of a GDN prefill on an H100).

    The returned ``output_into(o, *, q, k, v, h, g, A, scale, cu_seqlens, chunk_indices,
    chunk_size)`` takes ``[1, T, ...]`` tensors as the stage functions do (``k`` GDN only, the
    intra-chunk attention ``A`` KDA only; the other None), every sequence's chunks listed in
    ``chunk_indices``, and ``o`` ``[1, T, HV, V]`` contiguous in any float dtype (the kernel
    rounds to it on store); every row of ``o`` is written."""

    def output_into(o, *, q, k, v, h, g, A, scale, cu_seqlens, chunk_indices, chunk_size):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        NT = len(chunk_indices)

        def grid(meta: dict[str, Any]) -> tuple[int, int]:
            return ((V + meta["BV"] - 1) // meta["BV"] * NT, B * HV)

        sizes = dict(scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False)
        if kda:
            kernel[grid](q=q, v=v, g=g, h=h, o=o, A=A, cu_seqlens=cu_seqlens,
                         chunk_indices=chunk_indices, USE_GRAPH=False, **sizes)  # fmt: skip
        else:
            kernel[grid](q=q, k=k, v=v, h=h, g=g, g_gamma=None, o=o, cu_seqlens=cu_seqlens,
                         chunk_indices=chunk_indices, **sizes)  # fmt: skip
        return o

    return output_into


def stages(kind: Kind) -> tuple[dict[str, Any], str | None]:
    """``(fla's internal stage functions for kind, None)``, or ``({}, why not)`` (version
    gate or import). Imports fla on the first call for each kind."""
    if kind not in KINDS:
        raise ValueError(f"compat.stages: kind must be one of {KINDS}, got {kind!r}")
    if kind not in _State.reason:
        gate = _gate()
        if gate is not None:
            _State.stages[kind], _State.reason[kind] = {}, gate
        else:
            try:
                _State.stages[kind] = _import_stages(kind)
                _State.reason[kind] = ""
            except ImportError as exc:  # the internals moved under a tested version number
                _State.stages[kind] = {}
                _State.reason[kind] = f"fla-core internals not importable ({exc})"
    return _State.stages[kind], _State.reason[kind] or None


def slot_pass_reason(device: torch.device | None, kind: Kind) -> str | None:
    """Why the ``kind`` slot-pass prefill may not run (gate, import, failed self-check); None:
    it may. On a CUDA ``device`` that family's self-check runs first if it has not."""
    _, reason = stages(kind)
    if reason:
        return reason
    if device is not None and device.type == "cuda" and kind not in _State.check:
        self_check(device, kind)
    if _State.check.get(kind):
        return f"self-check against fla's {PUBLIC[kind]} failed: {_State.check[kind]}"
    return None


def note() -> str:
    """The line ``attn list`` prints after the backend's status: per family, whether its slot
    pass runs fla's stages, or why not and which public function runs instead (one clause for
    both where they agree), then any Triton internal that fell back (:func:`triton_note`).
    Imports nothing: a family whose stages were not looked up in this process shows what the
    version gate says."""
    triton = triton_note()
    return _fla_note() + (f"; {triton}" if triton else "")


def _fla_note() -> str:
    clauses: dict[Kind, tuple[str, str]] = {}
    for kind in KINDS:
        reason = _gate() if kind not in _State.reason else slot_pass_reason(None, kind)
        if reason:
            clauses[kind] = ("off", reason)
        else:
            checked = "passed" if kind in _State.check else "at first GPU prefill"
            clauses[kind] = ("on", f"fla-core {distribution_version()}, self-check {checked}")
    if len(set(clauses.values())) == 1:  # one clause for both
        state, text = clauses[KINDS[0]]
        names = " and ".join(_SHOWN[k] for k in KINDS)
        if state == "off":
            text += f"; fla's public {' and '.join(PUBLIC[k] for k in KINDS)} used"
        return f"fla stages: {names} {state} ({text})"
    parts = []
    for kind, (state, text) in clauses.items():
        if state == "off":
            text += f"; fla's public {PUBLIC[kind]} used"
        parts.append(f"{_SHOWN[kind]} {state} ({text})")
    return "fla stages: " + "; ".join(parts)


def triton_note() -> str:
    """``attn list``'s clause for the Triton internals: empty while they agree with the public
    numbers (or were not read), else which device fell back and why."""
    fallbacks = [(i, why) for i, (_, why) in sorted(_State.shared_memory.items()) if why]
    clauses = [
        f"cuda:{i} shared-memory limit: torch's public per-block limit used ({why})"
        for i, why in fallbacks
    ]
    if _State.unsized:
        clauses.append(
            f"kernel shared memory unreadable: the smallest tiling used ({_State.unsized})"
        )
    return "; ".join(clauses)


def _triton_gate() -> str:
    """Why this Triton's internals are not read ("" where its release is one checked)."""
    import triton

    release = str(getattr(triton, "__version__", "unknown"))
    try:
        minor = "{}.{}".format(*Version(release).release[:2])
    except (InvalidVersion, IndexError):
        minor = ""
    if minor in TESTED_TRITON:
        return ""
    return (
        f"Triton {release} is not a release these reads were checked on "
        f"({TESTED_TRITON[0]}-{TESTED_TRITON[-1]})"
    )


def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one block may opt in to on CUDA device ``device_index``.

    Read from Triton's driver utilities (``triton.runtime.driver.active.utils``, not public
    API): Triton rejects a kernel against exactly this number, and torch's public device
    properties lack the opt-in maximum. It must lie between torch's ``shared_memory_per_block``
    (what any block may use) and ``shared_memory_per_multiprocessor``; where Triton's utility
    is absent, raises or gives another number, torch's ``shared_memory_per_block`` is used
    (smaller tiles, never a kernel that does not fit) and :func:`triton_note` says why. Once
    per device and process.
    """
    if device_index not in _State.shared_memory:
        props = torch.cuda.get_device_properties(device_index)
        # 48 KiB: what any CUDA block may use, where torch does not name the number
        low = int(getattr(props, "shared_memory_per_block", 0)) or 48 * 1024
        high = int(getattr(props, "shared_memory_per_multiprocessor", 0)) or None
        value, why = low, _triton_gate()
        if not why:
            try:
                import triton

                info = triton.runtime.driver.active.utils.get_device_properties(device_index)
                value = int(info["max_shared_mem"])
            except Exception as exc:  # renamed or removed in another release: the public bound
                why = f"Triton's device properties unreadable: {type(exc).__name__}: {exc}"
        if not why and not (low <= value and (high is None or value <= high)):
            why = f"Triton says {value} bytes, outside torch's {low}..{high}"
            value = low
        _State.shared_memory[device_index] = (value, why)
    return _State.shared_memory[device_index][0]


def _read_shared_memory(compiled: Any) -> tuple[int | None, str]:
    """``(bytes, "")`` from a compiled kernel's ``metadata.shared``, or ``(None, why not)``."""
    gate = _triton_gate()
    if gate:
        return None, gate
    try:
        shared = int(compiled.metadata.shared)
    except Exception as exc:  # renamed or removed in another release
        return None, f"{type(exc).__name__}: {exc}"
    if shared < 0:
        return None, f"Triton says {shared} bytes"
    return shared, ""


def tensor_version(t: torch.Tensor) -> int | None:
    """torch's count of in-place changes to ``t`` (``Tensor._version``: private, the counter
    autograd itself checks), or None where the installed torch has none. The lightning slope
    check keys on it, so that a slope changed in place is checked again; without it a slope is
    checked once per tensor."""
    version = getattr(t, "_version", None)
    return version if isinstance(version, int) else None


def kernel_shared_memory(compiled: Any) -> int | None:
    """Bytes of shared memory per block a compiled Triton kernel (what ``kernel.warmup(...)``
    returns) needs, for fitting a tiling to the device; None where the installed Triton does
    not say or gives what cannot be a size, and :func:`triton_note` then says so (the caller
    takes its smallest tiling: slower, never a wrong result)."""
    shared, why = _read_shared_memory(compiled)
    if shared is None:
        _State.unsized = why
    return shared


def self_check_now(device: torch.device) -> tuple[str, ...] | None:
    """Run the self-check of every family whose stages load (``attn list --self-check``), on
    ``device``, where it has not run in this process.

    :returns: one line per family whose check failed (its stages now off); None where no
        family has stages to check (another release, internals not importable).
    """
    checked = [kind for kind in KINDS if stages(kind)[1] is None]
    for kind in checked:
        self_check(device, kind)
    if not checked:
        return None
    return tuple(
        f"fla stages: {_SHOWN[kind]}: self-check against fla's {PUBLIC[kind]} failed: "
        f"{_State.check[kind]}"
        for kind in checked
        if _State.check[kind]
    )


def self_check(device: torch.device, kind: Kind) -> str:
    """Run the ``kind`` slot-pass prefill against fla's public function (``chunk_kda`` or
    ``chunk_gated_delta_rule``) on a tiny case on ``device``, once per process and family; keep
    and return the verdict ("" passed).

    The case: two sequences of 70 and 5 tokens (a chunk boundary and a partial chunk), 2 key /
    4 value heads, K = V = 64, bf16 q/k/v, q/k l2-normalised in the kernel, fp32 states
    starting from random values in slots 3 and 1 of 4; the decay per head (GDN) or per key
    channel (KDA).
    """
    if kind not in _State.check:
        try:
            _State.check[kind] = _self_check(device, kind)
        except Exception as exc:  # any failure of the internal path: the public path stays
            _State.check[kind] = f"{type(exc).__name__}: {exc}"
    return _State.check[kind]


def _self_check(device: torch.device, kind: Kind) -> str:
    from attn_plugin_triton_ssm.kernels import gdn_chunk

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device)

    T, H, HV, K, V = 75, 2, 4, 64, 64
    kda = kind == "kda"
    bf = torch.bfloat16
    q, k, v = rnd(T, H, K).to(bf), rnd(T, H, K).to(bf), rnd(T, HV, V).to(bf)
    gate = -torch.rand(*((T, HV, K) if kda else (T, HV)), generator=g).to(device) * 0.5
    beta = torch.rand(T, HV, generator=g).to(device)
    states = rnd(4, HV, K, V, scale=0.1)
    slots = torch.tensor([3, 1], dtype=torch.int32, device=device)
    cu_cpu = torch.tensor([0, 70, 75], dtype=torch.int64)
    cu = cu_cpu.to(device)
    scale = K**-0.5
    chunk = public_chunk(kda=kda)
    h0 = states.index_select(0, slots.long())
    want, want_ht = chunk(
        q[None], k[None], v[None], gate[None], beta[None], scale=scale, initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
    # KDA's pass, and GDN's both ways: reading w and u, and with recompute_w_u folded in
    # (fla's kkt-and-solve kernel launched into an uninitialised Ai), which the default takes
    # for batches that fill the GPU
    variants: list[dict[str, Any]] = [{}] if kda else [{"wy_in_pass": False}, {"wy_in_pass": True}]
    slot_fn = gdn_chunk.kda_chunk_prefill_slots if kda else gdn_chunk.gdn_chunk_prefill_slots
    want_o = want[0].float()
    for options in variants:
        got_states = states.clone()
        # into a given output buffer, as the plugin calls it (fla's output pass writes it)
        got = slot_fn(
            q, k, v, gate, beta, got_states, slots, cu, cu_cpu, scale=scale, use_qk_l2norm=True,
            out=torch.empty_like(v), **options,
        )  # fmt: skip
        # Both run fla's stages; only the state pass (and the l2norm) differs: agreement to
        # bf16 rounding (the GPU test of the GDN slot pass sees 2e-3 relative at Qwen3-Next's
        # shapes; 2.7e-3 with the WY folded in, which rounds elsewhere).
        how = "".join(f" ({name}={value})" for name, value in options.items())
        rel = ((got.float() - want_o).abs().mean() / want_o.abs().mean()).item()
        if not rel < 1e-2:
            return f"outputs differ by {rel:.3g} (mean, relative){how}"
        got_ht = got_states.index_select(0, slots.long())
        rel = ((got_ht - want_ht.float()).abs().max() / want_ht.float().abs().max()).item()
        if not rel < 1e-2:
            return f"final states differ by {rel:.3g} (max, relative){how}"
        untouched = [0, 2]
        if not torch.equal(got_states[untouched], states[untouched]):
            return f"slots of no sequence were written{how}"
    return ""


def public_chunk(*, kda: bool) -> Callable[..., Any]:
    """fla's public chunked prefill: ``chunk_kda`` or ``chunk_gated_delta_rule`` (CUDA)."""
    if kda:
        from fla.ops.kda import chunk_kda

        return chunk_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def public_simple_gla() -> Callable[..., Any]:
    """fla's public ``chunk_simple_gla`` (Mamba2's SSD as scalar-gated linear attention)."""
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla


def naive_recurrences() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """fla's naive recurrences (GDN, KDA): the CPU fallback's reference math."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda.naive import naive_recurrent_kda

    return naive_recurrent_gated_delta_rule, naive_recurrent_kda
