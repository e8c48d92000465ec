"""Verified weight publication (docs/DESIGN.md, weight publication).

After step k's update a trainer rank publishes version k+1 to each generator rank, sending
exactly the tensors that rank holds (its stage's blocks plus embed or head; LoRA adapters only
for LoRA runs). The protocol, sender -> receiver:

1. a header payload (`parallel.p2p`): version, the wire tensors' names, shapes and dtypes, the
   bucket plan, the encoding (parallel/compress.py) with the name, shape and dtype of every tensor
   it rebuilds, the checksum of every rebuilt tensor and the checksums the sender published to
   this receiver last time;
2. the buckets, one message each: the tensors of one dtype, flattened and concatenated, at most
   `bucket_bytes` each unless a single tensor is larger.

The receiver stages the buckets in buffers of its own (`WeightReceiver.receive`) and copies
them into its live parameters when the caller says so (`install`, at a fragment boundary, so
that no trajectory sees a weight swap). After the copy it checksums the *installed* tensors and
compares with the sender's: any difference in names, shapes, dtypes or values raises
`PublicationError`. So does an update that silently does nothing: a tensor the sender says has
changed since its previous publication, yet which install left as it was.

Checksums are exact integer sums (see `checksum`), so they agree across devices, reduction
orders and processes.

Test hook: the environment variable `DIGENRL_DEBUG_CORRUPT_PUBLISH`, read by `install`,
corrupts the publication on purpose so that end-to-end tests can check that it is caught:
`1` or `flip` flips one bit of one staged tensor before the copy (a value mismatch), `skip`
skips every copy (an update that does nothing). Unset or empty in normal runs; any other value is
an error (config/preflight.py checks it before a run starts).
"""
from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from parallel import compress, p2p
from parallel.p2p import as_bytes, comm_device, dtype_from_name, recv_payload, send_payload

CORRUPT_ENV = "DIGENRL_DEBUG_CORRUPT_PUBLISH"
CORRUPT_MODES = ("", "1", "flip", "skip")

_MOD_POSITION = 65521  # largest prime below 2**16: position weights are 1..65521
_MERSENNE_61 = (1 << 61) - 1  # checksums are folded into [0, 2**61 - 1)
_HI_FACTOR = 0x9E3779B97F4A7C15 % _MERSENNE_61  # mixes the high halves into the fold
_LEN_FACTOR = 0xC2B2AE3D27D4EB4F % _MERSENNE_61  # mixes the byte length into the fold
_CHUNK_WORDS = 1 << 24  # bounds the int64 temporaries to 128 MiB per chunk

class PublicationError(RuntimeError):
    """A publication failed verification. `mismatched` maps each failing tensor to
    (sender checksum, installed checksum); `unchanged` lists the tensors the sender changed but
    install left as they were; `layout` describes name, shape or dtype mismatches."""

    def __init__(self, message: str, mismatched: dict[str, tuple[int, int]] | None = None,
                 unchanged: list[str] | None = None, layout: list[str] | None = None):
        super().__init__(message)
        self.mismatched = mismatched or {}
        self.unchanged = unchanged or []
        self.layout = layout or []


# ---------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------

def _int32_words(t: Tensor):
    """Yield (first word index, int32 chunk) covering the tensor's bytes, zero-padded to 4."""
    b = as_bytes(t.detach().contiguous())  # [nbytes] uint8
    n_full = b.numel() // 4 * 4
    body = b[:n_full]
    if body.storage_offset() % 4:
        body = body.clone()  # a dtype view needs an aligned storage offset
    words = body.view(torch.int32)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        yield start, words[start:start + _CHUNK_WORDS]
    if n_full < b.numel():
        tail = torch.zeros(4, dtype=torch.uint8, device=b.device)
        tail[:b.numel() - n_full] = b[n_full:]
        yield words.numel(), tail.view(torch.int32)


