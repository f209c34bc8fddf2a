"""The hand-off transport's pieces in one process: the header and the metadata encoding, every
malformed field named, the backend -> device rule, and the protocol over an in-process fake of
``torch.distributed`` (two threads): refusals reach both sides and leave the group in step and
the receiver's other requests as they were. tests/e2e/test_handoff.py runs it over gloo."""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_transfer import fill, model, read, same

import attn_core.state.handoff as handoff
from attn_core.state import PersistentState, RequestExport
from attn_core.state.handoff import (
    HEADER_LEN,
    MAGIC,
    MAX_META_BYTES,
    WIRE_VERSION,
    HandoffError,
    decode_header,
    decode_meta,
    encode_header,
    encode_meta,
    recv_into_state,
    recv_request,
    send_request,
)
from attn_core.state.transfer import FORMAT_VERSION


@pytest.fixture
def export() -> RequestExport:
    src = PersistentState(model(), num_pages=6, num_slots=2)
    fill(src, "a", 7, seed=1)
    src.kv_cache.set_scale(1, k=0.5, v=2.0)
    return src.export_request("a")


# ------------------------------------------------------------------------------------------
# encoding
# ------------------------------------------------------------------------------------------
def test_meta_round_trips_through_json(export: RequestExport) -> None:
    data = encode_meta(export.meta)
    assert decode_meta(data) == export.meta
    json.loads(data)  # plain JSON: no pickle
    snap = dataclasses.replace(export.meta, snapshot_length=4)
    assert decode_meta(encode_meta(snap)) == snap


def test_header_round_trips(export: RequestExport) -> None:
    data = encode_meta(export.meta)
    header = encode_header(export.meta, data)
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    h = decode_header(header)
    assert (h.wire_version, h.format_version) == (WIRE_VERSION, FORMAT_VERSION)
    assert (h.meta_len, h.nbytes, h.meta_crc32) == (len(data), export.meta.nbytes, zlib.crc32(data))


@pytest.mark.parametrize(
    ("word", "value", "message"),
    [
        (0, MAGIC + 1, r"^header: magic: got 0x\w+, expected 0x\w+ \(not a hand-off header"),
        (1, WIRE_VERSION + 1, rf"wire version: sender {WIRE_VERSION + 1}, here {WIRE_VERSION}"),
        (2, 7, rf"format version: export 7, here {FORMAT_VERSION}"),
        (3, 0, rf"meta length: 0 bytes, expected 1\.\.{MAX_META_BYTES}"),
        (3, MAX_META_BYTES + 1, r"meta length: \d+ bytes"),
        (4, -1, r"buffer length: -1 bytes, expected >= 0"),
        (5, 1 << 32, r"meta crc32: \d+, expected a 32-bit value"),
    ],
)
def test_a_corrupted_header_names_the_field(export, word: int, value: int, message: str) -> None:
    header = encode_header(export.meta, encode_meta(export.meta))
    header[word] = value
    with pytest.raises(HandoffError, match=message) as err:
        decode_header(header)
    assert err.value.stage == "header" and len(err.value.problems) == 1


def test_a_header_lists_every_wrong_field_and_its_shape_is_checked(export) -> None:
    header = encode_header(export.meta, encode_meta(export.meta))
    header[1], header[2] = 9, 9
    with pytest.raises(HandoffError, match=r"wire version: sender 9.*; format version: export 9"):
        decode_header(header)
    with pytest.raises(HandoffError, match=r"expected int64 \[6\], got torch.int32 \[6\]"):
        decode_header(header.int())
    with pytest.raises(HandoffError, match=r"expected int64 \[6\], got torch.int64 \[5\]"):
        decode_header(header[:5])


