"""Source-checkout test setup of the plugin: see :mod:`attn_core.testing.gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

if (_ROOT := str(Path(__file__).resolve().parents[3])) not in sys.path:
    sys.path.insert(0, _ROOT)  # so that attn_core imports without ``pip install``

import os

import torch

from attn_core.testing.gpu import clean_attn_env, pytest_collection_modifyitems, use_checkout  # noqa: F401

# Without a GPU the plugin's Triton merge kernel runs in Triton's CPU interpreter, which must be
# chosen before any @triton.jit function is created.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

use_checkout(__file__)
