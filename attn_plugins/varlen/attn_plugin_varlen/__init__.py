"""attn-plugin-varlen: encoder attention (vision / audio towers) over packed variable-length
sequences, with no persistent KV.

Two backends, each advertising exactly what its code path serves:

- ``varlen:varlen`` - :func:`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside
  PyTorch, one launch for the whole ragged batch); CUDA, sm80+, bf16/fp16, head dims that are
  multiples of 8 up to 256, causal / bidirectional / sliding window.
- ``varlen:sdpa`` - :func:`torch.nn.functional.scaled_dot_product_attention` once per run of
  equal-length sequences (host offsets, no sync); CUDA, any float dtype and head dim.

The hooks live in :mod:`attn_plugin_varlen.plugin`, the kernel calls in
:mod:`attn_plugin_varlen.kernels`. Importing this package imports nothing heavy.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
