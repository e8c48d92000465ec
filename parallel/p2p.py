"""Point-to-point transfer of a payload: a dict of named tensors plus JSON metadata.

Wire format (three messages from src to dst, in this order, all on the comm device):

1. an int64 tensor [1] holding the header length L in bytes;
2. the header, a uint8 tensor [L]: JSON of
   {"meta": <metadata>, "nbytes": total, "tensors": [{"name", "dtype", "shape", "offset"}, ...]};
3. one flat uint8 buffer [nbytes] holding every tensor's bytes at its offset (left out when
   nbytes == 0, e.g. for an empty dict).

Offsets are aligned to 16 bytes so that the receiver can view each slice of the buffer as its
dtype without a copy (a dtype view needs a storage offset divisible by the element size).

The comm device is cuda for NCCL and cpu for gloo. Tensors elsewhere are moved there to send,
and received tensors are moved to the caller's device. `dst` and `src` are global ranks, also
when `group` is a subgroup (as in `torch.distributed.send`). Messages between one pair of ranks
are matched in the order they were posted, so both sides must agree on the order of payloads; on
NCCL a communicator also runs a rank's sends and receives in posting order, and a send completes
only with its receive: which traffic goes on which communicator is parallel/topology.py's
ProcessGroups.

Every send and receive is posted through `isend` / `irecv` and waited on through `wait`, which
record them in the communication trace (DIGENRL_COMM_TRACE, telemetry/commtrace.py) and bound
every wait from when it starts (`wait`).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from telemetry import commtrace

commtrace.plumbing(__file__)  # a recorded op's "where" is the caller's line

_ALIGN = 16  # bytes; the largest element size (complex128)


class ProtocolError(RuntimeError):
    """A message arrived that the receiver did not expect at this point of the protocol."""


class PeerError(RuntimeError):
    """A wait on another rank failed (it died, closed the connection, or did not answer in time);
    the message names that rank by role (`configure(describe=...)`)."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


# Every point-to-point wait is bounded by this many seconds (runguard.RunGuard adapts it to the
# measured step time) and names its peer with `_describe`; both are set once per process.
_timeout_s = 600.0
_describe: Callable[[int], str] = lambda rank: f"rank {rank}"


def configure(timeout_s: float | None = None, describe: Callable[[int], str] | None = None) -> None:
    global _timeout_s, _describe
    if timeout_s is not None:
        _timeout_s = float(timeout_s)
    if describe is not None:
        _describe = describe


def describe(rank: int) -> str:
    return _describe(rank)


@dataclass
class Posted:
    """A posted send or receive: the backend's work, the other rank, when it was posted and its
    line in the communication trace (None when tracing is off)."""

    work: object
    peer: int
    group: object
    posted_s: float  # time.monotonic() at posting
    line: int | None

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _post(op: str, tensor: Tensor, peer: int, group, name: str) -> Posted:
    line = commtrace.record(op, commtrace.group_name(group), peer=peer, nbytes=tensor.numel() * tensor.element_size(),
                            name=name)
    work = dist.isend(tensor, dst=peer, group=group) if op == "send" else dist.irecv(tensor, src=peer, group=group)
    return Posted(work, peer, group, time.monotonic(), line)


def isend(tensor: Tensor, dst: int, group=None, name: str = "") -> Posted:
    """Post a send of a contiguous tensor to global rank `dst` (`name` tags it in the trace)."""
    return _post("send", tensor, dst, group, name)


def irecv(tensor: Tensor, src: int, group=None, name: str = "") -> Posted:
    """Post a receive from global rank `src` into a contiguous tensor."""
    return _post("recv", tensor, src, group, name)


def wait(op: Posted, what: str) -> None:
    """Wait for one posted op, at most the current timeout from now; a failure names the peer.

    NCCL counts a wait's timeout from when the op was posted (ProcessGroupNCCL's
    WorkNCCL::checkTimeout measures from workStartTime_), gloo from the wait: the time the op has
    been posted is added, so on every backend the bound starts when the wait can start and an op
    posted long before (a fragment sent before a trainer's evaluation) is not cut short."""
    if op.line is not None:
        commtrace.record("wait", commtrace.group_name(op.group), target=op.line)
    try:
        op.work.wait(timedelta(seconds=_timeout_s + time.monotonic() - op.posted_s))
    except RuntimeError as e:
        raise PeerError(op.peer, f"{what} {_describe(op.peer)} failed: {backend_detail(e)} (waits time out after "
                                 f"{_timeout_s:.0f} s)") from e


