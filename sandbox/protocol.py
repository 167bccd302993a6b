"""The wire between the tuner and a sandbox worker: length-prefixed frames over a socket.

Each frame is a JSON header plus an optional blob of tensors written with `torch.save`.
Nothing crossing the wire is unpickled with the general pickle: the parent reads tensors
with `torch.load(weights_only=True)`, so a worker taken over by candidate code can send
wrong numbers (which verification rejects) but cannot run code in the tuner.

Every request carries a fresh random `nonce` that its reply must echo: a frame that
candidate code writes to the worker's socket ahead of time cannot know it, so a forged
reply is a broken channel, not an answer (sandbox/client.py). Files (frozen inputs and
state) travel as open file descriptors after a frame whose header counts them (`fds`), so a
jailed worker reads them without seeing the folder they live in.
"""

from __future__ import annotations

import io
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


def send(sock: socket.socket, header: dict[str, Any], tensors: Any = None, fds: list[int] | None = None) -> None:
    if fds:
        header = {**header, "fds": len(fds)}
    body = json.dumps(header).encode()
    blob = b""
    if tensors is not None:
        buf = io.BytesIO()
        torch.save(tensors, buf)
        blob = buf.getvalue()
    try:
        sock.sendall(_HEADER.pack(len(body), len(blob)) + body + blob)
        if fds:
            socket.send_fds(sock, [b"F"], fds)
    except (BrokenPipeError, ConnectionResetError, OSError) as e:
        raise ChannelClosed(str(e)) from None


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                raise ChannelTimeout(f"no answer within the time limit ({got}/{n} bytes)")
        try:
            chunk = sock.recv(min(n - got, 1 << 22))
        except (ConnectionResetError, OSError) as e:
            raise ChannelClosed(str(e)) from None
        if not chunk:
            raise ChannelClosed("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout: float | None = None, accept_fds: bool = False) -> tuple[dict[str, Any], Any]:
    """One frame: (header, tensors or None). Raises ChannelTimeout or ChannelClosed. File
    descriptors that follow a frame land in header["_fds"] where `accept_fds` (the worker's side)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    n_body, n_blob = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n_body > MAX_FRAME or n_blob > MAX_FRAME:
        raise ChannelClosed(f"oversized frame ({n_body} + {n_blob} bytes)")
    try:
        header = json.loads(_recv_exact(sock, n_body, deadline))
    except json.JSONDecodeError as e:
        raise ChannelClosed(f"malformed frame: {e}") from None
    if not isinstance(header, dict):
        raise ChannelClosed("malformed frame: header is not an object")
    tensors = None
    if n_blob:
        blob = _recv_exact(sock, n_blob, deadline)
        try:
            tensors = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        except Exception as e:  # a worker that sends non-tensor objects is not trusted further
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
