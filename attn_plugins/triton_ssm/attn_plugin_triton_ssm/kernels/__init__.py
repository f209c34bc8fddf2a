"""Triton kernels for linear-attention / SSM layers, with the recurrent and conv state in slots.

Layouts follow ``attn_core.specs``: recurrent state ``[S, Hv, Dk, Dv]`` (slot, value head, key
dim, value dim; Mamba2: ``[S, H, N, P]``; Mamba1: ``[S, D, N, 1]``), conv state
``[S, C, K - 1]``; ``state_indices`` give each request's slot and ``-1`` marks a padding row.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors
through Triton's interpreter (``INTERPRETED`` tells which build this process has).
"""

from __future__ import annotations

from attn_plugin_triton_ssm.kernels._common import INTERPRETED
from attn_plugin_triton_ssm.kernels.conv1d import causal_conv1d_commit, causal_conv1d_update
from attn_plugin_triton_ssm.kernels.delta_rule import (
    gdn_commit,
    gdn_decode,
    gdn_replay_commit,
    gdn_verify_native,
    gdn_verify_replay,
    kda_commit,
    kda_decode,
    kda_replay_commit,
    kda_verify_native,
    kda_verify_replay,
)
from attn_plugin_triton_ssm.kernels.mamba1 import (
    mamba1_commit,
    mamba1_decode,
    mamba1_replay_commit,
    mamba1_scan,
)
from attn_plugin_triton_ssm.kernels.mamba2 import mamba2_decode
from attn_plugin_triton_ssm.kernels.prefill import gdn_prefill, kda_prefill, mamba2_prefill
from attn_plugin_triton_ssm.kernels.ssd import mamba2_ssd_triton

__all__ = [
    "INTERPRETED",
    "causal_conv1d_commit",
    "causal_conv1d_update",
    "gdn_commit",
    "gdn_decode",
    "gdn_prefill",
    "gdn_replay_commit",
    "gdn_verify_native",
    "gdn_verify_replay",
    "kda_commit",
    "kda_decode",
    "kda_prefill",
    "kda_replay_commit",
    "kda_verify_native",
    "kda_verify_replay",
    "mamba1_commit",
    "mamba1_decode",
    "mamba1_replay_commit",
    "mamba1_scan",
    "mamba2_decode",
    "mamba2_prefill",
    "mamba2_ssd_triton",
]
