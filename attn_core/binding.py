"""LayerAttentionBinding: what one model layer holds to run its attention.

A binding carries the layer's own parameters (index, scale, sinks, views of its persistent state)
and the group's shared context and forward callable, bound once when the context was allocated.
The per-step call is ``binding.forward(q, k, v, out=out, **inputs)``: input checks, one direct call
into the backend, and the ``out`` contract:

- the backend wrote into ``out`` and returned it (or a view of the same memory): returned as is;
- the backend returned a view of a padded / strided buffer, or a temporary: the core copies it
  into ``out``;
- ``out`` is None: whatever the backend returned is returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from attn_core.errors import BackendInputError, NonFiniteInputError, PluginError
from attn_core.specs import (
    CONV_ACTIVATIONS,
    LINEAR_LAYER_INPUTS,
    LayerKind,
    LayerSpec,
    LinearVariant,
    Phase,
    torch_dtype,
)
from attn_core.step_buckets import pick_for_step

if TYPE_CHECKING:
    from attn_core.backend import Backend
    from attn_core.batch import AttentionBatch
    from attn_core.context import AttentionContext

__all__ = ["GroupRuntime", "LayerAttentionBinding"]

#: (backend, context, bound forward) of one backend of a group
_Target = tuple["Backend", "AttentionContext", Callable[..., Any]]


class GroupRuntime:
    """The state shared by all layers of one group: context, bound forward, current batch.

    A plan may serve a group's phases (prefill / mixed, decode, verify) by different backends,
    each with its own context over the group's one persistent state. ``phase_targets`` holds
    ``(backend, context, forward)`` per phase; :meth:`use_phase` (called by the runtime's
    ``prepare`` / ``update``, once per step) swaps those three pointers, so that every layer's
    ``forward`` calls the step's backend at no extra cost. Empty: one backend serves all.
    """

    __slots__ = (
        "backend",
        "batch",
        "check_finite",
        "context",
        "device_index",
        "forward",
        "group_id",
        "phase_buckets",
        "phase_targets",
        "ran",
        "records_ops",
        "request_rules",
        "spec",
        "state",
    )

    def __init__(
        self,
        group_id: str,
        spec: LayerSpec,
        backend: Backend,
        context: AttentionContext,
        forward: Callable[..., torch.Tensor],
        state: Any = None,
        device: torch.device | str = "cpu",
        check_finite: str | None = None,
    ) -> None:
        self.group_id = group_id
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        #: ``Tensor.get_device()`` of the tensors this group's layers take (-1: CPU), checked
        #: per forward: a kernel handed another device's address faults the whole context.
        self.device_index = device.index if device.type != "cpu" else -1
        self.state = state  # the persistent state the group's pages live in (None: encoder)
        self.spec = spec
        self.backend = backend
        self.context = context
        self.forward = forward
        self.batch: AttentionBatch | None = None
        #: ``(layer, "forward" | "conv1d")`` of each op that returned since the batch was
        #: prepared (or updated): a verify step commits only when every layer of the group ran
        #: (:meth:`last_op`).
        self.ran: set[tuple[int, str]] = set()
        #: whether ``ran`` is kept: a linear group's (its verify steps commit); attention
        #: groups' forwards skip it (the decode path's host time)
        self.records_ops = spec.kind is LayerKind.LINEAR
        #: Why inputs are checked for NaN / inf before each forward (the setting that asked
        #: for it, named in the error), or None: not checked.
        self.check_finite = check_finite
        #: per phase, (backend, context, forward) when phases differ in backend; else empty
        self.phase_targets: dict[Phase, _Target] = {}
        #: per phase whose tuning data has another fastest backend for some step size:
        #: ((largest step size, target), ...) ascending (see PhaseChoice.by_step_size)
        self.phase_buckets: dict[Phase, tuple[tuple[int, _Target], ...]] = {}
        #: prefill steps whose token bucket switches by requests (PhaseChoice.by_requests):
        #: ((tokens above, tokens at most, requests at most, target), ...)
        self.request_rules: tuple[tuple[int, int, int, _Target], ...] = ()

    def last_op(self) -> str:
        """The op a layer of this group runs last in a step: ``conv1d`` for a short conv (LFM2:
        conv state only), else ``forward``."""
        short_conv = self.spec.linear_variant is LinearVariant.SHORT_CONV
        return "conv1d" if short_conv else "forward"

    def use_phase(self, phase: Phase, size: int = 0, requests: int | None = None) -> None:
        """Make the backend of ``phase`` (and, where the plan switches by step size, of a step
        of ``size``: padded requests, or padded query tokens in prefill, in ``requests``
        requests) the group's current one; a phase without an entry keeps the current
        backend."""
        rules = self.request_rules if phase is Phase.PREFILL else ()
        target: _Target | None = pick_for_step(
            self.phase_buckets.get(phase, ()), rules, self.phase_targets.get(phase), size, requests
        )
        if target is not None and target[1] is not self.context:
            self.backend, self.context, self.forward = target

    def current_batch(self, layer: int, call: str) -> AttentionBatch:
        """The prepared batch, refused when it is missing or stale (see :meth:`check_fresh`)."""
        batch = self.batch
        if batch is None:
            raise RuntimeError(
                f"layer {layer} (group {self.group_id!r}): {call} before runtime.prepare(batch)"
            )
        self.check_fresh(batch, f"layer {layer}")
        return batch

    def check_fresh(self, batch: AttentionBatch, where: str) -> None:
        """Refuse a stale batch: one built before pages or slots were freed or replaced, or by
        another PersistentState (epochs are unique in the process). Its page table, slot
        mapping and state indices may point at another request's state, or past the pools."""
        state = self.state
        if state is not None and batch.state_epoch != state.epoch:
            raise BackendInputError(
                group=self.group_id,
                backend=self.backend.qualified_name,
                what=f"{where}: stale batch, or one built by another PersistentState (pages or "
                "slots freed or replaced after it was built; rebuild it with this runtime's "
                "state)",
                expected=f"state epoch {state.epoch}",
                got=f"batch built at epoch {batch.state_epoch}",
            )

    def plugin_error(self, stage: str, exc: BaseException, layer: int | None) -> PluginError:
        return PluginError(
            self.backend.plugin, self.backend.name, stage, exc, group=self.group_id, layer=layer
        )


