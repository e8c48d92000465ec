"""Verified weight publication (docs/DESIGN.md, weight publication).

After step k's update a trainer rank publishes version k+1 to each generator rank, sending
exactly the tensors that rank holds (its stage's blocks plus embed or head; LoRA adapters only
for LoRA runs), as it holds them (the compute dtype). The protocol, sender -> receiver:

1. a header payload (`parallel.p2p`): version, the wire tensors' names, shapes and dtypes, the
   bucket plan, the encoding (parallel/compress.py) with the name, shape and dtype of every tensor
   it rebuilds, the checksum of every rebuilt tensor and the checksums the sender published to
   this receiver last time;
2. the buckets, one message each: the tensors of one dtype, flattened and concatenated, at most
   `bucket_bytes` each unless a single tensor is larger.

The sender fetches the version a bucket at a time (`Outgoing`): FSDP trainers all-gather each
bucket together just before it is sent, and checksum their shards once per version
(parallel/checksums.py), so no rank holds the whole model. The receiver applies each bucket as it
arrives (`WeightReceiver.receive`): into the live parameters at a step boundary, so that no
trajectory sees a weight swap, or (TCSS) into an idle copy that `install` copies in at the next
step boundary. After the copy it checksums the *installed* tensors and compares with the sender's:
any difference in names, shapes, dtypes or values raises `PublicationError`. So does an update
that silently does nothing: a tensor the sender says has changed since its previous publication,
yet which install left as it was.

Test hook: the environment variable `DIGENRL_DEBUG_CORRUPT_PUBLISH`, read where the live
tensors are written, corrupts the publication on purpose so that end-to-end tests can check that
it is caught: `1` or `flip` flips one bit of one received tensor before it is applied (a value
mismatch), `skip` skips every write (an update that does nothing). Unset or empty in normal runs; any other value is
an error (config/preflight.py checks it before a run starts).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from parallel import compress, p2p
from parallel.checksums import checksum, checksums_of, combine, state_checksum
from parallel.fsdp import full_tensor, spans_ranks
from parallel.p2p import as_bytes, comm_device, dtype_from_name, recv_payload, send_payload

CORRUPT_ENV = "DIGENRL_DEBUG_CORRUPT_PUBLISH"
CORRUPT_MODES = ("", "1", "flip", "skip")

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
class Outgoing:
    """One version as the trainer ranks hold it, for publication, fetched bucket by bucket.

    `wire`: wire name -> (shape, dtype name) of each tensor that travels (parallel/compress.py
    names the parts of a codec); `targets`: name -> (shape, dtype name) of each tensor receivers
    rebuild; `checksums`: of the rebuilt tensors, computed once per version (`checksums_of`);
    `fetch(names, rebuilt)`: the whole wire tensors of `names`, or with `rebuilt` the whole rebuilt
    ones. With `collective` (FSDP-sharded trainers) a fetch all-gathers, so every trainer rank
    fetches the same buckets in the same order (`WeightPublisher.follow_all`) while one of them
    sends: the whole model is never on one rank, only a bucket at a time."""

    wire: dict[str, tuple[list[int], str]]
    targets: dict[str, tuple[list[int], str]]
    checksums: dict[str, int]
    fetch: Callable[..., dict[str, Tensor]]
    encoding: str = "none"
    collective: bool = False

    @classmethod
    def of(cls, wire: dict[str, Tensor], rebuilt: dict[str, Tensor] | None = None, encoding: str = "none",
           dtype: torch.dtype | None = None) -> "Outgoing":
        """A version from tensors this rank holds, whole or FSDP-sharded: `wire` travels, receivers
        rebuild `rebuilt` (default: `wire`); `dtype` (the compute dtype) casts both, one bucket at a
        time, as they are fetched. Under FSDP a collective (the checksums)."""
        rebuilt = wire if rebuilt is None else rebuilt

        def layout(tensors):
            return {n: (list(t.shape), str(dtype if dtype is not None and t.is_floating_point() else t.dtype))
                    for n, t in tensors.items()}

        def fetch(names: list[str], rebuilt_tensors: bool = False) -> dict[str, Tensor]:
            source = rebuilt if rebuilt_tensors else wire
            out = {}
            for n in names:  # one tensor at a time: cast on the shard, then gathered (all-gather under FSDP)
                t = source[n].detach()
                out[n] = full_tensor(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
            return out

        return cls(layout(wire), layout(rebuilt), checksums_of(rebuilt, dtype), fetch, encoding,
                   any(spans_ranks(t) for t in wire.values()))

    def subset(self, names: list[str]) -> "Outgoing":
        """What one receiver holds: the tensors `names` and their wire parts."""
        parts = [w for w in self.wire if w.partition("|")[0] in set(names)]
        return dataclasses.replace(self, wire={w: self.wire[w] for w in parts},
                                   targets={n: self.targets[n] for n in names},
                                   checksums={n: self.checksums[n] for n in names})

    def buckets(self, bucket_bytes: int) -> list[dict]:
        return plan_buckets([(n, dtype, _numel(shape)) for n, (shape, dtype) in self.wire.items()], bucket_bytes)


@dataclass
class PublishStats:
    """What one `publish_weights` call sent."""

    version: int
    dst: int
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    """wall time of the whole call (the version's checksums are computed once, before)"""
    state_checksum: int
    num_changed: int | None
    """tensors whose checksum differs from the previous publication to dst; None for the first"""
    checksums: dict[str, int] = field(repr=False)


def publish_weights(tensors: dict[str, Tensor] | Outgoing, version: int, dst: int, group=None,
                    bucket_bytes: int = 64 << 20,
                    previous_checksums: dict[str, int] | None = None, encoding: str = "none",
                    rebuilt: dict[str, Tensor] | None = None,
                    link_bytes_per_s: float | None = None) -> PublishStats:
    """Send `tensors` as `version` to global rank `dst`.

    `tensors` is an `Outgoing` version, or tensors this rank holds: uncompressed, exactly the
    tensors the receiver holds; with an `encoding` (parallel/compress.py) wire tensors, and
    `rebuilt` the tensors the receiver will hold once it applies them (their names, shapes, dtypes
    and checksums go in the header). `previous_checksums` are the checksums of the previous
    publication to this receiver, which let it detect an update that does nothing; None or `{}`
    means: the first publication (`WeightPublisher` remembers them per receiver).
    `link_bytes_per_s` emulates a slow link (--debug-link-bandwidth): each bucket waits its transfer
    time before it is sent. The tensors must not change until the call returns."""
    start = time.perf_counter()
    out = tensors if isinstance(tensors, Outgoing) else Outgoing.of(tensors, rebuilt, encoding)
    comm = comm_device(group)
    sums = out.checksums
    previous = previous_checksums
    buckets = out.buckets(bucket_bytes)
    header = {
        "version": int(version),
        "names": list(out.wire),
        "shapes": [shape for shape, _ in out.wire.values()],
        "dtypes": [dtype for _, dtype in out.wire.values()],
        "encoding": out.encoding,
        "targets": [[n, shape, dtype] for n, (shape, dtype) in out.targets.items()],
        "checksums": sums,
        "previous_checksums": previous or None,
        "buckets": buckets,
    }
    send_payload({}, header, dst, group)
    # Keep at most two buckets in flight: the next one is packed while the last one is sent.
    in_flight: deque = deque()
    num_bytes = 0
    for bucket in buckets:
        fetched = out.fetch(bucket["names"])  # under FSDP the trainers gather this bucket together
        flat = _pack_bucket([fetched[n] for n in bucket["names"]], comm)
        del fetched
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
        version=int(version), dst=dst, num_tensors=len(out.targets), num_buckets=len(buckets),
        num_bytes=num_bytes, seconds=time.perf_counter() - start,
        state_checksum=combine({n: (dtype, shape, sums[n]) for n, (shape, dtype) in out.targets.items()}),
        num_changed=changed, checksums=sums,
    )


