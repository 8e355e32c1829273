"""The framed protocol between a python-backend stub, the preloaded parent and a preforked worker.

One ``SOCK_SEQPACKET`` unix socket per worker: every ``send`` is one frame, read whole by one
``recv``, and a closed peer reads as an empty frame. A frame is one type byte and a body:

========  ==============  =================================================================
frame     direction       body
========  ==============  =================================================================
SPAWN     stub -> parent  JSON: the model's folders, device, the stub's pid (``SpawnRequest``)
STATUS    stub -> parent  JSON ``{"pid": worker}``: how did that worker end?
EXITED    parent -> stub  JSON ``{"pid": worker, "status": wait status or null}``
FORKED    worker -> stub  JSON ``{"pid", "start_ticks"}``, first thing after the fork
READY     worker -> stub  JSON ``{"import_secs", "load_secs"}``: ``load`` returned
INFER     stub -> worker  tensors (below)
RESULT    worker -> stub  tensors (below); also the answer to SHUTDOWN (no tensors)
ERROR     worker -> stub  JSON ``{"kind", "message", "stage"}`` (kind and message as errors.py);
          parent -> stub  JSON ``{"kind": "refused", "message"}`` instead of forking (it is not fork-safe)
SHUTDOWN  stub -> worker  empty: run ``unload`` and exit
STREAM    stub -> worker  tensors: one request of a decoupled model (``predict`` is a generator)
ITEM      worker -> stub  tensors: one result the generator yielded; the worker waits for NEXT or CANCEL
NEXT      stub -> worker  empty: the item is sent on, compute the next one
CANCEL    stub -> worker  empty: the request was cancelled; close the generator
END       worker -> stub  empty: the stream is over (the generator ended or was closed)
========  ==============  =================================================================

Tensors travel through shared memory: each side owns one region (a memfd it writes, the other
side maps), sent once with ``SCM_RIGHTS`` and again whenever it grows. An INFER or RESULT body is a
table ``<region size (0: unchanged)> <n> <encoding>`` and n entries. ARRAYS (a dict of numeric
arrays, the common case): per array its offset, length, shape, dtype and name. PICKLED (anything
else: BYTES tensors, the raw format's lists): segment 0 is a pickle (protocol 5), segments 1..n-1
its out-of-band buffers. Array bytes are copied once into the region and read in place. Standard
library + numpy only, Python 3.10 syntax (python_backend rule).
"""

from __future__ import annotations

import array
import json
import mmap
import os
import pickle
import socket
import struct
from typing import Any

import numpy as np

SPAWN, STATUS, EXITED, FORKED, READY, INFER, RESULT, ERROR, SHUTDOWN = range(1, 10)
STREAM, ITEM, NEXT, CANCEL, END = range(10, 15)
FRAME_NAMES = {
    SPAWN: "SPAWN", STATUS: "STATUS", EXITED: "EXITED", FORKED: "FORKED", READY: "READY",
    INFER: "INFER", RESULT: "RESULT", ERROR: "ERROR", SHUTDOWN: "SHUTDOWN",
    STREAM: "STREAM", ITEM: "ITEM", NEXT: "NEXT", CANCEL: "CANCEL", END: "END",
}  # fmt: skip

REFUSED = "refused"  # an ERROR's kind when the parent will not fork: the stub loads the model itself

MAX_FRAME = 1 << 16  # JSON frames (an error message with a traceback summary fits many times over)
MIN_REGION = 1 << 16
ALIGN = 64  # every segment starts 64-byte aligned: arrays come back aligned for SIMD code
_TABLE = struct.Struct("<QIB")  # region size (0: unchanged), entries, encoding
_SEGMENT = struct.Struct("<QQ")  # PICKLED: offset, length
_ENTRY = struct.Struct("<QQBBH")  # ARRAYS: offset, length, ndim, dtype length, name length; shape, dtype, name
ARRAYS, PICKLED = 0, 1
_NOT_TAKEN, _TAKEN = bytes(8), struct.pack("<Q", 1)
_PLAIN_KINDS = frozenset("biufc")
_FDS = socket.CMSG_SPACE(array.array("i", [0]).itemsize)


