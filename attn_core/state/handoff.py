"""Moving one request's state between processes: prefill on one rank, decode on another.

A :class:`~attn_core.state.RequestExport` (``PersistentState.export_request``) travels over an
existing ``torch.distributed`` process group as plain point-to-point sends, and the receiver
imports it (``PersistentState.import_request``); its page size may differ, the export is
token-major. Gloo moves CPU tensors, NCCL CUDA tensors: with NCCL export to the GPU
(``export_request(rid, device="cuda")``) so the buffer goes device to device.

Wire protocol, one request (sender ``send_request``, receiver ``recv_request``)::

    sender                                       receiver
    header  int64[HEADER_LEN]  ------------->    magic, wire / format version, sizes
                               <-------------    reply int64[2] (status, length) [+ uint8 text]
    meta    uint8[meta_len]    ------------->    JSON of ExportMeta: crc32, fields, against
                                                 the header and itself (meta_problems), and
                                                 the caller's ``accept`` (e.g. the layout)
                               <-------------    reply
    buffer  uint8[nbytes]      ------------->    only after two accepts

The receiver answers the header and the metadata before any of the buffer moves, so a refusal
(another format version, a layout that does not fit, a corrupted header) costs two small
messages, both sides raise :class:`HandoffError` naming what did not match (the sender with the
receiver's reasons), and the next request goes over the same group in step. Nothing here
touches a :class:`~attn_core.state.PersistentState`: :func:`recv_into_state` checks the layout
before the bytes move and imports all or nothing, so the receiver's other requests are left as
they were whatever fails.

Header (``int64[HEADER_LEN]``): ``MAGIC``, ``WIRE_VERSION``, the export's format version
(:data:`~attn_core.state.transfer.FORMAT_VERSION`), the metadata's length in bytes, the buffer's
length in bytes, the CRC-32 of the metadata bytes. The metadata is ``ExportMeta`` as JSON
(``dataclasses.asdict``; tuples as lists), decoded field by field: no pickle.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from attn_core.state.transfer import (
    FORMAT_VERSION,
    ExportMeta,
    LayerEntry,
    RequestExport,
    TensorEntry,
    layout_differences,
    meta_problems,
)

if TYPE_CHECKING:
    from attn_core.state.manager import PersistentState

__all__ = [
    "HEADER_LEN",
    "MAGIC",
    "MAX_META_BYTES",
    "WIRE_VERSION",
    "HandoffError",
    "Header",
    "decode_header",
    "decode_meta",
    "encode_header",
    "encode_meta",
    "recv_into_state",
    "recv_request",
    "send_request",
]

#: First header word: ``b"attnHOFF"`` as a big-endian int64 (every byte < 0x80: positive).
MAGIC = int.from_bytes(b"attnHOFF", "big")
#: Version of this protocol (the messages and the header), not of the export format.
WIRE_VERSION = 1
#: Words in the header tensor.
HEADER_LEN = 6
#: Longest metadata accepted (a 1000-layer model's JSON is about 0.5 MB).
MAX_META_BYTES = 64 << 20

_ACCEPT, _REFUSE = 0, 1


class HandoffError(ValueError):
    """A hand-off was refused or broke: what did not match, one reason per line of ``problems``.

    :ivar stage: ``"header"`` or ``"meta"``: what was refused.
    :ivar problems: every reason.
    """

    def __init__(self, message: str, *, stage: str = "", problems: list[str] | None = None):
        super().__init__(message)
        self.stage = stage
        self.problems = list(problems or [message])


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header: the sender's protocol and format versions and the sizes that follow."""

    wire_version: int
    format_version: int
    meta_len: int
    nbytes: int
    meta_crc32: int


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------
def encode_meta(meta: ExportMeta) -> bytes:
    """``meta`` as compact JSON (UTF-8); :func:`decode_meta` gives it back equal."""
    return json.dumps(dataclasses.asdict(meta), separators=(",", ":"), sort_keys=True).encode()