class WeightPublisher:
    """The sending side of one trainer rank: publishes versions, compressed or not, and remembers
    per receiver the checksums it sent last, so that each receiver can tell an update that does
    nothing. With `keep` (TCSS), the rank with `holds` also keeps CPU copies of the last two versions
    the generators hold (what TCSS generators hold when a checkpoint is written: `kept(version)`)."""

    def __init__(self, bucket_bytes: int = 64 << 20, compression: str = "none",
                 link_mbps: float | None = None, keep: bool = False, holds: bool = True):
        self.bucket_bytes, self.compression = bucket_bytes, compression
        self.link_bytes_per_s = link_mbps * 1e6 if link_mbps else None
        self.last: dict[int, dict[str, int]] = {}  # dst -> name -> checksum
        self.keep, self.holds = keep, holds
        self._kept: dict[int, dict[str, Tensor]] = {}  # version -> name -> tensor, the last two versions

    def publish(self, tensors: dict[str, Tensor] | Outgoing, version: int, dst: int, group=None,
                encoding: str = "none", rebuilt: dict[str, Tensor] | None = None) -> PublishStats:
        out = tensors if isinstance(tensors, Outgoing) else Outgoing.of(tensors, rebuilt, encoding)
        stats = publish_weights(out, version, dst, group, self.bucket_bytes, self.last.get(dst),
                                link_bytes_per_s=self.link_bytes_per_s)
        self.last[dst] = stats.checksums
        return stats

    def publish_all(self, out: Outgoing, names_by_dst: dict[int, list[str]], version: int,
                    group=None) -> list[PublishStats]:
        """One version to every receiver, each its own names (every receiver holds the previous
        version, so one encoding serves all)."""
        return [self.publish(out.subset(names), version, dst, group) for dst, names in names_by_dst.items()]

    def follow_all(self, out: Outgoing, names_by_dst: dict[int, list[str]]) -> None:
        """A trainer rank that does not send: under FSDP, the same fetches (all-gathers) in the same
        order as the sending rank's `publish_all`; nothing for replicated trainers."""
        if not out.collective:
            return
        for names in names_by_dst.values():
            for bucket in out.subset(names).buckets(self.bucket_bytes):
                out.fetch(bucket["names"])

    def keep_version(self, out: Outgoing, names: list[str], version: int) -> None:
        """With `keep`, keep the rebuilt tensors `names` of `out` on the host, a bucket at a time, on
        the rank that `holds` them (under FSDP a collective: every trainer rank calls it)."""
        if not self.keep or not (self.holds or out.collective):
            return
        sub = out.subset(names)
        layout = [(n, dtype, _numel(shape)) for n, (shape, dtype) in sub.targets.items()]
        for bucket in plan_buckets(layout, self.bucket_bytes):
            whole = out.fetch(bucket["names"], True)
            if self.holds:
                self.remember(version, whole)

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
    """Receives publications and installs them into live tensors, a bucket at a time.

    `targets` are the receiver's live parameters by name (the same names the sender sends), in the
    dtype receivers hold (the compute dtype). `receive(src, install=True)` applies each bucket to the
    live tensors as it arrives, through one bucket buffer (no staging copy of the model), then
    verifies: call it where no trajectory is in flight (a step or fragment boundary). `receive(src)`
    applies the buckets to an idle copy of the targets instead, while the live ones keep generating
    (TCSS receives version k at a fragment boundary of step k while it samples with version k-1),
    and `install()` copies the idle copy into the live tensors at the step boundary and verifies.
    The idle copy is one double buffer in the targets' dtype, allocated at the first staged
    receive: the least that holds version k beside k-1 (the wire may be a delta against k-1)."""

    def __init__(self, targets: dict[str, Tensor]):
        self.targets = dict(targets)
        self.installed_version: int | None = None
        self._header: dict | None = None  # a staged publication: received into the idle copy
        self._idle: dict[str, Tensor] | None = None
        self._buffer: Tensor | None = None  # uint8, the largest bucket received so far

    @property
    def staged_version(self) -> int | None:
        """The version received into the idle copy but not installed yet, if any."""
        return None if self._header is None else self._header["version"]

    def receive(self, src: int, group=None, install: bool = False) -> int:
        """Receive one publication from global rank `src`; returns its version. With `install`,
        into the live tensors (verified, as `install` does); otherwise into the idle copy, leaving
        the targets untouched. A names, shape or dtype mismatch with the targets raises
        `PublicationError`, after the whole publication has been drained from the wire."""
        # Rank wait: blocks until src publishes.
        _, header = recv_payload(src, group)
        problems = self._layout_problems(header)
        if problems:
            self._receive_buckets(header, src, group, None)  # drained: the sender's sends complete
            raise PublicationError(
                f"publication of version {header['version']} from rank {src} does not match this "
                f"receiver's tensors: " + "; ".join(problems), layout=problems)
        if install:
            before = self._before_install(header)
            self._receive_buckets(header, src, group, self.targets, _corrupt_mode())
            return self._verify(header, before)
        if self._idle is None:
            self._idle = {n: torch.empty_like(t) for n, t in self.targets.items()}
        self._receive_buckets(header, src, group, self._idle)
        self._header = header
        return header["version"]

    def install(self) -> int:
        """Copy the staged version into the targets in place and verify them; returns the version.

        Verification checksums the targets *after* the copy and compares with the sender's
        checksums; it also checks that every tensor the sender changed since its previous
        publication changed here. Raises `PublicationError` naming the failing tensors and both
        checksums. Honours the `DIGENRL_DEBUG_CORRUPT_PUBLISH` test hook (module docstring)."""
        if self._header is None:
            raise RuntimeError("install() without a received publication: call receive() first")
        header = self._header
        self._header = None  # a publication is installed at most once
        before = self._before_install(header)
        names = [t[0] for t in header["targets"]]
        corrupt = _corrupt_mode()
        if corrupt in ("1", "flip"):
            _flip_one_bit({n: self._idle[n] for n in names})
        if corrupt != "skip":
            with torch.no_grad():
                for n in names:
                    self.targets[n].copy_(self._idle[n])
        return self._verify(header, before)

    def _before_install(self, header: dict) -> dict[str, int]:
        """Checksums of the live tensors the sender changed since its previous publication, before
        they are overwritten: an install that leaves one as it was did nothing."""
        expected, previous = header["checksums"], header["previous_checksums"] or {}
        changed = [n for n, _, _ in header["targets"] if n in previous and previous[n] != expected[n]]
        return {n: checksum(self.targets[n]) for n in changed}

    def _receive_buckets(self, header: dict, src: int, group, dest: dict[str, Tensor] | None,
                         corrupt: str = "") -> None:
        """Receive every bucket into one buffer and apply each tensor to `dest` once all its wire
        parts are in (a top-k delta's indices and values travel in buckets of different dtypes; the
        first part waits, copied). `dest` None drains the wire. `corrupt`: the test hook."""
        comm = comm_device(group)
        shapes = dict(zip(header["names"], header["shapes"]))
        num_parts: dict[str, int] = {}
        for wire in header["names"]:
            num_parts[wire.partition("|")[0]] = num_parts.get(wire.partition("|")[0], 0) + 1
        pending: dict[str, dict[str, Tensor]] = {}
        for index, bucket in enumerate(header["buckets"]):
            dtype = dtype_from_name(bucket["dtype"])
            flat = self._bucket_buffer(bucket["numel"] * torch.empty((), dtype=dtype).element_size(), comm)
            flat = flat.view(dtype)
            p2p.recv(as_bytes(flat), src, group, "publish.bucket")  # rank wait: one bucket from src
            if dest is None:
                continue
            views, offset = {}, 0
            for wire in bucket["names"]:
                views[wire] = flat[offset:offset + _numel(shapes[wire])].view(shapes[wire])
                offset += _numel(shapes[wire])
            if index == 0 and corrupt in ("1", "flip"):
                _flip_one_bit(views)
            for wire, t in views.items():
                name, _, part = wire.partition("|")
                got = pending.setdefault(name, {})
                got[part] = t
                if len(got) < num_parts[name]:
                    got[part] = t.clone()  # the buffer is reused by the next bucket
                    continue
                del pending[name]
                if corrupt != "skip":
                    self._apply(header["encoding"], name, dest, got)

    def _apply(self, encoding: str, name: str, dest: dict[str, Tensor], parts: dict[str, Tensor]) -> None:
        target = dest[name]
        with torch.no_grad():
            if target is not self.targets[name] and encoding.startswith("delta"):
                target.copy_(self.targets[name])  # a delta applies to the live version, k-1
            compress.apply(encoding, target, parts)

    def _bucket_buffer(self, nbytes: int, device: torch.device) -> Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes]

    def _verify(self, header: dict, before: dict[str, int]) -> int:
        expected = header["checksums"]
        names = [t[0] for t in header["targets"]]
        after = {n: checksum(self.targets[n]) for n in names}
        mismatched = {n: (expected[n], after[n]) for n in names if after[n] != expected[n]}
        unchanged = [n for n in before if after[n] == before[n]]
        if mismatched or unchanged:
            raise PublicationError(_failure_message(header["version"], mismatched, unchanged),
                                   mismatched=mismatched, unchanged=unchanged)
        self.installed_version = header["version"]
        return self.installed_version

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


def _corrupt_mode() -> str:
    corrupt = os.environ.get(CORRUPT_ENV, "").strip().lower()
    if corrupt not in CORRUPT_MODES:
        raise ValueError(f"{CORRUPT_ENV}={corrupt!r}: not one of {CORRUPT_MODES[1:]}")
    return corrupt


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