class ProtocolError(Exception):
    """The peer sent something this side cannot read: a bug, or versions that do not match."""


class PeerClosed(Exception):
    """The peer's end of the socket is closed: its process ended (or is ending)."""


def abstract_name(key: str) -> bytes:
    """The parent's socket in the abstract namespace: no file, no path-length limit, gone with it."""
    return b"\0snooze-prefork-" + key.encode()


def send_frame(sock: socket.socket, kind: int, body: bytes = b"", fd: int | None = None) -> None:
    """One frame; a closed peer raises (EPIPE) instead of sending SIGPIPE to this process."""
    data = bytes((kind,)) + body
    if fd is None:
        sock.sendall(data, socket.MSG_NOSIGNAL)
    else:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], socket.MSG_NOSIGNAL)


def send_json(sock: socket.socket, kind: int, payload: dict[str, Any]) -> None:
    send_frame(sock, kind, json.dumps(payload).encode())


def recv_frame(sock: socket.socket) -> tuple[int, bytes, int | None]:
    """One frame: (type, body, a file descriptor that came with it or None). PeerClosed at EOF."""
    data, ancdata, flags, _ = sock.recvmsg(MAX_FRAME, _FDS)
    fd = None
    for level, kind, raw in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
            for extra in fds[1:]:
                os.close(extra)
            fd = fds[0] if fds else None
    if not data:
        if fd is not None:
            os.close(fd)
        raise PeerClosed()
    if flags & socket.MSG_TRUNC:
        raise ProtocolError(f"a {FRAME_NAMES.get(data[0], data[0])} frame larger than {MAX_FRAME} bytes")
    return data[0], data[1:], fd


def parse_json(kind: int, body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"{FRAME_NAMES.get(kind, kind)} frame: not JSON ({e})") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"{FRAME_NAMES.get(kind, kind)} frame: not a JSON object")
    return payload


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region:
    """This side's shared-memory region: written here, mapped by the peer. Grows by replacement.

    Its first ``ALIGN`` bytes are a header the peer writes: a non-zero u64 at offset 0 once it has taken
    the frame's tensors (a worker that dies before that never ran the batch)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.size = 0
        self.map: mmap.mmap | None = None

    def taken(self) -> bool:
        """Whether the peer took the tensors of the last frame sent (it wrote the header)."""
        return self.map is not None and self.map[:8] != _NOT_TAKEN

    def reserve(self, needed: int) -> int | None:
        """Make room for ``needed`` bytes; the new memfd to send when the region was replaced (the
        caller closes it once sent), else None. The old map stays alive while arrays still view it."""
        if needed <= self.size:
            return None
        size = max(MIN_REGION, 1 << (needed - 1).bit_length())
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        return fd


class PeerRegion:
    """The peer's region, mapped here to read from (and to write its header: ``take``)."""

    def __init__(self) -> None:
        self.view: memoryview | None = None

    def adopt(self, fd: int, size: int) -> None:
        try:
            self.view = memoryview(mmap.mmap(fd, size))
        finally:
            os.close(fd)


def _plain_arrays(obj: Any) -> bool:
    """A dict of numeric numpy arrays (the common case): sent without pickle."""
    return type(obj) is dict and all(
        type(v) is np.ndarray and v.dtype.kind in _PLAIN_KINDS and type(k) is str for k, v in obj.items()
    )


