"""Compile a Triton kernel of this plugin for sm90 on the CPU and read its PTX.

Triton's own compiler (and the ptxas it ships) builds the kernel for an H100/H200 without a
GPU, so the tests can check what the code generator made of a kernel: which instructions a
loop holds, whether it crosses warps, how it rounds. Skips where this Triton has no NVIDIA
backend or ptxas.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

#: compiles a kernel for sm90 and writes its PTX to stdout (argv: pointer types, constexprs, as
#: JSON; module, kernel name, warps), in a fresh interpreter: a test process whose kernel tests
#: ran in Triton's CPU interpreter has its language module patched for it and cannot compile
_COMPILE = """
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

pointers, constexprs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
module, name, warps = sys.argv[3], sys.argv[4], int(sys.argv[5])
kernel = getattr(importlib.import_module(module), name)
names = list(inspect.signature(kernel.fn).parameters)
sig = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n] == "i32" or sig[n].startswith("*")}
src = ASTSource(
    fn=kernel, signature=sig,
    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs,
)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
if len(sys.argv) > 6:  # SASS: ptxas decides what a PTX vector access becomes
    import os, subprocess, tempfile
    cubin = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    sys.stdout.write(sass)
else:
    sys.stdout.write(compiled.asm["ptx"])
"""


def sm90_ptx(
    kernel: str, pointers: dict[str, str], constexprs: dict, num_warps: int, *, sass: bool = False
) -> str:
    """PTX of ``kernel`` (``module:name``) for sm90: ``pointers`` the types of the pointer
    arguments (``"*bf16"``, ...) and of any scalar that is not an i32 (``"fp32"``);
    ``constexprs`` the constexprs; every other argument an i32. Pointers and i32s are taken
    16-divisible, as a launch with such strides specializes them. ``sass``: the SASS ptxas
    makes of it instead (``cuobjdump -sass``), what the GPU runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(pointers), json.dumps(constexprs),
         *kernel.split(":"), str(num_warps), *(["sass"] if sass else [])],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        if "CompilationError" not in proc.stderr and re.search(r"ptxas|nvidia", proc.stderr, re.I):
            pytest.skip(f"cannot compile for sm90 here (no NVIDIA backend or ptxas): {tail[0]}")
        pytest.fail(f"compiling the kernel for sm90 failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def loops(ptx: str) -> list[str]:
    """The PTX of every loop, each from its label to its backward branch."""
    found = []
    for label in re.findall(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        start = ptx.index(label + ":")
        back = ptx.find(f"bra.uni \t{label};", start)
        back = back if back >= 0 else ptx.find(f"bra \t{label};", start)
        if back > start:
            found.append(ptx[start:back])
    return found


def loop_body(ptx: str) -> str:
    """The PTX between the first loop's label and its backward branch."""
    found = loops(ptx)
    assert found, "no loop in the kernel's PTX"
    return found[0]