def _edited(export: RequestExport, edit: Callable[[dict[str, Any]], None]) -> bytes:
    obj = json.loads(encode_meta(export.meta))
    edit(obj)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("num_tokens"), r"^meta: top level: ExportMeta fields missing \['num"),
        (lambda m: m.update(extra=1), r"ExportMeta fields unknown \['extra'\]"),
        (lambda m: m.update(num_tokens="7"), r"meta: num_tokens: expected an integer, got '7'"),
        (lambda m: m.update(nbytes=True), r"meta: nbytes: expected an integer, got True"),
        (lambda m: m.update(layers={}), r"meta: layers: expected a list"),
        (lambda m: m.update(snapshot_length=1.5), r"snapshot_length: expected int or null"),
        (lambda m: m["layers"][2].pop("kind"), r"meta: layers\[2\]\.: LayerEntry fields missing"),
        (lambda m: m["layers"][1].update(k_scale="x"), r"layers\[1\]\.k_scale: expected float"),
        (
            lambda m: m["layers"][1]["tensors"][0].update(shape=[7, "2", 8]),
            r"meta: layers\[1\]\.tensors\[0\]\.shape: expected integers, got \[7, '2', 8\]",
        ),
        (
            lambda m: m["layers"][1]["tensors"][1].update(offset=1.0),
            r"meta: layers\[1\]\.tensors\[1\]\.offset: expected an integer, got 1\.0",
        ),
        (lambda m: m["layers"].append(3), r"meta: layers\[4\]\.: expected an object, got int"),
    ],
)
def test_malformed_metadata_names_the_field(export, edit, message: str) -> None:
    with pytest.raises(HandoffError, match=message) as err:
        decode_meta(_edited(export, edit))
    assert err.value.stage == "meta"


def test_metadata_that_is_not_json_is_refused() -> None:
    with pytest.raises(HandoffError, match=r"^meta: not UTF-8 JSON"):
        decode_meta(b"\xff\xfe")
    with pytest.raises(HandoffError, match=r"^meta: not UTF-8 JSON"):
        decode_meta(b'{"num_tokens": ')
    with pytest.raises(HandoffError, match=r"^meta: top level: expected an object, got list"):
        decode_meta(b"[]")


def test_the_wire_devices_follow_the_backend(monkeypatch) -> None:
    cpu = torch.device("cpu")
    for backend, want in [
        ("gloo", ("cpu", "cpu")),
        ("nccl", ("cuda:0", "cuda:0")),
        ("cpu:gloo,cuda:nccl", ("cpu", "cuda:0")),
    ]:
        monkeypatch.setattr(handoff.dist, "get_backend", lambda group, b=backend: b)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        got = handoff._devices(None, cpu)
        assert tuple(str(d) for d in got) == want, backend
        if backend == "nccl":  # a CUDA buffer stays on its own device
            assert handoff._devices(None, torch.device("cuda", 1)) == (torch.device("cuda", 1),) * 2


# ------------------------------------------------------------------------------------------
# the protocol over a fake torch.distributed: rank 0 and rank 1 as two threads
# ------------------------------------------------------------------------------------------
class _FakeDist:
    """Point-to-point send / recv between threads; a thread's rank is ``rank.value``."""

    def __init__(self) -> None:
        self.links: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (0, 1): queue.Queue(),
            (1, 0): queue.Queue(),
        }
        self.local = threading.local()
        self.sent_bytes: list[int] = []

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None) -> None:
        self.sent_bytes.append(tensor.numel() * tensor.element_size())
        self.links[self.local.rank, dst].put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        got = self.links[src, self.local.rank].get(timeout=10)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, (got.shape, tensor.shape)
        tensor.copy_(got)