def send_tensors(sock: socket.socket, kind: int, region: Region, obj: Any) -> None:
    """Send ``obj`` (a dict of arrays, or of lists of arrays) as an INFER or RESULT frame."""
    if _plain_arrays(obj):
        encoding = ARRAYS
        names = list(obj)
        # written as they are, no view; ascontiguousarray would turn a 0-d array into 1-d
        raws: list[Any] = [a if (a := obj[n]).flags.c_contiguous else np.ascontiguousarray(a) for n in names]
    else:
        encoding = PICKLED
        buffers: list[pickle.PickleBuffer] = []
        stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [memoryview(stream), *(b.raw() for b in buffers)]
    offsets, end = [], ALIGN  # the header first
    for raw in raws:
        offsets.append(end)
        end = _aligned(end + raw.nbytes)
    fd = region.reserve(end)
    assert region.map is not None
    region.map[:8] = _NOT_TAKEN
    for raw, offset in zip(raws, offsets, strict=True):
        region.map[offset : offset + raw.nbytes] = raw
    parts = [_TABLE.pack(region.size if fd is not None else 0, len(raws), encoding)]
    if encoding == ARRAYS:
        for name, array, offset in zip(names, raws, offsets, strict=True):
            dtype, label = _dtype_code(array.dtype), name.encode()
            parts.append(_ENTRY.pack(offset, array.nbytes, array.ndim, len(dtype), len(label)))
            parts.append(struct.pack(f"<{array.ndim}q", *array.shape) + dtype + label)
    else:
        parts.extend(_SEGMENT.pack(off, raw.nbytes) for off, raw in zip(offsets, raws, strict=True))
    try:
        send_frame(sock, kind, b"".join(parts), fd)
    finally:
        if fd is not None:
            os.close(fd)


def read_tensors(body: bytes, fd: int | None, peer: PeerRegion, *, copy: bool, take: bool = False) -> Any:
    """The object an INFER or RESULT frame carries. ``copy=False``: arrays view the peer's region and
    are valid until the peer writes its next frame; ``copy=True``: arrays own their memory. ``take``:
    tell the peer (its region's header) that the tensors reached this process."""
    if len(body) < _TABLE.size:
        raise ProtocolError("tensor frame shorter than its header")
    size, count, encoding = _TABLE.unpack_from(body)
    if size:
        if fd is None:
            raise ProtocolError("a tensor frame announced a new region without its file descriptor")
        peer.adopt(fd, size)
    elif fd is not None:
        os.close(fd)
    if peer.view is None:
        raise ProtocolError("a tensor frame before the peer's region")
    if take:
        peer.view[:8] = _TAKEN
    try:
        if encoding == ARRAYS:
            return _read_arrays(body, count, peer.view, copy)
        return _read_pickled(body, count, peer.view, copy)
    except (struct.error, ValueError, TypeError) as e:
        raise ProtocolError(f"tensor frame does not match its table ({e})") from None


def _read_arrays(body: bytes, count: int, view: memoryview, copy: bool) -> dict[str, np.ndarray]:
    out = {}
    at = _TABLE.size
    for _ in range(count):
        offset, nbytes, ndim, dtype_len, name_len = _ENTRY.unpack_from(body, at)
        at += _ENTRY.size
        shape = struct.unpack_from(f"<{ndim}q", body, at)
        at += 8 * ndim
        dtype = _dtype(body[at : at + dtype_len])
        at += dtype_len
        name = body[at : at + name_len].decode()
        at += name_len
        if offset + nbytes > len(view):
            raise ProtocolError("tensor frame points past the end of the shared region")
        array: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=view, offset=offset)
        out[name] = array.copy() if copy else array
    return out


def _read_pickled(body: bytes, count: int, view: memoryview, copy: bool) -> Any:
    if count < 1 or len(body) != _TABLE.size + count * _SEGMENT.size:
        raise ProtocolError("tensor frame does not match its segment table")
    segments = []
    for i in range(count):
        offset, length = _SEGMENT.unpack_from(body, _TABLE.size + i * _SEGMENT.size)
        if offset + length > len(view):
            raise ProtocolError("tensor frame points past the end of the shared region")
        segments.append(view[offset : offset + length])
    buffers = [bytearray(s) for s in segments[1:]] if copy else segments[1:]
    return pickle.loads(segments[0], buffers=buffers)


_DTYPES: dict[bytes, np.dtype] = {}
_CODES: dict[np.dtype, bytes] = {}


def _dtype_code(dtype: np.dtype) -> bytes:
    code = _CODES.get(dtype)
    if code is None:
        code = _CODES[dtype] = dtype.str.encode()
    return code


def _dtype(code: bytes) -> np.dtype:
    dtype = _DTYPES.get(code)
    if dtype is None:
        dtype = _DTYPES[code] = np.dtype(code.decode())
    return dtype
