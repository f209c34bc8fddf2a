"""What the FlashInfer backends can serve, and whether this machine can run them.

Capabilities are those of FlashInfer 0.6 and 0.7 (0.6.7, 0.6.13, 0.7.2.post1 and 0.7.4 read) as
their Python wrappers and JIT templates compile them:

- full attention: head dims 64 / 128 / 256 (FA2 and FA3 prefill and CUDA-core decode all have
  them), ``head_dim == head_dim_v`` (the paged kernels require equal K and V strides), bf16 /
  fp16 activations, bf16 / fp16 / fp8-e4m3 KV (bf16 queries over an fp8 cache run the FA2 kernels;
  fp8 needs sm89+, which the selector checks through ``DeviceCapabilities.supports_fp8``), any page
  size (the kernels divide by a runtime ``uint_fastdiv``), NHD layout, causal only, sliding window
  (``window_left``) and logits soft-cap, CUDA-graph modes ``none`` / ``decode`` / ``full``
  (a captured mixed step: the paged prefill wrapper's graph mode, whose scheduler keeps the
  capture's batch size and row count).
  Attention sinks (gpt-oss) on every release: ``run()`` of each wrapper returns the rows'
  log-sum-exp, and the plugin rescales the output by it (:mod:`attn_plugin_flashinfer.sinks`),
  with any window, soft-cap, cache dtype and graph mode. (The ``sinks`` argument of ``run()``
  reaches only the trtllm-gen (sm100) and cuDNN kernels, and the FA2/FA3 ``AttentionSink`` JIT
  variant of the prefill wrapper was 3.5-7x slower than the plain decode on the H200.)
- MLA: ``kv_lora_rank = 512``, ``qk_rope_head_dim = 64`` (the head dims FlashInfer's MLA kernels
  are written for: the absorbed query is 576 wide, the output 512), bf16 / fp16 with a KV cache of
  the same dtype; graph mode ``decode`` on the 0.6 releases only (:func:`graph_modes`).

Both need compute capability >= 8.0, a CUDA device, an importable ``flashinfer`` and a CUDA
compiler (kernels are JIT-compiled with ``nvcc`` on first use).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from attn_core.backend import BackendCapabilities
from attn_core.specs import GraphMode

__all__ = [
    "FULL_CAPABILITIES",
    "FULL_HEAD_DIMS",
    "MAX_SPECULATIVE_TOKENS",
    "MLA_CAPABILITIES",
    "MLA_KV_LORA_RANK",
    "MLA_ROPE_DIM",
    "Availability",
    "graph_modes",
    "probe",
]

#: Head dims FlashInfer compiles for every paged path we use (FA2, FA3, CUDA-core decode).
FULL_HEAD_DIMS = frozenset({64, 128, 256})
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
#: Draft tokens per request a verify step may carry: the prefill kernels take any query length;
#: the bound only keeps the workspace sizing honest (tokens = batch * (k + 1)).
MAX_SPECULATIVE_TOKENS = 16

FULL_CAPABILITIES = BackendCapabilities(
    kinds={"full"},
    device_types={"cuda"},
    min_compute_capability=(8, 0),
    dtypes={"bfloat16", "float16"},
    kv_dtypes={"bfloat16", "float16", "fp8_e4m3"},
    head_dims=FULL_HEAD_DIMS,
    page_sizes=None,
    kv_layouts={"NHD"},
    # full: a mixed step is captured through the paged prefill wrapper in CUDA-graph mode
    # (fixed buffers, planned at the captured batch size and token count; context.py)
    graph_modes={GraphMode.NONE, GraphMode.DECODE, GraphMode.FULL},
    max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
    causal=True,
    non_causal=False,
    sliding_window=True,
    chunked_attention=False,  # FlashInfer's kernels have no chunk mask, but its plans are
    # built from the batch's metadata and its causal masks are bottom-right aligned: a local
    # virtual batch (attn_core.local_attention) is exact, the context sized for its requests
    chunked_virtual_batches=True,
    logits_soft_cap=True,
    sinks=True,  # the output rescaled by run()'s log-sum-exp (sinks.py), every release
    deterministic=False,
    mixed_kv_dtypes=False,  # kernels are built for (q, kv) = (bf16, bf16), (fp16, fp16), fp8 KV
)

MLA_CAPABILITIES = BackendCapabilities(
    kinds={"mla"},
    device_types={"cuda"},
    min_compute_capability=(8, 0),
    dtypes={"bfloat16", "float16"},
    kv_dtypes={"bfloat16", "float16"},
    head_dims={MLA_KV_LORA_RANK + MLA_ROPE_DIM, MLA_KV_LORA_RANK},
    page_sizes=None,
    kv_layouts={"NHD"},
    graph_modes={GraphMode.NONE, GraphMode.DECODE},
    max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
    causal=True,
    non_causal=False,
    deterministic=False,
    mixed_kv_dtypes=False,
)


#: The first release whose captured MLA decode failed the conformance kit on the H200 (0.7.4):
#: replayed after a re-plan it gave another batch's output (6798 of 8192 elements wrong, max
#: |diff| 3.1, the replay's requests reordered). From it on the MLA backend declares no graph
#: mode; the 0.6 releases pass. On an H100 the kit with the mode forced passed under 0.7.4 (8
#: seeds), as do the plugin's replay test and FlashInfer's wrapper alone
#: (test_flashinfer_mla_graph_wrapper_replays_a_new_plan); the H200 failure is not located, so
#: the mode stays undeclared until an H200 run passes (test_cuda_graph_mla_replay runs it
#: forced, as a non-strict xfail).
#:
#: The full backend's graph mode ``full`` failed the same kit run, but that failure was the
#: plugin's, on every release (a split whose requests fill every row gave run() the padded
#: token count where FlashInfer takes exactly the plan's query rows). Fixed, it is declared on
#: every release: on 0.7.4 the kit's graph and update checks and all four variants of
#: test_cuda_graph_full_mixed_step_replays_other_splits passed.
MLA_GRAPH_FAILED_FROM = (0, 7)
#: The flashinfer-python releases the plugin is tested on: the package's requirement. A release
#: outside it (installed past pip, e.g. with ``--no-deps`` beside another stack) still runs the
#: public ``plan()``/``run()``, without what depends on a release's behaviour (see
#: :func:`outside_supported`).
SUPPORTED_RELEASES = ">=0.6.7,<0.8"


def outside_supported(version: str | None) -> bool:
    """Whether ``version`` is a release outside :data:`SUPPORTED_RELEASES` (False where it
    cannot be read: :func:`graph_modes` then declares less by itself)."""
    try:
        return Version(version or "") not in SpecifierSet(SUPPORTED_RELEASES)
    except InvalidVersion:
        return False


def graph_modes(version: str | None) -> tuple[frozenset[GraphMode], frozenset[GraphMode], str]:
    """``(full backend's graph modes, MLA backend's, the MLA backend's note in attn list)`` for
    the installed release ``version``; the note is "" where the release keeps every graph
    mode. MLA graph decode is declared on 0.6 releases only: never where ``version`` cannot
    say which release is installed (empty, unparsable, a source build's ``0.0.0+unknown``)."""
    full = frozenset(FULL_CAPABILITIES.graph_modes)
    mla = frozenset(MLA_CAPABILITIES.graph_modes)
    try:
        release = Version(version or "").release[:2]
    except InvalidVersion:
        release = None
    if release is not None and (0, 6) <= release < MLA_GRAPH_FAILED_FROM:
        return full, mla, ""
    if not version:  # not installed or not importable: the backend's status says which
        why = "no flashinfer release to read: see the backend's status"
    elif release is None:
        why = f"flashinfer version unknown ({version!r}): graph decode is declared on 0.6 only"
    elif release >= MLA_GRAPH_FAILED_FROM:
        why = (
            f"flashinfer {version}: withdrawn from 0.7 on: 0.7.4's captured MLA decode replay "
            "failed the conformance kit on an H200; 0.6 releases pass"
        )
    else:
        why = f"flashinfer {version}: graph decode is declared on 0.6 releases only"
    return full, frozenset({GraphMode.NONE}), f"MLA graph modes: none ({why})"


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether the backends can run here; ``reason`` lists every missing piece when not."""

    available: bool
    reason: str | None
    version: str


def _cuda_reason() -> str | None:
    try:
        import torch
    except Exception as exc:  # pragma: no cover - attn-core itself needs torch
        return f"torch is not importable: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _toolchain_reason() -> str | None:
    """FlashInfer JIT-compiles its kernels: it needs nvcc (on PATH or under CUDA_HOME)."""
    if shutil.which("nvcc"):
        return None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return None
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return None
    return (
        "no CUDA compiler for FlashInfer's JIT kernels (nvcc is not on PATH and neither "
        "CUDA_HOME nor /usr/local/cuda has bin/nvcc)"
    )


def _flashinfer_reason(cuda_ok: bool) -> tuple[str | None, str, object]:
    """Import flashinfer (only where it could run: importing it costs 1-3 s):
    ``(why not, its __version__, the module or None)``."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not importable: no module named 'flashinfer'", "", None
    if not cuda_ok:
        return None, "", None  # installed; not imported on a machine that cannot run it anyway
    try:
        module = importlib.import_module("flashinfer")
    except Exception as exc:
        return f"flashinfer is not importable: {type(exc).__name__}: {exc}", "", None
    return None, str(getattr(module, "__version__", "")), module


def _installed_version(module_version: str) -> str:
    """The installed ``flashinfer-python`` distribution's version (what pip resolved and the
    fast path's gate reads), else the imported module's ``__version__``, else ""."""
    from attn_plugin_flashinfer import compat

    return compat.distribution_version() or module_version


def probe() -> Availability:
    """Check CUDA, flashinfer and the JIT toolchain; every failing check is named in ``reason``.

    Where flashinfer is imported (CUDA present) the probe also runs the checks that need no GPU
    work: the fast path's import-level facts (``compat.FastPath.probe``, via
    ``compat.fast_path``). The numeric self-check compiles kernels (a cold JIT takes longer
    than a probe may), so it runs where a context is first allocated."""
    from attn_plugin_flashinfer import compat

    reasons: list[str] = []
    cuda = _cuda_reason()
    if cuda:
        reasons.append(cuda)
    fi, module_version, module = _flashinfer_reason(cuda is None)
    if fi:
        reasons.append(fi)
    version = _installed_version(module_version) if not fi else module_version
    tool = _toolchain_reason()
    if tool:
        reasons.append(tool)
    if module is not None:
        compat.fast_path(module)  # the import-level facts, kept for attn list's note
    if reasons:
        return Availability(False, "; ".join(reasons), version)
    return Availability(True, None, version)
