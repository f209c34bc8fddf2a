"""What the two-rank checks (:mod:`~attn_core.e2e.tp_check`, :mod:`~attn_core.e2e.handoff_check`)
do around their runs: tear the process group down together, write rank 0's results, and leave
the process without C++ static destructors."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NoReturn

import torch.distributed as dist

__all__ = ["end_group", "exit_now", "write_results"]


def end_group() -> None:
    """Every rank done with its sends and collectives before any tears the group down: without
    the barrier a gloo rank that exits first can abort the other's teardown ("terminate called
    without an active exception", seen in about one run of three on 2 CPU cores)."""
    dist.barrier()
    dist.destroy_process_group()


def write_results(path: str | None, results: Sequence[Any]) -> None:
    """Rank 0's result dataclasses as a JSON list at ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump([asdict(r) for r in results], fh, indent=1)


def exit_now(code: int) -> NoReturn:
    """Leave without running C++ static destructors: at interpreter exit a gloo worker's thread
    can still be joinable, and its destructor aborts the process (rank 1 in about one run of
    five on 2 CPU cores) after every result was printed and written. Everything is flushed
    first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
