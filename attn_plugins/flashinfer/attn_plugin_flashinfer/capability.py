"""What the FlashInfer backends can serve, and whether this machine can run them.

Capabilities are those of FlashInfer 0.6 (0.6.7 and 0.6.13 read) as its Python wrappers and JIT
templates compile them:

- full attention: head dims 64 / 128 / 256 (FA2 and FA3 prefill and CUDA-core decode all have
  them), ``head_dim == head_dim_v`` (the paged kernels require equal K and V strides), bf16 /
  fp16 activations, bf16 / fp16 / fp8-e4m3 KV (bf16 queries over an fp8 cache run the FA2 kernels;
  fp8 needs sm89+, which the selector checks through ``DeviceCapabilities.supports_fp8``), any page
  size (the kernels divide by a runtime ``uint_fastdiv``), NHD layout, causal only, sliding window
  (``window_left``) and logits soft-cap. Attention sinks are *not* advertised: in 0.6.7 and
  0.6.13 the ``sinks`` argument of ``run()`` reaches only the trtllm-gen (sm100) kernels and is
  silently ignored by the FA2/FA3 paths.
- MLA: ``kv_lora_rank = 512``, ``qk_rope_head_dim = 64`` (the head dims FlashInfer's MLA kernels
  are written for: the absorbed query is 576 wide, the output 512), bf16 / fp16 with a KV cache of
  the same dtype.

Both need compute capability >= 8.0, a CUDA device, an importable ``flashinfer`` and a CUDA
compiler (kernels are JIT-compiled with ``nvcc`` on first use).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

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
    "probe",
]

#: Head dims FlashInfer 0.6.7 compiles for every paged path we use (FA2, FA3, CUDA-core decode).
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
    graph_modes={GraphMode.NONE, GraphMode.DECODE},
    max_speculative_tokens=MAX_SPECULATIVE_TOKENS,
    causal=True,
    non_causal=False,
    sliding_window=True,
    chunked_attention=False,  # FlashInfer's kernels have no chunk mask, but its plans are
    # built from the batch's metadata and its causal masks are bottom-right aligned: a local
    # virtual batch (attn_core.local_attention) is exact, the context sized for its requests
    chunked_virtual_batches=True,
    logits_soft_cap=True,
    sinks=False,
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


def _flashinfer_reason(cuda_ok: bool) -> tuple[str | None, str]:
    """Import flashinfer (only where it could run: importing it costs 1-3 s)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not importable: no module named 'flashinfer'", ""
    if not cuda_ok:
        return None, ""  # installed; not imported on a machine that cannot run it anyway
    try:
        module = importlib.import_module("flashinfer")
    except Exception as exc:
        return f"flashinfer is not importable: {type(exc).__name__}: {exc}", ""
    return None, str(getattr(module, "__version__", ""))


def probe() -> Availability:
    """Check CUDA, flashinfer and the JIT toolchain; every failing check is named in ``reason``."""
    reasons: list[str] = []
    cuda = _cuda_reason()
    if cuda:
        reasons.append(cuda)
    fi, version = _flashinfer_reason(cuda is None)
    if fi:
        reasons.append(fi)
    tool = _toolchain_reason()
    if tool:
        reasons.append(tool)
    if reasons:
        return Availability(False, "; ".join(reasons), version)
    return Availability(True, None, version)
