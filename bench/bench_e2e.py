"""End to end on a GPU: every architecture through the plugins found by entry points.

For each architecture (kernel shapes: head dims the GPU kernels serve) this prints the selected
backend of every group, the match against transformers' eager forward, tokens/s (eager and, for
decoders, with CUDA-graph decode) and the framework overhead ratio of a decode step (through
bindings / the same kernels called directly). Writes everything as JSON with ``--out``.

Usage: ``python bench/bench_e2e.py --device cuda --out e2e.json [--models qwen3,bamba]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from attn_core.e2e import ARCHITECTURES, run_architecture
from attn_core.e2e.configs import ENCODER_MODELS
from attn_core.e2e.overhead import measure_overhead
from attn_core.registry import Registry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", default=",".join(ARCHITECTURES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    registry = Registry.discover()
    rows, failures = [], 0
    for name in args.models.split(","):
        row: dict = {"model": name}
        try:
            for graphs in (False, True) if name not in ENCODER_MODELS else (False,):
                run = run_architecture(name, device=args.device, dtype=args.dtype,
                                       prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                       graphs=graphs, registry=registry)  # fmt: skip
                print(run.format(), flush=True)
                row["graphs" if graphs else "eager"] = run.to_dict()
                failures += not run.ok
            if name not in ENCODER_MODELS:
                for batch in (1, 32):
                    rep = measure_overhead(name, args.device, dtype=args.dtype, batch_size=batch,
                                           context_len=64, iters=30, registry=registry)  # fmt: skip
                    print("   overhead: " + rep.format(), flush=True)
                    row.setdefault("overhead", []).append(rep.to_dict())
        except Exception as exc:  # record and go on with the next architecture
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"
            failures += 1
        rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    print(f"\n{len(rows) - failures}/{len(rows)} architectures matched without error")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
