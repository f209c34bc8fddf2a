"""Pure-PyTorch attention math for every layer kind; device-agnostic, float32 inside.

* :mod:`.attention`: softmax attention over a paged KV cache (full) and varlen (encoder).
* :mod:`.mla`: absorbed multi-head latent attention over a paged latent cache.
* :mod:`.linear`: linear attention / SSM (Gated DeltaNet, KDA, Mamba2, lightning attention) and
  the causal conv (also the whole core of the gated short conv).
"""

from __future__ import annotations

from attn_core.reference.ops import linear as _linear
from attn_core.reference.ops.attention import (
    FP8_DTYPE,
    dequantize_cache,
    paged_attention,
    quantize_for_cache,
    varlen_attention,
    write_paged_kv,
)
from attn_core.reference.ops.linear import *  # noqa: F403
from attn_core.reference.ops.mla import (
    mla_absorb_query,
    mla_output_from_latent,
    mla_paged_attention,
    mla_split_kv_b_proj,
    write_paged_latent,
)

__all__ = [
    "FP8_DTYPE",
    "dequantize_cache",
    "mla_absorb_query",
    "mla_output_from_latent",
    "mla_paged_attention",
    "mla_split_kv_b_proj",
    "paged_attention",
    "quantize_for_cache",
    "varlen_attention",
    "write_paged_kv",
    "write_paged_latent",
    *_linear.__all__,
]
