"""attn-plugin-flashinfer: FlashInfer (0.6.7 to 0.7.x) kernels behind the attn-core plugin contract.

Two backends: ``flashinfer:flashinfer`` (full attention over the core's paged K/V: decode, prefill,
mixed and speculative-verify steps, GQA/MQA, sliding window, logits soft-cap, bf16/fp16 and fp8
e4m3 KV, CUDA-graph decode) and ``flashinfer:flashinfer_mla`` (absorbed MLA over the paged latent
cache). Importing this package imports neither torch.cuda nor flashinfer; the plugin wiring is in
:mod:`attn_plugin_flashinfer.plugin`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