def encode_header(meta: ExportMeta, meta_bytes: bytes) -> torch.Tensor:
    """The header announcing ``meta`` (encoded as ``meta_bytes``) and its buffer: ``int64``
    ``[HEADER_LEN]`` on the CPU."""
    words = [MAGIC, WIRE_VERSION, meta.version, len(meta_bytes), meta.nbytes]
    return torch.tensor([*words, zlib.crc32(meta_bytes)], dtype=torch.int64)


def decode_header(header: torch.Tensor) -> Header:
    """Read a received header; :class:`HandoffError` (stage ``header``) listing every field that
    is wrong: the magic (not a hand-off header: the two sides' sends and receives are out of
    step), the wire or format version, sizes out of range."""
    if header.dtype != torch.int64 or header.shape != (HEADER_LEN,):
        raise HandoffError(
            f"header: expected int64 [{HEADER_LEN}], got {header.dtype} {list(header.shape)}",
            stage="header",
        )
    magic, wire, version, meta_len, nbytes, crc = (int(x) for x in header.tolist())
    problems = []
    if magic != MAGIC:
        problems.append(
            f"magic: got {magic:#x}, expected {MAGIC:#x} (not a hand-off header: the sends and "
            "receives of the two ranks are out of step)"
        )
    if wire != WIRE_VERSION:
        problems.append(f"wire version: sender {wire}, here {WIRE_VERSION}")
    if version != FORMAT_VERSION:
        problems.append(f"format version: export {version}, here {FORMAT_VERSION}")
    if not 0 < meta_len <= MAX_META_BYTES:
        problems.append(f"meta length: {meta_len} bytes, expected 1..{MAX_META_BYTES}")
    if nbytes < 0:
        problems.append(f"buffer length: {nbytes} bytes, expected >= 0")
    if not 0 <= crc < 1 << 32:
        problems.append(f"meta crc32: {crc}, expected a 32-bit value")
    if problems:
        raise HandoffError("header: " + "; ".join(problems), stage="header", problems=problems)
    return Header(wire, version, meta_len, nbytes, crc)


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise HandoffError(f"meta: {where}{key}: expected an integer, got {value!r}", stage="meta")
    return value