class LayerAttentionBinding:
    """One layer's attention: its own parameters plus its group's backend.

    :ivar layer_index: the layer's index in the model.
    :ivar spec: the group's layer spec.
    :ivar scale: softmax scale (``spec.scale`` unless the layer overrides it).
    :ivar sinks: ``[num_heads]`` float32 attention-sink logits (gpt-oss) or None.
    :ivar kv: the layer's KV cache views (``.k``/``.v`` or ``.latent``, scales) or None.
    :ivar linear_state: the layer's conv / SSM state pools (``.conv``, ``.ssm``) or None.
    """

    __slots__ = (
        "_conv_tokens",
        "_conv_w_shape",
        "_conv_x_shape",
        "_dtype",
        "_group",
        "_input_shapes",
        "_input_tails",
        "_k_shape",
        "_kind",
        "_kv_tail",
        "_o_shape",
        "_out_tail",
        "_q_shape",
        "_q_tail",
        "_tokens",
        "_v_shape",
        "_v_tail",
        "kv",
        "layer_index",
        "linear_state",
        "scale",
        "sinks",
        "spec",
    )

    def __init__(
        self,
        layer_index: int,
        group: GroupRuntime,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
        kv: Any = None,
        linear_state: Any = None,
    ) -> None:
        spec = group.spec
        self.layer_index = layer_index
        self.spec = spec
        self._group = group
        self._kind = spec.kind
        self.scale = spec.scale if scale is None else float(scale)
        if spec.has_sinks and sinks is None:
            raise ValueError(
                f"layer {layer_index} (group {group.group_id!r}) has sinks in its spec but no "
                f"sinks tensor [num_heads={spec.num_heads}] was given"
            )
        if sinks is not None and not spec.has_sinks:
            # a backend reads the spec (FlashInfer applies none), another the tensor
            raise ValueError(
                f"layer {layer_index} (group {group.group_id!r}): a sinks tensor was given but "
                "its spec has has_sinks=False (declare them in the spec, or give none)"
            )
        if sinks is not None and tuple(sinks.shape) != (spec.num_heads,):
            raise ValueError(
                f"layer {layer_index}: sinks shape {tuple(sinks.shape)}, expected "
                f"({spec.num_heads},)"
            )
        self.sinks = sinks
        self.kv = kv
        self.linear_state = linear_state
        self._dtype = torch_dtype(spec.dtype)
        self._tokens = -1  # token count the cached expected shapes below are for
        # conv1d's accepted shapes (linear layers), cached by token count like forward's
        self._conv_tokens = -1
        self._conv_x_shape: torch.Size | None = None
        self._conv_w_shape = torch.Size(spec.conv_dims) if spec.has_conv else None
        H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        # per-token shapes of q, k, v (None: v is not given) and out
        self._q_tail: tuple[int, ...]
        self._kv_tail: tuple[int, ...]
        self._v_tail: tuple[int, ...] | None
        self._out_tail: tuple[int, ...]
        if spec.kind is LayerKind.MLA:
            self._q_tail = (H, D)
            self._kv_tail = (D,)
            self._v_tail = None
            self._out_tail = (H, Dv)
        elif spec.kind is LayerKind.LINEAR:
            self._q_tail = (Hkv, D)
            self._kv_tail = (Hkv, D)
            self._v_tail = (H, Dv)
            self._out_tail = (H, Dv)
        else:
            self._q_tail = (H, D)
            self._kv_tail = (Hkv, D)
            self._v_tail = (Hkv, Dv)
            self._out_tail = (H, Dv)
        # a linear layer's own inputs (docs/reference.md's table): name -> (per token, tail)
        self._input_tails: dict[str, tuple[bool, tuple[int, ...]]] = {}
        self._input_shapes: dict[str, torch.Size] = {}
        variant = spec.linear_variant if spec.kind is LayerKind.LINEAR else None
        if variant in (LinearVariant.GATED_DELTANET, LinearVariant.KDA):
            g_tail = (H, D) if variant is LinearVariant.KDA else (H,)
            self._input_tails = {"g": (True, g_tail), "beta": (True, (H,))}
        elif variant in (LinearVariant.MAMBA2, LinearVariant.MAMBA1):
            a_log = (H, D) if variant is LinearVariant.MAMBA1 else (H,)
            self._input_tails = {
                "dt": (True, (H,)),
                "A_log": (False, a_log),
                "D": (False, (H,)),
                "dt_bias": (False, (H,)),
            }
        elif variant is LinearVariant.LIGHTNING:
            self._input_tails = {"slope": (False, (H,))}

    # -- accessors -------------------------------------------------------------------------
    @property
    def group_id(self) -> str:
        return self._group.group_id

    @property
    def backend(self) -> Backend:
        return self._group.backend

    def context(self, batch: AttentionBatch | None = None) -> AttentionContext:
        """The group's current context (prepared for ``batch`` by the runtime)."""
        if batch is not None and self._group.batch is not batch:
            raise ValueError(
                f"layer {self.layer_index} (group {self.group_id!r}): the context was prepared "
                f"for step {getattr(self._group.batch, 'step', None)}, not for step {batch.step}; "
                "call runtime.prepare(batch) first"
            )
        return self._group.context

    @property
    def batch(self) -> AttentionBatch | None:
        return self._group.batch

    # -- the hot path ----------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        **inputs: Any,
    ) -> torch.Tensor:
        """Run this layer's attention for the prepared batch.

        :param q: ``[T, ...]`` queries (see :mod:`attn_core.specs` for each kind's layout).
        :param k: new keys / latent, or None where the kind has none.
        :param v: new values, or None.
        :param out: caller-owned output ``[T, num_heads, head_dim_v]``; filled on return.
        :param inputs: kind-specific tensors (``g``, ``beta``, ``dt``, ...).
        """
        group = self._group
        batch = group.batch
        if batch is None:
            batch = group.current_batch(self.layer_index, "forward")  # raises: not prepared
        tokens = batch.padded_tokens
        if tokens != self._tokens:
            self._expect(tokens)
        dtype = self._dtype
        dev = group.device_index
        # One fused test on the hot path; the slow path below names what is wrong. A meta
        # tensor reports device -1, as a CPU one does: CPU groups also test is_meta. A
        # non-contiguous out may overlap itself (an expand): the slow path looks closer.
        if (
            q.get_device() != dev
            or q.shape != self._q_shape
            or q.dtype is not dtype
            or q.stride(-1) != 1
            or k is None
            or k.shape != self._k_shape
            or k.dtype is not dtype
            or k.get_device() != dev
            or (v is None) != (self._v_shape is None)
            or (v is not None and (v.shape != self._v_shape or v.dtype is not dtype))
            or (v is not None and v.get_device() != dev)
            or (
                out is not None
                and (
                    out.shape != self._o_shape
                    or out.dtype is not dtype
                    or out.get_device() != dev
                    or not out.is_contiguous()
                )
            )
            or (
                dev < 0
                and (
                    q.is_meta
                    or k.is_meta
                    or (v is not None and v.is_meta)
                    or (out is not None and out.is_meta)
                )
            )
        ):
            self._check(q, k, v, out, tokens)
        if inputs and self._input_shapes:  # a linear layer's own inputs, where given
            shapes = self._input_shapes
            for name, t in inputs.items():
                want = shapes.get(name)
                if want is not None and isinstance(t, torch.Tensor) and t.shape != want:
                    variant = self.spec.linear_variant
                    what = f"{variant.value if variant else 'linear'} input {name} shape"
                    self._bad(what, list(want), list(t.shape))
        state = group.state
        if state is not None and batch.state_epoch != state.epoch:
            group.check_fresh(batch, f"layer {self.layer_index}")  # raises: stale
        if group.check_finite is not None:
            self._check_finite(batch, (("q", q), ("k", k), ("v", v), *inputs.items()))
        try:
            result = group.forward(self, q, k, v, out, **inputs)
        except BackendInputError:
            raise  # the backend named a bad input: the caller's to fix
        except Exception as exc:
            raise group.plugin_error("forward", exc, self.layer_index) from exc
        if result is out and out is not None:
            if group.records_ops:
                group.ran.add((self.layer_index, "forward"))
            return out
        if (
            not isinstance(result, torch.Tensor)
            or result.shape != self._o_shape
            or result.dtype is not dtype
            or result.get_device() != dev
        ):
            self._bad_result(
                result, "forward", "a tensor [T, num_heads, head_dim_v]", self._o_shape, dtype
            )
        if group.records_ops:
            group.ran.add((self.layer_index, "forward"))
        if out is None:
            return result
        if (
            result.data_ptr() != out.data_ptr()
            or result.stride() != out.stride()
            or result.shape != out.shape
        ):
            out.copy_(result)
        return out

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        activation: str | None = "silu",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv of a linear layer, with the layer's conv state.

        :param x: ``[T, conv_channels]`` pre-conv activations of the step's new tokens.
        :param weight: ``[conv_channels, conv_kernel_size]``.
        :param bias: ``[conv_channels]`` or None.
        :returns: ``[T, conv_channels]`` in ``x.dtype``; the conv state is updated in place.
        """
        group = self._group
        if self._conv_w_shape is None:
            what = self.spec.kind.value
            if self._kind is LayerKind.LINEAR:
                what = f"linear {self.spec.linear_variant}"
            raise TypeError(f"layer {self.layer_index} is {what}: it has no conv")
        # conv1d writes the conv state of every slot the batch names, as forward writes KV and
        # SSM state: the same stale-batch rule holds.
        batch = group.current_batch(self.layer_index, "conv1d")
        # One fused test on the hot path (shapes accepted before for this token count); the
        # slow path names what is wrong.
        if (
            batch.padded_tokens != self._conv_tokens
            or x.shape != self._conv_x_shape
            or weight.shape != self._conv_w_shape
            or (out is not None and (out.shape != x.shape or out.dtype is not x.dtype))
            or (bias is not None and bias.shape != weight.shape[:1])
            or activation not in CONV_ACTIVATIONS
        ):
            self._check_conv(x, weight, bias, activation, out, batch)
        if group.check_finite is not None:
            self._check_finite(batch, (("conv x", x),))
        try:
            # a linear group's context has conv1d (runtime._check_context checked it)
            result = group.context.conv1d(  # type: ignore[attr-defined]
                self, x, weight, bias, activation=activation, out=out
            )
        except BackendInputError:
            raise
        except Exception as exc:
            raise group.plugin_error("conv1d", exc, self.layer_index) from exc
        if (
            not isinstance(result, torch.Tensor)
            or result.shape != x.shape
            or result.dtype is not x.dtype
        ):
            self._bad_result(result, "conv1d", "a tensor [T, conv_channels]", x.shape, x.dtype)
        if group.records_ops:
            group.ran.add((self.layer_index, "conv1d"))
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    # -- checks ----------------------------------------------------------------------------
    def _bad_result(
        self, result: object, stage: str, what: str, shape: torch.Size, dtype: torch.dtype
    ) -> NoReturn:
        """A ``stage`` (forward / conv1d) result that is not ``what`` (``shape``, ``dtype``, on
        the group's device): the plugin broke the contract (copying it would broadcast or cast
        silently)."""
        problem: tuple[object, object]
        if not isinstance(result, torch.Tensor):
            problem = (what, "None" if result is None else type(result).__name__)
        elif result.shape != shape:
            problem = (tuple(shape), tuple(result.shape))
        elif result.dtype is not dtype:
            problem = (dtype, result.dtype)
        else:
            problem = (f"device {self._group.device_index}", str(result.device))
        expected, got = problem
        raise self._group.plugin_error(
            stage,
            TypeError(f"{stage} returned a bad result: expected {expected}, got {got}"),
            self.layer_index,
        )

    def _check_finite(self, batch: AttentionBatch, tensors: Iterable[tuple[str, object]]) -> None:
        """Refuse NaN / inf in ``tensors`` ((name, tensor) pairs), naming the first request whose
        token holds one. A tensor of ``padded_tokens`` rows is per token: only the real tokens'
        rows are checked (a captured graph's padding may hold anything); any other tensor (a
        per-layer input such as ``A_log``) is checked whole."""
        group = self._group
        source = group.check_finite
        if source is None:  # not asked for
            return
        for name, t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            per_token = (
                t.dim() > 0
                and t.shape[0] == batch.padded_tokens
                and name not in LINEAR_LAYER_INPUTS
            )
            flat = t[: batch.num_tokens].reshape(batch.num_tokens, -1) if per_token else t
            bad = ~torch.isfinite(flat)
            if not bool(bad.any()):
                continue
            rid = position = None
            if per_token:
                row = int(bad.any(dim=1).nonzero()[0, 0])
                value = float(flat[row][bad[row]][0])
                qsl = batch.query_start_loc_cpu[: batch.num_reqs + 1]
                req = int(np.searchsorted(qsl, row, side="right")) - 1
                rid, position = batch.request_ids[req], row - int(qsl[req])
            else:
                value = float(flat[bad][0])
            raise NonFiniteInputError(
                group=group.group_id,
                backend=group.backend.qualified_name,
                layer=self.layer_index,
                tensor=name,
                request_id=rid,
                position=position,
                value=value,
                source=source,
            )

    def _check_conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
        out: torch.Tensor | None,
        batch: AttentionBatch,
    ) -> None:
        """conv1d's input checks; remembers the accepted shapes for the batch's token count.
        ``out`` must be what the call returns, ``x``'s shape and dtype on its device: one the
        plugin could not write would fail after the conv state moved. ``bias`` is the layer's
        ``[conv_channels]`` (a ``[T, C]`` one would broadcast over a decode step's requests)."""
        spec = self.spec
        expected = spec.conv_dims
        if tuple(weight.shape) != expected:
            self._bad("conv weight shape", expected, tuple(weight.shape))
        if bias is not None and tuple(bias.shape) != expected[:1]:
            self._bad("conv bias shape", expected[:1], tuple(bias.shape))
        if activation not in CONV_ACTIVATIONS:
            self._bad("conv activation", list(CONV_ACTIVATIONS), activation)
        if x.dim() != 2 or x.shape[1] != spec.conv_channels:
            self._bad("conv input shape", f"[T, {spec.conv_channels}]", tuple(x.shape))
        # the layer's dtype, as forward's q (a float64 or int x would come back in its dtype)
        for what, t in (("conv input", x), ("conv weight", weight), ("conv bias", bias)):
            if t is not None and t.dtype != self._dtype:
                self._bad(f"{what} dtype", self._dtype, t.dtype)
        if x.shape[0] != batch.padded_tokens:
            self._bad("conv input tokens", batch.padded_tokens, x.shape[0])
        if out is not None:
            self._check_out("conv out", out, tuple(x.shape), x.dtype)
            if out.device != x.device:
                self._bad("conv out device", str(x.device), str(out.device))
        self._conv_tokens, self._conv_x_shape = batch.padded_tokens, x.shape

    def _expect(self, tokens: int) -> None:
        self._input_shapes = {
            name: torch.Size((tokens, *tail) if per_token else tail)
            for name, (per_token, tail) in self._input_tails.items()
        }
        self._q_shape = torch.Size((tokens, *self._q_tail))
        self._k_shape = torch.Size((tokens, *self._kv_tail))
        self._v_shape = None if self._v_tail is None else torch.Size((tokens, *self._v_tail))
        self._o_shape = torch.Size((tokens, *self._out_tail))
        self._tokens = tokens

    def _bad(self, what: str, expected: object, got: object) -> NoReturn:
        raise BackendInputError(
            group=self._group.group_id,
            backend=self._group.backend.qualified_name,
            what=f"layer {self.layer_index}: {what}",
            expected=expected,
            got=got,
        )

    def _check(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        out: torch.Tensor | None,
        tokens: int,
    ) -> None:
        dev = self._group.device_index
        for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
            if x is not None and (x.get_device() != dev or x.is_meta):
                where = "cpu" if dev < 0 else f"cuda:{dev}"
                self._bad(f"{name} device", f"the group's device {where}", str(x.device))
        if q.dtype != self._dtype:
            self._bad("q dtype", self._dtype, q.dtype)
        if q.shape[1:] != self._q_tail or q.shape[0] != tokens:
            self._bad("q shape", (tokens, *self._q_tail), tuple(q.shape))
        if q.stride(-1) != 1:
            self._bad("q layout", "unit stride in the last dim", q.stride())
        if k is not None:
            if k.shape[1:] != self._kv_tail or k.shape[0] != tokens:
                self._bad("k shape", (tokens, *self._kv_tail), tuple(k.shape))
            if k.dtype != self._dtype:
                self._bad("k dtype", self._dtype, k.dtype)
        else:
            self._bad("k", "a tensor", None)
        if self._v_tail is not None:
            if v is None:
                self._bad("v", "a tensor", None)
            if v.shape[1:] != self._v_tail or v.shape[0] != tokens:
                self._bad("v shape", (tokens, *self._v_tail), tuple(v.shape))
            if v.dtype != self._dtype:
                self._bad("v dtype", self._dtype, v.dtype)
        if out is not None:
            self._check_out("out", out, (tokens, *self._out_tail), self._dtype)

    def _check_out(
        self, what: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        """The caller's ``out`` (``what`` names it): ``shape`` and ``dtype``, every element at
        its own address (the plugin writes it; a broadcast view would sum rows into one)."""
        if tuple(out.shape) != tuple(shape):
            self._bad(f"{what} shape", tuple(shape), tuple(out.shape))
        if out.dtype != dtype:
            self._bad(f"{what} dtype", dtype, out.dtype)
        if _overlaps_itself(out):
            self._bad(
                f"{what} layout",
                "every element at its own address",
                f"strides {out.stride()} over shape {tuple(out.shape)}",
            )


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an ``expand``, an ``as_strided``).

    Dims sorted by stride must each step over everything the smaller ones span; layouts that
    interleave dims another way are reported as overlapping too (none of the backends reads
    such an ``out``).
    """
    span = 1  # elements the smaller dims reach: the next dim must step past them
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1),
        key=lambda d: d[1],
    ):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False
