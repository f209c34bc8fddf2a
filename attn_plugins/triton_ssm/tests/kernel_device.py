"""Where the kernel tests of this directory run; import it before anything imports the kernels.

Without CUDA it sets ``TRITON_INTERPRET=1`` first, so the kernels run in Triton's CPU
interpreter; with CUDA the same small-shape tests run compiled. A process that already imported
the kernels compiled, without a GPU, skips the importing test module.

:data:`K`: the ``attn_plugin_triton_ssm.kernels`` module. :data:`DEV`: the tests' device.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "attn_plugin_triton_ssm.kernels" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
from attn_plugin_triton_ssm import kernels as K

if not K.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("kernels compiled for GPU but no CUDA device", allow_module_level=True)
DEV = "cpu" if K.INTERPRETED else "cuda"

__all__ = ["DEV", "K"]