def checksum(t: Tensor) -> int:
    """Exact, order-independent checksum of a tensor's bytes, as a Python int in [0, 2**61-1).

    The bytes are read as int32 words x_i (the last one zero-padded), each split into 16-bit
    halves, and weighted by their position w_i = (i mod 65521) + 1:
        lo = sum_i (x_i & 0xFFFF) * w_i,   hi = sum_i ((x_i >> 16) & 0xFFFF) * w_i
    Every product is below 2**32 and every chunk sum below 2**56, so the int64 sums are exact on
    any device and in any reduction order. lo, hi and the byte length are folded modulo the
    Mersenne prime 2**61-1. Changing any single element always changes the checksum (it changes
    lo or hi by d * w_i with 0 < |d|, w_i < 2**16); so does moving a value to another position,
    except between positions that are a multiple of 65521 words apart. Dtype and shape are not
    part of it: `state_checksum` adds them."""
    lo = hi = 0
    nbytes = t.numel() * t.element_size()
    for start, words in _int32_words(t):
        w = words.to(torch.int64)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) % _MOD_POSITION + 1
        lo += int(((w & 0xFFFF) * pos).sum())
        hi += int((((w >> 16) & 0xFFFF) * pos).sum())
    return (lo + hi * _HI_FACTOR + nbytes * _LEN_FACTOR) % _MERSENNE_61


def state_checksum(tensors: dict[str, Tensor]) -> int:
    """Checksum of a named set of tensors: names, dtypes, shapes and `checksum` of each,
    independent of dict order. A Python int in [0, 2**63)."""
    return _combine({name: (str(t.dtype), list(t.shape), checksum(t)) for name, t in tensors.items()})


def _combine(entries: dict[str, tuple[str, list[int], int]]) -> int:
    lines = sorted(f"{name}|{dtype}|{shape}|{value}" for name, (dtype, shape, value) in entries.items())
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------------------------------------
# Bucket plan (pure)
# ---------------------------------------------------------------------------------------------