def _opt(obj: dict[str, Any], key: str, where: str, kind: type) -> Any:
    value = obj[key]
    ok = value is None or (isinstance(value, kind) and not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise HandoffError(
            f"meta: {where}{key}: expected {kind.__name__} or null, got {value!r}", stage="meta"
        )
    return value


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise HandoffError(f"meta: {where}{key}: expected a string, got {value!r}", stage="meta")
    return value


def _list(obj: dict[str, Any], key: str, where: str) -> list[Any]:
    value = obj[key]
    if not isinstance(value, list):
        raise HandoffError(f"meta: {where}{key}: expected a list, got {value!r}", stage="meta")
    return value


def _fields(obj: Any, cls: type, where: str) -> dict[str, Any]:
    """``obj`` checked to be a JSON object with exactly the fields of dataclass ``cls``."""
    if not isinstance(obj, dict):
        raise HandoffError(
            f"meta: {where or 'top level'}: expected an object, got {type(obj).__name__}",
            stage="meta",
        )
    names = {f.name for f in dataclasses.fields(cls)}
    missing, unknown = sorted(names - set(obj)), sorted(set(obj) - names)
    if missing or unknown:
        parts = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
        raise HandoffError(
            f"meta: {where or 'top level'}: {cls.__name__} fields " + ", ".join(parts),
            stage="meta",
        )
    return obj


def _tensor_entry(obj: Any, where: str) -> TensorEntry:
    d = _fields(obj, TensorEntry, where)
    shape = _list(d, "shape", where)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        raise HandoffError(f"meta: {where}shape: expected integers, got {shape!r}", stage="meta")
    return TensorEntry(
        _str(d, "name", where),
        _str(d, "dtype", where),
        tuple(shape),
        _int(d, "offset", where),
        _int(d, "nbytes", where),
    )


def _layer_entry(obj: Any, where: str) -> LayerEntry:
    d = _fields(obj, LayerEntry, where)
    tensors = _list(d, "tensors", where)
    return LayerEntry(
        _int(d, "layer_index", where),
        _str(d, "kind", where),
        _str(d, "spec_hash", where),
        _str(d, "summary", where),
        tuple(_tensor_entry(t, f"{where}tensors[{j}].") for j, t in enumerate(tensors)),
        _opt(d, "k_scale", where, float),
        _opt(d, "v_scale", where, float),
    )


def decode_meta(data: bytes) -> ExportMeta:
    """The :class:`ExportMeta` of :func:`encode_meta`'s bytes; :class:`HandoffError` (stage
    ``meta``) naming the first field that is missing, unknown or of the wrong type (``meta:
    layers[2].tensors[0].: TensorEntry fields missing ['offset']``)."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HandoffError(f"meta: not UTF-8 JSON: {err}", stage="meta") from None
    d = _fields(obj, ExportMeta, "")
    layers = _list(d, "layers", "")
    return ExportMeta(
        num_tokens=_int(d, "num_tokens", ""),
        page_size=_int(d, "page_size", ""),
        num_pages=_int(d, "num_pages", ""),
        layers=tuple(_layer_entry(e, f"layers[{j}].") for j, e in enumerate(layers)),
        nbytes=_int(d, "nbytes", ""),
        snapshot_length=_opt(d, "snapshot_length", "", int),
        version=_int(d, "version", ""),
    )


# ----------------------------------------------------------------------------------------------
# Transport
# ----------------------------------------------------------------------------------------------
def _devices(group: Any, local: torch.device) -> tuple[torch.device, torch.device]:
    """(device of the header, metadata and replies; device of the buffer) on the wire.

    Decided by the group's backend alone, so both sides pick the same: gloo moves CPU tensors,
    NCCL CUDA tensors (this rank's current device unless ``local`` is a CUDA device); a group
    of both (``"cpu:gloo,cuda:nccl"``) sends the small messages through gloo and the buffer
    through NCCL.
    """
    backend = str(dist.get_backend(group))
    cpu = torch.device("cpu")
    if "nccl" not in backend:
        return cpu, cpu
    cuda = local if local.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return (cpu if "gloo" in backend else cuda), cuda


def _send_bytes(data: bytes, dst: int, group: Any, device: torch.device) -> None:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.send(t.to(device), dst, group=group)


def _recv_bytes(n: int, src: int, group: Any, device: torch.device) -> bytes:
    t = torch.empty(n, dtype=torch.uint8, device=device)
    dist.recv(t, src, group=group)
    return t.cpu().numpy().tobytes()


def _reply(problems: list[str], dst: int, group: Any, device: torch.device) -> None:
    text = "; ".join(problems).encode()
    status = torch.tensor([_REFUSE if problems else _ACCEPT, len(text)], dtype=torch.int64)
    dist.send(status.to(device), dst, group=group)
    if text:
        _send_bytes(text, dst, group, device)


def _await_reply(stage: str, src: int, group: Any, device: torch.device) -> None:
    status = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(status, src, group=group)
    code, n = (int(x) for x in status.tolist())
    if code == _ACCEPT:
        return
    reasons = _recv_bytes(n, src, group, device).decode(errors="replace") if n > 0 else ""
    raise HandoffError(
        f"rank {src} refused the export's {stage}: {reasons or f'status {code}'}",
        stage=stage,
        problems=reasons.split("; ") if reasons else None,
    )


def send_request(export: RequestExport, dst: int, group: Any = None) -> None:
    """Send one request's state to rank ``dst`` (its :func:`recv_request` or
    :func:`recv_into_state` call); returns when the buffer is sent.

    :param export: from ``PersistentState.export_request``; its buffer (``uint8 [nbytes]``) is
        sent as it is under gloo from the CPU, under NCCL from the GPU (a buffer on the other
        device is copied first: export where the group sends to avoid that copy).
    :param dst: the receiver's global rank.
    :param group: the process group (None: the default group).
    :raises HandoffError: the receiver refused the header or the metadata (its reasons in the
        message); nothing of the buffer was sent and the group is in step for the next request.
    """
    if not isinstance(export, RequestExport):
        raise TypeError(f"export: expected RequestExport, got {type(export).__name__}")
    meta_bytes = encode_meta(export.meta)
    _send_parts(encode_header(export.meta, meta_bytes), meta_bytes, export.buffer, dst, group)


def _send_parts(
    header: torch.Tensor, meta_bytes: bytes, buffer: torch.Tensor, dst: int, group: Any
) -> None:
    """The protocol's sender side for a header, metadata bytes and buffer as given (tests send
    corrupted ones through it)."""
    ctl, wire = _devices(group, buffer.device)
    dist.send(header.to(ctl), dst, group=group)
    _await_reply("header", dst, group, ctl)
    _send_bytes(meta_bytes, dst, group, ctl)
    _await_reply("meta", dst, group, ctl)
    if buffer.numel():  # the receiver skips it too: it read the length from the header
        dist.send(buffer.to(wire), dst, group=group)


def recv_request(
    src: int,
    device: torch.device | str = "cpu",
    group: Any = None,
    *,
    accept: Callable[[ExportMeta], list[str]] | None = None,
) -> RequestExport:
    """Receive one request's state sent by rank ``src`` with :func:`send_request`.

    :param device: where the returned buffer lives (under NCCL a CUDA device: the buffer
        lands there directly; under gloo it arrives on the CPU and is copied).
    :param group: the process group (None: the default group).
    :param accept: called with the decoded metadata before the buffer moves; the reasons it
        returns (empty: accept) refuse the export like a malformed one.
    :returns: the export, checked: its metadata is consistent with itself and its buffer
        (:func:`~attn_core.state.transfer.meta_problems`).
    :raises HandoffError: the header or the metadata is malformed, of another format version,
        inconsistent, or refused by ``accept``; the sender was told why and sent no buffer.
    """
    device = torch.device(device)
    ctl, wire = _devices(group, device)
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=ctl)
    dist.recv(raw, src, group=group)
    try:
        header = decode_header(raw.cpu())
    except HandoffError as err:
        _reply(err.problems, src, group, ctl)
        raise
    _reply([], src, group, ctl)
    data = _recv_bytes(header.meta_len, src, group, ctl)
    try:
        meta = _checked_meta(data, header, accept)
    except HandoffError as err:
        _reply(err.problems, src, group, ctl)
        raise
    _reply([], src, group, ctl)
    buffer = torch.empty(header.nbytes, dtype=torch.uint8, device=wire)
    if header.nbytes:
        dist.recv(buffer, src, group=group)
    return RequestExport(meta, buffer.to(device))


def _checked_meta(
    data: bytes, header: Header, accept: Callable[[ExportMeta], list[str]] | None
) -> ExportMeta:
    crc = zlib.crc32(data)
    if crc != header.meta_crc32:
        raise HandoffError(
            f"meta: crc32 {crc:#010x} of the {len(data)} bytes received, the header says "
            f"{header.meta_crc32:#010x} (corrupted on the way)",
            stage="meta",
        )
    meta = decode_meta(data)
    problems = []
    if meta.version != header.format_version:
        problems.append(f"format version: meta {meta.version}, header {header.format_version}")
    problems += meta_problems(meta, header.nbytes)
    if not problems and accept is not None:
        problems += accept(meta)
    if problems:
        raise HandoffError("meta: " + "; ".join(problems), stage="meta", problems=problems)
    return meta


def recv_into_state(
    state: PersistentState, req_id: Hashable, src: int, group: Any = None
) -> ExportMeta:
    """Receive a request from rank ``src`` and import it into ``state`` as ``req_id``.

    The metadata is checked against ``state``'s layout (``layout_differences``: layers, kinds,
    dtypes, shapes, KV scales; the page size may differ) and ``req_id`` must be new before the
    buffer moves: a refusal reaches the sender too. The import is all or nothing
    (``import_request``): whatever fails, ``state``'s other requests are as they were.

    :returns: the imported export's metadata.
    :raises HandoffError: refused (see :func:`recv_request`).
    :raises OutOfPagesError: / :class:`OutOfSlotsError` from the import (the buffer was
        received; nothing was added).
    """

    def fits(meta: ExportMeta) -> list[str]:
        if req_id in state:
            return [f"request {req_id!r} already exists here; release it first"]
        return layout_differences(meta, state.layout, state.kv_cache, state.state_slots)

    export = recv_request(src, state.device, group, accept=fits)
    state.import_request(req_id, export)
    return export.meta
