"""Step metadata for FlashInfer, from the batch's host arrays (no device-to-host sync).

FlashInfer describes a paged batch of ``B`` requests by CSR arrays::

    kv_indptr      [B + 1] int32   request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices     [nnz]   int32   page ids, request after request (nnz = kv_indptr[B])
    last_page_len  [B]     int32   tokens in request b's last page, 1..page_size
    qo_indptr      [B + 1] int32   = the batch's query_start_loc

so that ``kv_len[b] = (pages[b] - 1) * page_size + last_page_len[b]``. The core's batch carries
``seq_lens`` on the host and the page table ``[B, W]`` on the device; the host arrays above are
computed here with numpy (:func:`fill_paged_metadata`), and ``kv_indices`` - the first
``pages[b]`` entries of every page-table row, packed - is gathered on the device
with sizes the host already knows, so nothing waits for the GPU: on CUDA in one Triton launch
(:mod:`attn_plugin_flashinfer.kv_indices`), elsewhere with torch (:func:`gather_kv_indices`).

Masking conventions: a query at position ``p`` of a request with ``kv_len`` keys and ``q_len``
queries sits at ``p = kv_len - q_len + i``; FlashInfer's causal mask and ``window_left`` are
aligned the same way (``kv_idx >= p - window_left``, left bound inclusive), so the HF window
``W`` (keys seen, the query itself included) is ``window_left = W - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "PagedMetadata",
    "check_kv_indices_room",
    "fill_paged_metadata",
    "gather_kv_indices",
    "last_page_lens",
    "page_counts",
    "window_left",
]


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` for an HF-convention window ``W`` (keys seen, itself included).

    :returns: ``W - 1``; ``-1`` (no window) for None.
    """
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window={sliding_window!r}: expected None or an integer >= 1")
    if sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}: expected None or an integer >= 1")
    return sliding_window - 1


def page_counts(seq_lens: np.ndarray, page_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Pages each request reads: ``ceil(seq_len / page_size)``.

    :param seq_lens: ``[B]`` integer, KV length including the step's new tokens.
    :returns: ``[B]`` (``out`` when given).
    """
    if out is None:
        out = np.empty(seq_lens.shape, dtype=np.int32)
    np.add(seq_lens, page_size - 1, out=out)
    np.floor_divide(out, page_size, out=out)
    return out


def last_page_lens(
    seq_lens: np.ndarray, page_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Tokens in each request's last page: ``(seq_len - 1) % page_size + 1`` (1..page_size).

    A request with ``seq_len == 0`` reads no page; its value is 0 and never used.
    """
    if out is None:
        out = np.empty(seq_lens.shape, dtype=np.int32)
    np.subtract(seq_lens, 1, out=out)
    np.remainder(out, page_size, out=out)
    out += 1
    np.minimum(out, seq_lens, out=out)  # 0 for an empty request; a no-op otherwise
    return out


@dataclass(slots=True)
class PagedMetadata:
    """Views of one step's host metadata (numpy, usually over pinned memory).

    :ivar kv_indptr: ``[B + 1]`` int32.
    :ivar last_page_len: ``[B]`` int32.
    :ivar row_offset: ``[B]`` int32, ``b * W - kv_indptr[b]``: adding it to a position in
        ``kv_indices`` gives the matching position in the flattened page table ``[B * W]``.
    :ivar total_pages: ``kv_indptr[B]``.
    """

    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    row_offset: np.ndarray
    total_pages: int


def fill_paged_metadata(
    seq_lens: np.ndarray,
    page_size: int,
    table_width: int,
    *,
    kv_indptr: np.ndarray,
    last_page_len: np.ndarray,
    row_offset: np.ndarray,
    row_base: np.ndarray | None = None,
) -> PagedMetadata:
    """Fill FlashInfer's host CSR metadata for a batch, in place.

    :param seq_lens: ``[B]`` int32, the batch's ``seq_lens_cpu`` (padding rows included).
    :param page_size: tokens per page.
    :param table_width: columns of the batch's page table (``W``).
    :param kv_indptr: ``[B + 1]`` int32 output.
    :param last_page_len: ``[B]`` int32 output.
    :param row_offset: ``[B]`` int32 output.
    :param row_base: ``[>= B]`` int32 ``b * W`` (a caller planning every step keeps one; made
        here when None).
    :raises ValueError: when a request needs more pages than the page table has columns.
    """
    b = seq_lens.shape[0]
    if not b:
        kv_indptr[0] = 0
        return PagedMetadata(kv_indptr, last_page_len, row_offset, 0)
    counts = page_counts(seq_lens, page_size, out=last_page_len)  # reuse as scratch
    kv_indptr[0] = 0
    counts.cumsum(out=kv_indptr[1 : b + 1])
    widest = int(counts.max())
    if widest > table_width:
        raise ValueError(
            f"a request of {int(seq_lens.max())} tokens needs {widest} pages of "
            f"{page_size}, but the page table has {table_width} columns"
        )
    if row_base is None:
        row_base = np.arange(b, dtype=np.int32) * np.int32(table_width)
    np.subtract(row_base[:b], kv_indptr[:b], out=row_offset)
    last_page_lens(seq_lens, page_size, out=last_page_len)
    return PagedMetadata(kv_indptr, last_page_len, row_offset, int(kv_indptr[b]))


def check_kv_indices_room(capacity: int, total_pages: int, where: str = "") -> None:
    """Raise unless a ``kv_indices`` buffer of ``capacity`` pages holds the step's
    ``total_pages`` (the workspace is sized from the constraints; a step past them lands here).

    :param where: the message's prefix, naming the layer group and backend.
    """
    if capacity < total_pages:
        raise ValueError(
            f"{where}kv_indices buffer holds {capacity} pages, the step reads {total_pages}; "
            "raise ExecutionConstraints.max_batch_size / max_model_len"
        )


def gather_kv_indices(
    page_table: torch.Tensor,
    kv_indptr: torch.Tensor,
    row_offset: torch.Tensor,
    total_pages: int,
    *,
    arange: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Pack the used prefix of every page-table row into FlashInfer's ``kv_indices``, on device.

    Graph-free and sync-free: four small kernels whose sizes come from the host.

    :param page_table: ``[B, W]`` int32, contiguous rows (the batch's page table).
    :param kv_indptr: ``[B + 1]`` int32 on the page table's device.
    :param row_offset: ``[B]`` int32 on the same device (see :class:`PagedMetadata`).
    :param total_pages: ``kv_indptr[B]``, known on the host.
    :param arange: ``[>= total_pages]`` int32, ``0, 1, 2, ...`` (preallocated).
    :param out: ``[>= total_pages]`` int32; the result is written to ``out[:total_pages]``.
    :returns: ``out[:total_pages]``.
    """
    check_kv_indices_room(min(out.shape[0], arange.shape[0]), total_pages)
    result = out[:total_pages]
    if total_pages == 0:
        return result
    pos = arange[:total_pages]
    # Row of each packed position: the first b with kv_indptr[b + 1] > pos (empty rows skipped).
    # Four kernels, each one Python call: every call costs microseconds of host time per step.
    row = torch.searchsorted(kv_indptr[1:], pos, right=True)
    flat = torch.index_select(row_offset, 0, row)
    flat += pos
    torch.index_select(page_table.view(-1), 0, flat, out=result)
    return result
