"""attn-plugin-triton-ssm: Triton kernels for Gated DeltaNet, KDA and Mamba2 layers (decode,
speculative verify with native or replay commit, causal conv1d update) and chunked prefill
through fla-core. The plugin wiring for attn-core lives in :mod:`attn_plugin_triton_ssm.plugin`.

Importing this package does not import the kernels (and so not triton): a server that only
lists plugins pays nothing. Use ``attn_plugin_triton_ssm.kernels``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
