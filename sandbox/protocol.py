"""The wire between the tuner and a sandbox worker: length-prefixed frames over a socket.

Each frame is a JSON header plus an optional blob of raw tensor bytes. The header says what
the tensors are (`_layout`: the nesting of lists, tuples, dicts and plain values around them,
each tensor's dtype and shape); the blob holds their bytes one after another, each at an
aligned offset the reader computes itself. Nothing crossing the wire is unpickled: a worker
taken over by candidate code can send wrong numbers (which verification rejects) but cannot
run code in the tuner. Readers view the tensors in the received buffer, uncopied: a KV cache
among the outputs is half a gigabyte, and `torch.save` then `torch.load` copied it five times.

Every request carries a fresh random `nonce` that its reply must echo: a frame that
candidate code writes to the worker's socket ahead of time cannot know it, so a forged
reply is a broken channel, not an answer (sandbox/client.py). Files (frozen inputs and
state) travel as open file descriptors after a frame whose header counts them (`fds`), so a
jailed worker reads them without seeing the folder they live in.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from typing import Any

import torch

_HEADER = struct.Struct("!II")  # json length, blob length
MAX_FRAME = 8 << 30


class ChannelClosed(Exception):
    """The other end went away (for the parent: the worker died)."""


class ChannelTimeout(Exception):
    """No complete frame arrived in time."""


ALIGN = 64
"""Each tensor's bytes start at a multiple of this (any dtype can be viewed there)."""
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)))}


def _layout(x: Any, parts: list) -> list:
    """`x` as JSON, its tensors (contiguous, on the host) appended to `parts`."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.layout != torch.strided or str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"a {t.layout} {t.dtype} tensor cannot cross the wire")
        # A conjugate or negative view (`.conj()`) has no bytes of its own to send: they are made.
        parts.append(t.to("cpu").resolve_conj().resolve_neg().contiguous())
        return ["T", str(t.dtype).removeprefix("torch."), list(t.shape)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return ["V", x]
    if isinstance(x, (list, tuple)):
        return ["L" if isinstance(x, list) else "U", [_layout(v, parts) for v in x]]
    if isinstance(x, dict) and all(isinstance(k, (str, int)) for k in x):
        return ["D", [[k, _layout(v, parts)] for k, v in x.items()]]
    raise TypeError(f"a {type(x).__name__} cannot cross the wire")


def _span(dtype: torch.dtype, shape: list) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def send(sock: socket.socket, header: dict[str, Any], tensors: Any = None, fds: list[int] | None = None) -> None:
    if fds:
        header = {**header, "fds": len(fds)}
    parts: list[torch.Tensor] = []
    if tensors is not None:
        header = {**header, "_layout": _layout(tensors, parts)}
    body = json.dumps(header).encode()
    chunks, size = [], 0
    for t in parts:
        pad = -size % ALIGN
        n = t.numel() * t.element_size()
        if n:  # the bytes as they are, viewed through numpy (no copy)
            chunks += [b"\0" * pad, memoryview(t.reshape(-1).view(torch.uint8).numpy())]
            size += pad + n
    try:
        sock.sendall(_HEADER.pack(len(body), size) + body)
        for c in chunks:
            sock.sendall(c)
        if fds:
            socket.send_fds(sock, [b"F"], fds)
    except (BrokenPipeError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e)) from None


def _tensors(node: Any, blob: torch.Tensor, at: list[int]) -> Any:
    """The structure `node` describes, its tensors viewed in `blob` (`at`: the next offset)."""
    if not isinstance(node, list) or len(node) not in (2, 3) or not isinstance(node[0], str):
        raise ValueError("malformed layout")
    kind = node[0]
    if kind == "T" and len(node) == 3:
        dtype, shape = _DTYPES.get(node[1]), node[2]
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
            raise ValueError(f"bad tensor {node[1:]}")
        n = _span(dtype, shape)
        if not n:
            return torch.empty(shape, dtype=dtype)
        start = at[0] + (-at[0] % ALIGN)
        if start + n > blob.numel():
            raise ValueError("tensor bytes past the end of the frame")
        at[0] = start + n
        return blob[start:start + n].view(dtype).view(shape)
    if kind == "V" and (node[1] is None or isinstance(node[1], (bool, int, float, str))):
        return node[1]
    if kind in ("L", "U") and isinstance(node[1], list):
        items = [_tensors(v, blob, at) for v in node[1]]
        return items if kind == "L" else tuple(items)
    if kind == "D" and isinstance(node[1], list) and all(isinstance(kv, list) and len(kv) == 2 for kv in node[1]):
        return {k: _tensors(v, blob, at) for k, v in node[1]}
    raise ValueError(f"malformed layout node {kind!r}")


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, raw: bool = False) -> Any:
    """`n` bytes: a bytearray, or with `raw` an uninitialised uint8 tensor (a frame's tensor
    bytes: bytearray(n) zeroes its memory while holding the GIL, a tenth of a second for the
    tuner's largest frames, and every judging thread waits for it at each op it runs)."""
    got = 0
    try:
        buf = torch.empty(n, dtype=torch.uint8) if raw else bytearray(n)
    except (MemoryError, RuntimeError) as e:  # the worker that sent it is not trusted further
        raise ChannelClosed(f"a frame of {n} bytes could not be held: {e}") from None
    view = memoryview(buf.numpy() if raw else buf)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and select.select([sock], [], [], left)[0]
            except (ValueError, OSError) as e:  # closed under us (fileno -1) by another thread
                raise ChannelClosed(str(e)) from None
            if not ready:
                raise ChannelTimeout(f"no answer within the time limit ({got}/{n} bytes)")
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        except (ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from None
        if not k:
            raise ChannelClosed("connection closed")
        got += k
    return buf


def recv(sock: socket.socket, timeout: float | None = None, accept_fds: bool = False) -> tuple[dict[str, Any], Any]:
    """One frame: (header, tensors or None). Raises ChannelTimeout or ChannelClosed. File
    descriptors that follow a frame land in header["_fds"] where `accept_fds` (the worker's side)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    n_body, n_blob = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n_body > MAX_FRAME or n_blob > MAX_FRAME:
        raise ChannelClosed(f"oversized frame ({n_body} + {n_blob} bytes)")
    try:
        header = json.loads(_recv_exact(sock, n_body, deadline))
    except (json.JSONDecodeError, RecursionError) as e:  # nesting deep enough to overflow: forged
        raise ChannelClosed(f"malformed frame: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ChannelClosed("malformed frame: header is not an object")
    tensors = None
    blob = _recv_exact(sock, n_blob, deadline, raw=True) if n_blob else torch.empty(0, dtype=torch.uint8)
    if "_layout" in header:
        try:
            tensors = _tensors(header.pop("_layout"), blob, [0])
        except (ValueError, TypeError, RuntimeError) as e:  # a worker that sends this is not trusted further
            raise ChannelClosed(f"unloadable tensor payload: {type(e).__name__}: {e}") from None
    if isinstance(header.get("fds"), int) and 0 < header["fds"] <= 64:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, header["fds"])
        except OSError as e:
            raise ChannelClosed(f"file descriptors did not arrive: {e}") from None
        if not accept_fds:  # the tuner takes no files from a worker
            for fd in fds:
                os.close(fd)
            raise ChannelClosed("the worker sent file descriptors")
        header["_fds"] = list(fds)
    return header, tensors