def _pair(monkeypatch, sender: Callable[[], Any], receiver: Callable[[], Any]):
    """Run ``sender`` as rank 0 and ``receiver`` as rank 1; each one's (result, exception)."""
    fake = _FakeDist()
    monkeypatch.setattr(handoff, "dist", fake)
    out: dict[int, tuple[Any, BaseException | None]] = {}

    def run(rank: int, fn: Callable[[], Any]) -> None:
        fake.local.rank = rank
        try:
            out[rank] = (fn(), None)
        except BaseException as exc:  # handed to the test thread
            out[rank] = (None, exc)

    threads = [threading.Thread(target=run, args=(r, f)) for r, f in ((0, sender), (1, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "the two sides are out of step"
    assert all(q.empty() for q in fake.links.values()), "a message was left unread"
    return out[0], out[1], fake


def test_a_request_moves_and_imports_across_page_sizes(monkeypatch, export) -> None:
    dst = PersistentState(model(page_size=8), num_pages=5, num_slots=3)
    fill(dst, "other", 5, seed=2)
    other = read(dst, "other")
    dst.kv_cache.set_scale(1, k=0.5, v=2.0)
    (_, err0), (meta, err1), fake = _pair(
        monkeypatch, lambda: send_request(export, 1), lambda: recv_into_state(dst, "a", 0)
    )
    assert err0 is None and err1 is None
    assert meta == export.meta and dst.num_tokens("a") == 7
    assert torch.equal(dst.export_request("a").buffer, export.buffer)
    assert same(read(dst, "other"), other)
    # header, accept, meta, accept, buffer: the buffer is sent once, whole
    assert fake.sent_bytes[-1] == export.meta.nbytes and len(fake.sent_bytes) == 5


def test_recv_request_returns_the_export_on_the_device_asked(monkeypatch, export) -> None:
    (_, err0), (got, err1), _ = _pair(
        monkeypatch, lambda: send_request(export, 1), lambda: recv_request(0, "cpu")
    )
    assert err0 is None and err1 is None
    assert got.meta == export.meta and torch.equal(got.buffer, export.buffer)


def test_a_layout_refusal_reaches_the_sender_and_moves_no_buffer(monkeypatch, export) -> None:
    dst = PersistentState(model(hd=16), num_pages=5, num_slots=3)
    fill(dst, "other", 5, seed=2)
    other = read(dst, "other")
    free = (dst.num_free_pages, dst.num_free_slots)
    (_, err0), (_, err1), fake = _pair(
        monkeypatch, lambda: send_request(export, 1), lambda: recv_into_state(dst, "a", 0)
    )
    assert isinstance(err1, HandoffError) and err1.stage == "meta"
    assert "layer 1: k shape: export [2, 8], here [2, 16]" in str(err1)
    assert isinstance(err0, HandoffError) and err0.stage == "meta"
    assert str(err0).startswith("rank 1 refused the export's meta: layer 1: k shape")
    assert "layer 1: k shape: export [2, 8], here [2, 16]" in err0.problems
    assert export.meta.nbytes not in fake.sent_bytes  # refused before the buffer moved
    assert "a" not in dst and (dst.num_free_pages, dst.num_free_slots) == free
    assert same(read(dst, "other"), other)
    dst.check_invariants()


def test_after_a_refusal_the_next_request_goes_through(monkeypatch, export) -> None:
    """A corrupted header is refused at the header; the same group then carries a genuine one."""
    dst = PersistentState(model(page_size=8), num_pages=5, num_slots=3)
    dst.kv_cache.set_scale(1, k=0.5, v=2.0)
    meta_bytes = encode_meta(export.meta)
    bad = encode_header(export.meta, meta_bytes)
    bad[2] = FORMAT_VERSION + 1

    def sender() -> list[str]:
        errors = []
        try:
            handoff._send_parts(bad, meta_bytes, export.buffer, 1, None)
        except HandoffError as err:
            errors.append(str(err))
        send_request(export, 1)
        return errors

    def receiver() -> list[str]:
        errors = []
        try:
            recv_into_state(dst, "a", 0)
        except HandoffError as err:
            errors.append(str(err))
        recv_into_state(dst, "a", 0)
        return errors

    (sent, err0), (got, err1), _ = _pair(monkeypatch, sender, receiver)
    assert err0 is None and err1 is None
    want = f"format version: export {FORMAT_VERSION + 1}, here {FORMAT_VERSION}"
    assert sent == [f"rank 1 refused the export's header: {want}"]
    assert got == [f"header: {want}"]
    assert torch.equal(dst.export_request("a").buffer, export.buffer)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("crc", r"^meta: crc32 0x\w+ of the \d+ bytes received, the header says 0x\w+"),
        ("version", rf"^meta: format version: meta 3, header {FORMAT_VERSION}"),
        ("nbytes", r"^meta: the buffer is \d+ bytes, meta.nbytes says \d+"),
    ],
)
def test_metadata_disagreeing_with_the_header_is_refused(monkeypatch, export, case, message):
    meta_bytes = encode_meta(export.meta)
    header = encode_header(export.meta, meta_bytes)
    if case == "crc":
        meta_bytes = meta_bytes.replace(b'"num_tokens":7', b'"num_tokens":8')
    elif case == "version":  # the header says this version, the metadata another
        meta_bytes = encode_meta(dataclasses.replace(export.meta, version=3))
        header = encode_header(export.meta, meta_bytes)
    else:
        header[4] -= 16
    (_, err0), (_, err1), _ = _pair(
        monkeypatch,
        lambda: handoff._send_parts(header, meta_bytes, export.buffer, 1, None),
        lambda: recv_request(0),
    )
    assert isinstance(err1, HandoffError) and err1.stage == "meta"
    assert re.search(message, str(err1)), str(err1)
    assert isinstance(err0, HandoffError) and "refused the export's meta" in str(err0)


def test_send_request_takes_only_an_export() -> None:
    with pytest.raises(TypeError, match="expected RequestExport, got dict"):
        send_request({}, 1)  # type: ignore[arg-type]
