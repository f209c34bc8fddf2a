"""mamba_ssm's Triton SSD (``mamba_chunk_scan_combined``), where mamba_ssm does not install.

The H200 cannot pip-install mamba_ssm (no internet, no wheel for its torch), but its Mamba2
prefill kernel is pure Triton: ``scripts/pack_mamba_ssm_triton.sh`` copies the forward's module
closure (``mamba_ssm/ops/triton/ssd_*.py`` and what they import; state-spaces/mamba,
Apache-2.0) with empty package ``__init__.py`` files into the git-ignored
``.ext/mamba_ssm_triton/`` on the development machine, the checkout carries it to the device,
and :func:`load` imports it from there (nothing to build; Triton compiles and autotunes its
kernels on the first call of each shape family, tens of seconds). Its third-party imports:
torch, triton, einops (fla-core depends on it, so the H200 has it), packaging.

:func:`call` maps the inputs of our ``mamba2_prefill`` (packed ``[T, ...]`` tokens, state
slots ``[S, H, N, P]``) to ``mamba_chunk_scan_combined``'s layouts, in one of two ways:

* ``layout="batch"``: the ``N_seq`` requests (equal lengths) as its batch dimension, initial
  states ``[N_seq, H, P, N]`` read from the slots; final states from ``return_final_states``.
* ``layout="varlen"``: one packed row with ``seq_idx`` (what a server's mixed batch passes;
  the requests may differ in length), ``cu_seqlens`` and ``return_varlen_states`` for the
  per-request final states. This version applies ``initial_states`` to the first request only,
  so none are passed: compare with zero initial states.

Nothing here needs a GPU: under ``TRITON_INTERPRET=1`` (and ``MAMBA_DETERMINISTIC=1`` before
the import, so that each autotuned kernel has one config and the autotuner, which needs a GPU
benchmarker, never runs) the kernels run on CPU at small shapes; ``torch.cuda.device(None)``
then fails in torch 2.13's CPU build, which :func:`load` makes a no-op in a process without
CUDA.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys
from pathlib import Path
from typing import Any

#: The checkout root: a relative ``src_dir`` is taken from here.
ROOT = Path(__file__).resolve().parents[3]
#: Where the pack script puts the sources (the folder to put on ``sys.path``).
DEFAULT_DIR = ".ext/mamba_ssm_triton"
#: The module with ``mamba_chunk_scan_combined``.
MODULE = "mamba_ssm.ops.triton.ssd_combined"
#: Every upstream file the pack script copies (the forward's import closure) and the license.
PACKED = (
    "mamba_ssm/ops/triton/ssd_combined.py",
    "mamba_ssm/ops/triton/ssd_bmm.py",
    "mamba_ssm/ops/triton/ssd_chunk_state.py",
    "mamba_ssm/ops/triton/ssd_state_passing.py",
    "mamba_ssm/ops/triton/ssd_chunk_scan.py",
    "mamba_ssm/ops/triton/layernorm_gated.py",
    "mamba_ssm/ops/triton/k_activations.py",
    "mamba_ssm/ops/triton/softplus.py",
    "mamba_ssm/utils/torch.py",
    "mamba_ssm/utils/determinism.py",
    "LICENSE",
)
#: The empty package files the pack script writes (upstream's would import CUDA extensions).
INITS = (
    "mamba_ssm/__init__.py",
    "mamba_ssm/ops/__init__.py",
    "mamba_ssm/ops/triton/__init__.py",
    "mamba_ssm/utils/__init__.py",
)
#: ``layout`` values of :func:`call`.
LAYOUTS = ("batch", "varlen")
#: The chunk size mamba_ssm's Mamba2 module (and granite-4.0-h's config) uses.
DEFAULT_CHUNK = 256


def _resolve(p: str | Path) -> Path:
    p = Path(p)
    return p if p.is_absolute() else ROOT / p


def source_info(src_dir: str | Path = DEFAULT_DIR) -> dict[str, str] | None:
    """``{"commit", "version"}`` that the pack script recorded in ``SOURCE``; None when
    ``src_dir`` holds no packed sources."""
    f = _resolve(src_dir) / "SOURCE"
    if not f.is_file():
        return None
    info = {"commit": "unknown", "version": "unknown"}
    for line in f.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in info:
            info[key] = value.strip()
    return info


def missing_files(src_dir: str | Path = DEFAULT_DIR) -> list[str]:
    """The packed files (:data:`PACKED`, :data:`INITS`, ``SOURCE``) absent from ``src_dir``."""
    src = _resolve(src_dir)
    return [f for f in (*PACKED, *INITS, "SOURCE") if not (src / f).is_file()]


def _drop_modules() -> None:
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]


def _cpu_device_shim() -> None:
    """upstream enters ``torch.cuda.device(x.device.index)`` around each launch; for CPU
    tensors the index is None, which torch's CPU build rejects (``None < 0``). In a process
    without CUDA (the interpreter's), make ``torch.cuda.device(None)`` a no-op; with CUDA
    nothing is changed."""
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda.device, "_attn_core_shim", False):
        return
    real = torch.cuda.device

    def device(index: Any) -> Any:
        return contextlib.nullcontext() if index is None else real(index)

    device._attn_core_shim = True  # type: ignore[attr-defined]
    torch.cuda.device = device  # type: ignore[misc,assignment]


_LOADED: dict[tuple[str, bool], tuple[Any, str]] = {}


def load(src_dir: str | Path = DEFAULT_DIR, prefer_installed: bool = True) -> tuple[Any, str]:
    """``(mamba_chunk_scan_combined, provider)``: the installed mamba_ssm's if it imports
    (``prefer_installed``), else the one packed in ``src_dir``. Raises ``RuntimeError`` with
    the reason and the fix (``"skipped: ..."``) when neither imports. Loaded once per process
    (a second import would define new kernels, to be autotuned again)."""
    src = _resolve(src_dir)
    key = (str(src), prefer_installed)
    if key not in _LOADED:
        _LOADED[key] = _load(src, prefer_installed)
    return _LOADED[key]


def _load(src: Path, prefer_installed: bool) -> tuple[Any, str]:
    reason = "not tried"
    if prefer_installed:
        try:
            mod = importlib.import_module(MODULE)
        except ImportError as e:
            reason = f"mamba_ssm not importable ({e})"
            _drop_modules()  # a half-imported package must not shadow the packed one
        else:
            if not str(getattr(mod, "__file__", "")).startswith(str(src)):
                _cpu_device_shim()
                pkg = sys.modules["mamba_ssm"]
                return mod.mamba_chunk_scan_combined, (
                    f"mamba_ssm {getattr(pkg, '__version__', '?')} (installed)"
                )
    missing = missing_files(src)
    if missing:
        raise RuntimeError(
            f"skipped: {reason}, and {src} lacks {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}: run scripts/pack_mamba_ssm_triton.sh on the "
            "development machine (a state-spaces/mamba checkout or mirror), then carry .ext"
        )
    info = source_info(src) or {}
    _drop_modules()
    sys.path.insert(0, str(src))
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as e:
        _drop_modules()
        what = getattr(e, "name", None) or str(e)
        raise RuntimeError(
            f"skipped: mamba_ssm's Triton SSD (packed {info.get('commit', '?')[:12]}) imports "
            f"{what}, not installed here ({e}); pip install {what}"
        ) from e
    finally:
        sys.path.remove(str(src))
    _cpu_device_shim()
    return mod.mamba_chunk_scan_combined, (
        f"mamba_ssm {info.get('version', '?')} Triton SSD (packed {info.get('commit', '?')[:12]})"
    )


def call(
    fn: Any,
    a: dict,
    cu_seqlens_cpu: Any,
    layout: str = "batch",
    chunk_size: int = DEFAULT_CHUNK,
    state_dtype: Any = None,
) -> tuple[Any, Any]:
    """``(run, unpack)``: ``run()`` calls ``fn`` (``mamba_chunk_scan_combined``) on the inputs
    ``a`` of our ``mamba2_prefill`` (``x``, ``dt``, ``A_log``, ``B``, ``C``, ``D``,
    ``dt_bias``, ``ssm_state``, ``state_indices``; packed ``[T, ...]``) mapped to its layouts,
    everything but the call itself prepared here; ``unpack(run())`` gives ``(y [T, H, P],
    final states [N_seq, H, N, P])`` in our layouts. Same math as ours: ``dt`` raw, plus
    ``dt_bias``, softplus (threshold 20 on both sides), ``A = -exp(A_log)`` in float32, the
    ``D`` skip, no ``z`` (and ``dt_limit`` left at its no-op default). ``layout``: see the
    module docstring (``"batch"`` reads the initial states from ``a``'s slots,
    ``"varlen"`` starts from zero states). ``state_dtype``: the dtype of its inter-chunk states
    (None: its default, ``C``'s dtype; its final states are float32 either way)."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    x, dt, Bm, Cm = a["x"], a["dt"], a["B"], a["C"]
    T, H, P = x.shape
    G, N = Bm.shape[1:]
    bounds = [int(b) for b in cu_seqlens_cpu.tolist()]
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    n_seq = len(lengths)
    A = -torch.exp(a["A_log"].float())
    kw: dict[str, Any] = {"D": a.get("D"), "z": None, "dt_bias": a.get("dt_bias"),
                          "dt_softplus": True, "return_final_states": True}  # fmt: skip
    if state_dtype is not None:  # only then: older mamba_ssm releases lack the keyword
        kw["state_dtype"] = state_dtype
    if layout == "batch":
        if len(set(lengths)) != 1:
            raise ValueError(f"layout='batch' needs requests of one length, got {lengths}")
        L = lengths[0]
        idx = a["state_indices"].long()
        # its initial states are [batch, H, P, N]: our slots [S, H, N, P] gathered, transposed
        kw["initial_states"] = a["ssm_state"][idx].transpose(-1, -2).contiguous()
        args = (x.view(n_seq, L, H, P), dt.view(n_seq, L, H), A, Bm.view(n_seq, L, G, N),
                Cm.view(n_seq, L, G, N), chunk_size)  # fmt: skip

        def unpack(res: Any) -> tuple[Any, Any]:
            y, final = res
            return y.reshape(T, H, P), final.transpose(-1, -2)

    else:
        dev = x.device
        kw["seq_idx"] = torch.repeat_interleave(
            torch.arange(n_seq, dtype=torch.int32, device=dev),
            torch.tensor(lengths, device=dev),
        )[None]
        kw["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int64, device=dev)
        kw["return_varlen_states"] = True
        args = (x[None], dt[None], A, Bm[None], Cm[None], chunk_size)

        def unpack(res: Any) -> tuple[Any, Any]:
            y, _last, varlen_states = res
            return y[0], varlen_states.transpose(-1, -2)

    def run() -> Any:
        return fn(*args, **kw)

    return run, unpack