def plan_buckets(layout: list[tuple[str, str, int]], bucket_bytes: int) -> list[dict]:
    """Group tensors (name, dtype name, numel) into flat buckets of one dtype each.

    Dtypes come in order of first appearance and names keep their order within a dtype. A
    bucket holds at most `bucket_bytes` unless a single tensor is larger (it then goes alone).
    Returns [{"dtype", "numel", "names"}]."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[tuple[str, int]]] = {}
    for name, dtype, numel in layout:
        by_dtype.setdefault(dtype, []).append((name, numel))
    buckets = []
    for dtype, items in by_dtype.items():
        element_size = torch.empty((), dtype=dtype_from_name(dtype)).element_size()
        current: dict | None = None
        for name, numel in items:
            size = numel * element_size
            if current is None or (current["numel"] * element_size + size > bucket_bytes and current["names"]):
                current = {"dtype": dtype, "numel": 0, "names": []}
                buckets.append(current)
            current["names"].append(name)
            current["numel"] += numel
    return buckets


# ---------------------------------------------------------------------------------------------
# Sender
# ---------------------------------------------------------------------------------------------

@dataclass
class PublishStats:
    """What one `publish_weights` call sent."""

    version: int
    dst: int
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    """wall time of the whole call, checksums included"""
    checksum_seconds: float
    state_checksum: int
    num_changed: int | None
    """tensors whose checksum differs from the previous publication to dst; None for the first"""
    checksums: dict[str, int] = field(repr=False)


def publish_weights(tensors: dict[str, Tensor], version: int, dst: int, group=None,
                    bucket_bytes: int = 64 << 20,
                    previous_checksums: dict[str, int] | None = None, encoding: str = "none",
                    rebuilt: dict[str, Tensor] | None = None,
                    link_bytes_per_s: float | None = None) -> PublishStats:
    """Send `tensors` as `version` to global rank `dst`.

    Uncompressed, `tensors` are exactly the tensors the receiver holds. With an `encoding`
    (parallel/compress.py) they are wire tensors, and `rebuilt` are the tensors the receiver will
    hold once it applies them: their names, shapes, dtypes and checksums go in the header.
    `previous_checksums` are the checksums of the previous publication to this receiver, which
    let it detect an update that does nothing; None or `{}` means: the first publication
    (`WeightPublisher` remembers them per receiver). `link_bytes_per_s` emulates a slow link
    (--debug-link-bandwidth): each bucket waits its transfer time before it is sent. The tensors
    must not change until the call returns."""
    start = time.perf_counter()
    comm = comm_device(group)
    rebuilt = tensors if rebuilt is None else rebuilt
    sums = {name: checksum(t) for name, t in rebuilt.items()}
    checksum_seconds = time.perf_counter() - start
    previous = previous_checksums
    buckets = plan_buckets([(n, str(t.dtype), t.numel()) for n, t in tensors.items()], bucket_bytes)
    header = {
        "version": int(version),
        "names": list(tensors),
        "shapes": [list(t.shape) for t in tensors.values()],
        "dtypes": [str(t.dtype) for t in tensors.values()],
        "encoding": encoding,
        "targets": [[n, list(t.shape), str(t.dtype)] for n, t in rebuilt.items()],
        "checksums": sums,
        "previous_checksums": previous or None,
        "buckets": buckets,
    }
    send_payload({}, header, dst, group)
    # Keep at most two buckets in flight: the next one is packed while the last one is sent.
    in_flight: deque = deque()
    num_bytes = 0
    for bucket in buckets:
        flat = _pack_bucket([tensors[n] for n in bucket["names"]], comm)
        num_bytes += flat.numel() * flat.element_size()
        if link_bytes_per_s:
            time.sleep(flat.numel() * flat.element_size() / link_bytes_per_s)  # the emulated link's transfer
        in_flight.append((p2p.isend(as_bytes(flat), dst, group, "publish.bucket"), flat))
        if len(in_flight) > 1:
            p2p.wait(in_flight.popleft()[0], "send to")
    while in_flight:
        p2p.wait(in_flight.popleft()[0], "send to")
    changed = None if not previous else sum(previous.get(n) != s for n, s in sums.items())
    return PublishStats(
        version=int(version), dst=dst, num_tensors=len(rebuilt), num_buckets=len(buckets),
        num_bytes=num_bytes, seconds=time.perf_counter() - start, checksum_seconds=checksum_seconds,
        state_checksum=_combine({n: (str(t.dtype), list(t.shape), sums[n]) for n, t in rebuilt.items()}),
        num_changed=changed, checksums=sums,
    )


class WeightPublisher:
    """The sending side of one trainer rank: publishes versions, compressed or not, and remembers
    per receiver the checksums it sent last, so that each receiver can tell an update that does
    nothing. With `keep`, it also keeps CPU copies of the last two versions the generators hold
    (what TCSS generators hold when a checkpoint is written: `kept(version)`)."""

    def __init__(self, bucket_bytes: int = 64 << 20, compression: str = "none",
                 link_mbps: float | None = None, keep: bool = False):
        self.bucket_bytes, self.compression = bucket_bytes, compression
        self.link_bytes_per_s = link_mbps * 1e6 if link_mbps else None
        self.last: dict[int, dict[str, int]] = {}  # dst -> name -> checksum
        self.keep = keep
        self._kept: dict[int, dict[str, Tensor]] = {}  # version -> name -> tensor, the last two versions

    def publish(self, tensors: dict[str, Tensor], version: int, dst: int, group=None, encoding: str = "none",
                rebuilt: dict[str, Tensor] | None = None) -> PublishStats:
        stats = publish_weights(tensors, version, dst, group, self.bucket_bytes, self.last.get(dst), encoding,
                                rebuilt, self.link_bytes_per_s)
        self.last[dst] = stats.checksums
        if self.keep:
            self.remember(version, tensors if rebuilt is None else rebuilt)
        return stats

    def publish_all(self, wire: dict[str, Tensor], held: dict[str, Tensor], names_by_dst: dict[int, list[str]],
                    version: int, group=None) -> list[PublishStats]:
        """One version to every receiver, each its own names: `wire` is the version encoded once
        (every receiver holds the previous version) and `held` what the receivers rebuild from it
        (uncompressed, the same tensors)."""
        parts = compress.split_wire(wire)
        out = []
        for dst, names in names_by_dst.items():
            mine = {compress.wire_name(n, p): t for n in names for p, t in parts[n].items()}
            out.append(self.publish(mine, version, dst, group, self.compression, {n: held[n] for n in names}))
        return out

    def remember(self, version: int, tensors: dict[str, Tensor]) -> None:
        """Keep a copy of `tensors` as (part of) `version`; versions older than the last two go."""
        held = self._kept.setdefault(version, {})
        for name, t in tensors.items():
            if name not in held:
                held[name] = t.detach().to("cpu", copy=True)
        for old in sorted(self._kept)[:-2]:
            del self._kept[old]

    def kept(self, version: int) -> dict[str, Tensor] | None:
        return self._kept.get(version)


def _pack_bucket(parts: list[Tensor], device: torch.device) -> Tensor:
    """One flat contiguous tensor [sum numel] of the parts' dtype on `device`."""
    if len(parts) == 1 and parts[0].is_contiguous() and parts[0].device == device:
        return parts[0].detach().reshape(-1)  # no copy for a lone tensor already in place
    return torch.cat([p.detach().reshape(-1).to(device) for p in parts])