def backend_detail(e: BaseException) -> str:
    """The backend's message without its source location and boilerplate advice."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]


def recv(tensor: Tensor, src: int, group=None, name: str = "") -> None:
    """A blocking receive from global rank `src`, bounded and named (dist.recv ignores a changed timeout)."""
    wait(irecv(tensor, src, group, name), "receive from")


_DTYPES = {
    str(dt): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


def comm_device(group=None) -> torch.device:
    """The device that communication tensors must live on: the current cuda device for NCCL,
    cpu otherwise (gloo)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `str(dtype)` for the dtypes this module can carry."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]


def as_bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's storage as a flat uint8 tensor [numel * element_size] (no copy)."""
    if not t.is_contiguous():  # a view of a copy would send, or receive into, the wrong memory
        raise ValueError(f"as_bytes needs a contiguous tensor, got shape {list(t.shape)} strides {t.stride()}")
    return t.reshape(-1).view(torch.uint8)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ---------------------------------------------------------------------------------------------
# Packing and unpacking (pure, no communication)
# ---------------------------------------------------------------------------------------------

def pack_payload(tensors: dict[str, Tensor], meta: dict[str, Any] | None,
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
    """(length [1] int64, header [L] uint8, buffer [nbytes] uint8 or None), all on `device`."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict[str, Tensor], got {type(tensors).__name__}")
    specs, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, Tensor):
            raise TypeError(f"payload entries must be str -> Tensor, got {name!r}: {type(t).__name__}")
        dtype_from_name(str(t.dtype))  # validates the dtype
        specs.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset})
        offset = _align(offset + t.numel() * t.element_size())
    nbytes = offset
    header = json.dumps({"meta": meta or {}, "nbytes": nbytes, "tensors": specs}).encode()
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    length_t = torch.tensor([len(header)], dtype=torch.int64, device=device)
    if nbytes == 0:
        return length_t, header_t, None
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for spec, t in zip(specs, tensors.values()):
        n = t.numel() * t.element_size()
        if n:
            buffer[spec["offset"]:spec["offset"] + n].copy_(as_bytes(t.detach().contiguous()))
    return length_t, header_t, buffer


def unpack_payload(header: dict[str, Any], buffer: Tensor | None, device: torch.device) -> dict[str, Tensor]:
    """Views of `buffer` (on `device`), one per tensor of the header, sharing its storage."""
    out = {}
    for spec in header["tensors"]:
        dtype = dtype_from_name(spec["dtype"])
        shape = spec["shape"]
        numel = 1
        for s in shape:
            numel *= s
        n = numel * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            out[spec["name"]] = torch.empty(shape, dtype=dtype, device=device)
            continue
        out[spec["name"]] = buffer[spec["offset"]:spec["offset"] + n].view(dtype).view(shape)
    return out


def _decode_header(header_t: Tensor) -> dict[str, Any]:
    return json.loads(bytes(header_t.cpu().numpy().tobytes()).decode())


# ---------------------------------------------------------------------------------------------
# Blocking transfer
# ---------------------------------------------------------------------------------------------

def send_payload(tensors: dict[str, Tensor], meta: dict[str, Any] | None, dst: int, group=None) -> None:
    """Send `tensors` and `meta` to global rank `dst`; returns when the buffers may be reused."""
    isend_payload(tensors, meta, dst, group).wait()


def recv_payload(src: int, group=None, device: torch.device | str | None = None
                 ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Receive one payload from global rank `src`: (tensors on `device`, metadata).

    `device` defaults to the comm device. The tensors are views of one received buffer. The
    header and buffer sizes are only known once the previous message has arrived, so a payload
    receive is blocking; overlap comes from the sender's `isend_payload`."""
    comm = comm_device(group)
    # Rank wait: each recv blocks until src has sent the matching message.
    length_t = torch.empty(1, dtype=torch.int64, device=comm)
    recv(length_t, src, group, "payload.length")
    header_t = torch.empty(int(length_t.item()), dtype=torch.uint8, device=comm)
    recv(header_t, src, group, "payload.header")
    header = _decode_header(header_t)
    target = torch.device(device) if device is not None else comm
    buffer = None
    if header["nbytes"]:
        buffer = torch.empty(header["nbytes"], dtype=torch.uint8, device=comm)
        recv(buffer, src, group, "payload.data")
        buffer = buffer.to(target)  # one transfer for the whole payload (no-op when equal)
    return unpack_payload(header, buffer, target), header["meta"]


# ---------------------------------------------------------------------------------------------
# Non-blocking transfer
# ---------------------------------------------------------------------------------------------

@dataclass
class SendHandle:
    """An in-flight payload send. Holds the packed buffers until `wait()` returns, because the
    backend reads them asynchronously."""

    sends: list[Posted]
    buffers: list[Tensor] = field(repr=False)
    dst: int = -1

    def wait(self) -> None:
        """Block until every message has been handed to the backend, each wait bounded (`wait`)."""
        for op in self.sends:
            wait(op, "send to")
        self.sends, self.buffers = [], []

    def is_completed(self) -> bool:
        return all(op.is_completed() for op in self.sends)


def _send_all(buffers: list[Tensor], names: tuple[str, ...], dst: int, group) -> SendHandle:
    return SendHandle([isend(b, dst, group, n) for b, n in zip(buffers, names)], buffers, dst)


def isend_payload(tensors: dict[str, Tensor], meta: dict[str, Any] | None, dst: int, group=None) -> SendHandle:
    """Start sending a payload to global rank `dst`; call `.wait()` on the result before relying
    on delivery. The caller's tensors may be modified right away (they were copied into a
    packed buffer)."""
    length_t, header_t, buffer = pack_payload(tensors, meta, comm_device(group))
    buffers = [length_t, header_t] + ([buffer] if buffer is not None else [])
    return _send_all(buffers, ("payload.length", "payload.header", "payload.data"), dst, group)


# ---------------------------------------------------------------------------------------------
# Framed messages: a fixed-size header, so a receive can be posted before the message is needed
# ---------------------------------------------------------------------------------------------

FRAME_HEADER_BYTES = 1 << 14


def isend_framed(tensors: dict[str, Tensor], meta: dict[str, Any] | None, dst: int, group=None) -> SendHandle:
    """Like isend_payload, but the header travels in a fixed FRAME_HEADER_BYTES buffer (two
    messages, no length), so the receiver can post its receive early with `post_recv`."""
    comm = comm_device(group)
    _, header_t, buffer = pack_payload(tensors, meta, comm)
    if header_t.numel() > FRAME_HEADER_BYTES:
        raise ValueError(f"framed header of {header_t.numel()} bytes exceeds {FRAME_HEADER_BYTES}")
    frame = torch.zeros(FRAME_HEADER_BYTES, dtype=torch.uint8, device=comm)
    frame[:header_t.numel()] = header_t
    buffers = [frame] + ([buffer] if buffer is not None else [])
    return _send_all(buffers, ("frame.header", "frame.data"), dst, group)


class PostedRecv:
    """A framed receive posted ahead of time. Post at most one per (src, dst) pair at a time:
    the messages of a pair match receives in order."""

    def __init__(self, src: int, group=None, device: torch.device | str | None = None):
        self.src, self.group = src, group
        self.comm = comm_device(group)
        self.device = torch.device(device) if device is not None else self.comm
        self.frame = torch.empty(FRAME_HEADER_BYTES, dtype=torch.uint8, device=self.comm)
        self.op = irecv(self.frame, src, group, "frame.header")

    def wait(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        wait(self.op, "receive from")  # rank wait: the header of src's next framed message
        raw = bytes(self.frame.cpu().numpy().tobytes()).rstrip(b"\0")
        header = json.loads(raw.decode())
        buffer = None
        if header["nbytes"]:
            buffer = torch.empty(header["nbytes"], dtype=torch.uint8, device=self.comm)
            recv(buffer, self.src, self.group, "frame.data")
            buffer = buffer.to(self.device)
        return unpack_payload(header, buffer, self.device), header["meta"]


def post_recv(src: int, group=None, device: torch.device | str | None = None) -> PostedRecv:
    return PostedRecv(src, group, device)


__all__ = [
    "FRAME_HEADER_BYTES", "PeerError", "Posted", "ProtocolError", "backend_detail", "configure", "describe", "irecv",
    "isend", "recv", "wait",
    "PostedRecv", "isend_framed", "post_recv",
    "SendHandle", "as_bytes", "comm_device", "dtype_from_name", "isend_payload", "pack_payload",
    "recv_payload", "send_payload", "unpack_payload",
]
