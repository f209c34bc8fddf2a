"""kv_indices.KVIndexGather packs the same page ids as planning.gather_kv_indices (torch) and as
a Python loop over the page table.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (the conftest sets
``TRITON_INTERPRET``); with one, compiled, and its second call of a batch size goes through the
bound launch.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from attn_plugin_flashinfer import planning
from attn_plugin_flashinfer.kv_indices import BLOCK, KVIndexGather

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "without CUDA the kernel runs only under TRITON_INTERPRET=1", allow_module_level=True
    )

PAGE = 16


def _step(seq_lens: list[int], width: int, rows: int, seed: int):
    """A page table of ``rows`` rows (more than the step's requests: the batch builder's table
    is sized for the largest batch) and the step's CSR metadata, on the host and the device."""
    rng = np.random.default_rng(seed)
    table = torch.from_numpy(rng.integers(0, 1 << 20, size=(rows, width)).astype(np.int32))
    seq = np.array(seq_lens, np.int32)
    B = len(seq_lens)
    kv_indptr, roff, lpl = np.zeros(B + 1, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
    meta = planning.fill_paged_metadata(
        seq, PAGE, width, kv_indptr=kv_indptr, last_page_len=lpl, row_offset=roff
    )
    want = [int(table[b, j]) for b in range(B) for j in range(math.ceil(seq[b] / PAGE))]
    assert len(want) == meta.total_pages
    return table.to(DEVICE), torch.from_numpy(kv_indptr).to(DEVICE), roff, want


@pytest.mark.parametrize(
    "seq_lens",
    [
        [1],
        [4096, 1, 0, 17, 300],  # an empty request, one of exactly one page, a partial page
        [BLOCK * PAGE * 2 + 5, 33, BLOCK * PAGE],  # rows of several blocks, one exactly one block
    ],
)
def test_gather_matches_a_loop_and_torch(seq_lens):
    width = max(math.ceil(n / PAGE) for n in seq_lens) + 3
    table, kv_indptr, roff, want = _step(seq_lens, width, rows=len(seq_lens) + 2, seed=width)
    B, n = len(seq_lens), len(want)
    out = torch.full((n + 64,), -7, dtype=torch.int32, device=DEVICE)
    gather = KVIndexGather()
    gather(table, kv_indptr, out, B)
    assert out[:n].tolist() == want
    assert (out[n:] == -7).all()  # nothing written past the step's pages
    torch_out = torch.full_like(out, -7)
    planning.gather_kv_indices(
        table,
        kv_indptr,
        torch.from_numpy(roff).to(DEVICE),
        n,
        arange=torch.arange(n + 64, dtype=torch.int32, device=DEVICE),
        out=torch_out,
    )
    assert torch.equal(torch_out, out)
    # Another step of the same batch size, new page ids: the bound launch (on a GPU) reads the
    # new table, not the first one's.
    table2 = torch.flip(table, dims=(1,)).contiguous()
    out.fill_(-7)
    gather(table2, kv_indptr, out, B)
    want2 = [int(table2[b, j]) for b in range(B) for j in range(math.ceil(seq_lens[b] / PAGE))]
    assert out[:n].tolist() == want2
    if CUDA:
        assert (B, table.stride(0)) in gather._bound
    else:  # the interpreter compiles nothing to bind: tried once, then never again
        assert gather._bound == {(B, table.stride(0)): None}


def test_gather_refuses_what_its_kernel_cannot_read():
    table, kv_indptr, _, want = _step([40, 7], 8, rows=2, seed=3)
    out = torch.zeros(len(want), dtype=torch.int32, device=DEVICE)
    gather = KVIndexGather()
    with pytest.raises(ValueError, match=r"page_table: int32 expected, got torch\.int64"):
        gather(table.long(), kv_indptr, out, 2)
    with pytest.raises(ValueError, match="kv_indices: int32 expected"):
        gather(table, kv_indptr, out.float(), 2)
    with pytest.raises(ValueError, match="page_table: unit column stride expected"):
        gather(table.t(), kv_indptr, out, 2)
    with pytest.raises(ValueError, match="kv_indices buffer holds 3 pages, the step reads 4"):
        planning.check_kv_indices_room(3, 4)
    with pytest.raises(ValueError, match=r"^group 'full' \(flashinfer\): kv_indices buffer"):
        planning.check_kv_indices_room(3, 4, where="group 'full' (flashinfer): ")
    planning.check_kv_indices_room(4, 4)  # exactly full: fine