# ---------------------------------------------------------------------------------------------
# Receiver
# ---------------------------------------------------------------------------------------------

class WeightReceiver:
    """Receives publications into a staging buffer and installs them into live tensors.

    `targets` are the receiver's live parameters by name (the same names the sender sends).
    Staging buffers live on the comm device and are reused while the bucket plan is unchanged."""

    def __init__(self, targets: dict[str, Tensor]):
        self.targets = dict(targets)
        self.installed_version: int | None = None
        self._header: dict | None = None
        self._staged: dict[str, Tensor] | None = None
        self._buffers: list[Tensor] = []
        self._buffers_key: tuple | None = None

    @property
    def staged_version(self) -> int | None:
        """The version received but not installed yet, if any."""
        return None if self._header is None else self._header["version"]

    def receive(self, src: int, group=None) -> int:
        """Receive one publication from global rank `src` into staging; returns its version.

        The targets are not touched. A names, shape or dtype mismatch with the targets raises
        `PublicationError`, after the whole publication has been drained from the wire."""
        # Rank wait: blocks until src publishes.
        _, header = recv_payload(src, group)
        comm = comm_device(group)
        buffers = self._staging_buffers(header["buckets"], comm)
        for buf in buffers:
            p2p.recv(as_bytes(buf), src, group, "publish.bucket")  # rank wait: one bucket from src
        shapes = dict(zip(header["names"], header["shapes"]))  # of the wire tensors
        staged = {}
        for bucket, buf in zip(header["buckets"], buffers):
            offset = 0
            for name in bucket["names"]:
                shape = shapes[name]
                numel = _numel(shape)
                staged[name] = buf[offset:offset + numel].view(shape)
                offset += numel
        self._header, self._staged = None, None
        problems = self._layout_problems(header)
        if problems:
            raise PublicationError(
                f"publication of version {header['version']} from rank {src} does not match this "
                f"receiver's tensors: " + "; ".join(problems), layout=problems)
        self._header, self._staged = header, staged
        return header["version"]

    def install(self) -> int:
        """Copy the staged tensors into the targets in place and verify them; returns the version.

        Verification checksums the targets *after* the copy and compares with the sender's
        checksums; it also checks that every tensor the sender changed since its previous
        publication changed here. Raises `PublicationError` naming the failing tensors and both
        checksums. Honours the `DIGENRL_DEBUG_CORRUPT_PUBLISH` test hook (module docstring)."""
        if self._staged is None:
            raise RuntimeError("install() without a received publication: call receive() first")
        header, staged = self._header, self._staged
        self._header, self._staged = None, None  # a publication is installed at most once
        expected = header["checksums"]
        previous = header["previous_checksums"] or {}
        changed = [n for n, _, _ in header["targets"] if n in previous and previous[n] != expected[n]]
        before = {n: checksum(self.targets[n]) for n in changed}
        corrupt = os.environ.get(CORRUPT_ENV, "").strip().lower()
        if corrupt not in CORRUPT_MODES:
            raise ValueError(f"{CORRUPT_ENV}={corrupt!r}: not one of {CORRUPT_MODES[1:]}")
        if corrupt in ("1", "flip"):
            _flip_one_bit(staged)
        names = [t[0] for t in header["targets"]]
        if corrupt != "skip":
            for name, parts in compress.split_wire(staged).items():
                compress.apply(header["encoding"], self.targets[name], parts)
        after = {n: checksum(self.targets[n]) for n in names}
        mismatched = {n: (expected[n], after[n]) for n in names if after[n] != expected[n]}
        unchanged = [n for n in changed if after[n] == before[n]]
        if mismatched or unchanged:
            raise PublicationError(_failure_message(header["version"], mismatched, unchanged),
                                   mismatched=mismatched, unchanged=unchanged)
        self.installed_version = header["version"]
        return self.installed_version

    def _staging_buffers(self, buckets: list[dict], device: torch.device) -> list[Tensor]:
        key = (str(device), tuple((b["dtype"], b["numel"]) for b in buckets))
        if key != self._buffers_key:
            self._buffers = [torch.empty(b["numel"], dtype=dtype_from_name(b["dtype"]), device=device)
                             for b in buckets]
            self._buffers_key = key
        return self._buffers

    def _layout_problems(self, header: dict) -> list[str]:
        """Names, shapes and dtypes of the tensors the publication rebuilds against the targets."""
        sent = {n for n, _, _ in header["targets"]}
        problems = []
        missing = [n for n in self.targets if n not in sent]
        extra = [n for n, _, _ in header["targets"] if n not in self.targets]
        if missing:
            problems.append(f"not sent: {missing}")
        if extra:
            problems.append(f"sent but not held here: {extra}")
        for name, shape, dtype in header["targets"]:
            target = self.targets.get(name)
            if target is None:
                continue
            if list(target.shape) != shape:
                problems.append(f"{name!r}: sent shape {shape}, target shape {list(target.shape)}")
            if str(target.dtype) != dtype:
                problems.append(f"{name!r}: sent dtype {dtype}, target dtype {target.dtype}")
        return problems


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _flip_one_bit(staged: dict[str, Tensor]) -> None:
    """Test hook: flip the lowest bit of the first byte of the first non-empty staged tensor."""
    for t in staged.values():
        if t.numel():
            as_bytes(t)[0] ^= 1
            return


def _failure_message(version: int, mismatched: dict[str, tuple[int, int]], unchanged: list[str]) -> str:
    parts = [f"publication of version {version} failed verification"]
    if unchanged:
        parts.append(f"the update silently did nothing for {len(unchanged)} tensor(s) the sender changed "
                     f"since its previous publication: {unchanged}")
    if mismatched:
        parts.append(f"{len(mismatched)} installed tensor(s) differ from the sender's: " + ", ".join(
            f"{n!r} (sender checksum {s}, installed checksum {r})" for n, (s, r) in mismatched.items()))
    return "; ".join(parts)


__all__ = [
    "CORRUPT_ENV", "CORRUPT_MODES", "PublicationError", "PublishStats", "WeightReceiver", "checksum", "plan_buckets",
    "WeightPublisher", "publish_weights", "state_checksum",
]
