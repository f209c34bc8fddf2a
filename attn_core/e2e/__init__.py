"""End-to-end runner: tiny transformers models driven through attention bindings."""

from __future__ import annotations
