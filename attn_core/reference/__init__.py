"""The reference backend: pure-PyTorch attention math for every layer kind, on CPU and GPU.

It is the numerical ground truth that every other backend is tested against, and the fallback
when nothing else fits. The math lives in :mod:`attn_core.reference.ops`.
"""
