"""attn-plugin-fa3: full attention over attn-core's paged KV through the FlashAttention-3 API,
Hopper (sm90) only.

The API comes from flash-attn-4's Hopper path (``flash_attn.cute.interface``, FlashAttention-3's
design in the CuTe DSL; the one that loads on the project's H200) or, failing that, from the
official FlashAttention-3 build (``flash_attn_interface``). See :mod:`attn_plugin_fa3.providers`
for what was read in the 4.0.0b14 sources, :mod:`attn_plugin_fa3.plugin` for the hooks.
Importing this package imports no kernel library.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
