"""Moving ids and rows between the ranks of a sharded table with `torch.distributed` all-to-all.

Transport: ``all_to_all_single`` with per-rank split sizes on a dedicated **Gloo** group of host
tensors. (When the owners keep their rows on their GPUs, `ShardedDeviceRows` routes the ids
here and moves the rows themselves GPU to GPU over NCCL.) With host rows, the rows live in host
stores at both ends (the owner
reads and writes them in its `EmbeddingStore`), so an NCCL exchange would add a host->device copy
before and a device->host copy after every transfer, and would put variable-size transfers on
the training stream; the requester copies the rows it receives to its device once, as a
single-process store does. Gloo's ``all_to_all_single`` takes uneven splits (tested in
``tests/distributed``), so no send/recv pairs are needed. A separate group keeps the store's
collectives out of the order of DDP's gradient buckets and of the profiler's reduction.

A read costs three collectives, a write two (the ids travel with the rows), each O(batch) and
never O(table):

1. split sizes (``world_size`` x 3 int64: how many unique ids go to each owner, an ok flag,
   so one rank's invalid ids fail every rank with a clear error instead of leaving the others
   waiting inside a collective, and the table's size as the rank sees it, so ranks that disagree
   on it, after a growth some shards flushed and others did not, fail together too);
2. the unique ids, grouped by owner;
3. the payload (rows going back for a read; rows going to the owners for a write or gradient),
   packed as bytes so several fields of different dtypes travel in one transfer.

Every rank must make the same sequence of store calls (as DDP already requires of forward and
backward); a rank with nothing to ask still takes part with an empty batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_embcache.distributed.sharding import RowSharding
from lightning_embcache.store.errors import InvalidArgumentError

_groups: dict[tuple[int, int, str], object] = {}


def world() -> tuple[int, int]:
    """(rank, world_size) of the default process group; (0, 1) outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharding_active() -> bool:
    """True when torch.distributed runs several processes: stores are then row-sharded."""
    return world()[1] > 1


def store_group() -> object:
    """The Gloo group the stores exchange rows on (made once per default group: a collective, so
    every rank reaches it at the same point, i.e. when the stores open at setup)."""
    return _gloo_group("store")


def ahead_group() -> object:
    """The Gloo group of the exchanges run ahead of their lookups (`RunAhead`'s thread alone uses
    it, so they keep their order whatever the training thread exchanges meanwhile). Made with
    `store_group`, at the same point on every rank."""
    return _gloo_group("ahead")


def _gloo_group(use: str) -> object:
    key = (id(dist.group.WORLD), dist.get_world_size(), use)
    group = _groups.get(key)
    if group is None:
        group = _groups[key] = dist.new_group(backend="gloo")
    return group


class Route:
    """Where the unique ids of one batch go, and which local rows this rank serves in return.

    A route that only delivers rows to their owners (``deliver=True``: writes, gradient rows)
    sends the ids with the rows in :meth:`push`, one collective fewer.

    Attributes:
        served: local row ids this rank is asked for (or receives rows for), grouped by the
            sending rank in rank order; for ``deliver=True`` known after :meth:`push`.
        bytes_sent: bytes this rank sent to other ranks for the route so far (split sizes, ids,
            rows; what stays on this rank is not counted), for the benchmarks.
    """

    def __init__(self, group: Any, sharding: RowSharding, ids: Tensor, error: str | None = None,
                 deliver: bool = False, unique: bool = False, size: int | None = None) -> None:
        """``size``: the table's rows as this rank sees them, checked against every rank's (None: not checked)."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.world_size = group, world_size
        if error is None:
            if unique:  # already unique and ascending (coalesced gradient rows)
                uniq, self.inverse = ids, torch.arange(len(ids))
            else:
                uniq, self.inverse = torch.unique(ids, sorted=True, return_inverse=True)
            owner = sharding.owner(uniq)
            self.order = torch.argsort(owner, stable=True)
            send_ids = uniq.index_select(0, self.order)
            counts = torch.bincount(owner, minlength=world_size)
        else:
            uniq = send_ids = torch.empty(0, dtype=torch.int64)
            self.inverse = self.order = uniq
            counts = torch.zeros(world_size, dtype=torch.int64)
        self.num_unique = int(uniq.numel())
        header = torch.stack([counts, torch.full_like(counts, 0 if error is None else 1),
                              torch.full_like(counts, -1 if size is None else int(size))], dim=1)
        got = torch.empty_like(header)
        dist.all_to_all_single(got, header, group=group)
        bad = torch.nonzero(got[:, 1]).flatten().tolist()
        if bad:
            if error is not None:
                raise InvalidArgumentError(error)
            raise InvalidArgumentError(
                f"rank(s) {bad} passed invalid ids to a sharded embedding store (see that rank's error); "
                f"rank {rank} stops with them"
            )
        sizes = {r: s for r, s in enumerate(got[:, 2].tolist()) if s >= 0}
        if len(set(sizes.values())) > 1:
            raise InvalidArgumentError(
                f"the ranks see a sharded table of different sizes (rows by rank: {sizes}): its shards were "
                f"reopened at versions from before and after a growth (one flushed grow() before a crash, "
                f"another did not). Nothing was read or written. Call grow(num_rows={max(sizes.values())}) "
                f"on every rank to complete it, or resume a checkpoint"
            )
        self.send_splits = counts.tolist()
        self.recv_splits = got[:, 0].tolist()
        self.sharding = sharding
        # rows this rank sends to others when it pushes, and when it serves others' requests
        self._out_push = sum(self.send_splits) - self.send_splits[rank]
        self._out_serve = sum(self.recv_splits) - self.recv_splits[rank]
        self.bytes_sent = (world_size - 1) * 24
        self.served: Tensor | None = None
        #: per batch position, the row of the rows' exchange output holding its id, and the
        #: distinct ids of `served` (computed ahead by the exchange thread for lookups of rows on
        #: GPUs, off the upload and training threads; None: computed where needed)
        self.positions: Any = None
        self.served_unique: Any = None
        self._send_ids = send_ids
        if not deliver:
            recv = torch.empty(sum(self.recv_splits), dtype=torch.int64)
            dist.all_to_all_single(recv, send_ids, self.recv_splits, self.send_splits, group=group)
            self.served = sharding.local(recv)
            self.bytes_sent += self._out_push * 8

    def fetch(self, served_rows: Tensor | Mapping[str, Tensor]) -> Tensor | dict[str, Tensor]:
        """Send the rows this rank serves back to their requesters; returns one row per requested id."""
        packed, unpack = _pack(served_rows)
        out = torch.empty((self.num_unique, packed.shape[1]), dtype=torch.uint8)
        dist.all_to_all_single(out, packed, self.send_splits, self.recv_splits, group=self.group)
        self.bytes_sent += self._out_serve * packed.shape[1]
        rows = torch.empty_like(out)
        rows[self.order] = out
        return unpack(rows.index_select(0, self.inverse))

    def push(self, unique_rows: Tensor | Mapping[str, Tensor], wait: bool = True) -> Any:
        """Send one row per unique requested id (ascending id order) to its owner; returns the rows
        this rank receives, aligned with :attr:`served`. ``wait=False`` returns at once with a
        function that waits for the transfer and returns them (the transfer overlaps what follows)."""
        packed, unpack = _pack(unique_rows)
        packed = packed.index_select(0, self.order)
        with_ids = self.served is None
        if with_ids:  # the ids travel in the same transfer, 8 bytes in front of each row
            packed = torch.cat([self._send_ids.view(torch.uint8).reshape(-1, 8), packed], dim=1)
        out = torch.empty((sum(self.recv_splits), packed.shape[1]), dtype=torch.uint8)
        work = dist.all_to_all_single(out, packed, self.recv_splits, self.send_splits, group=self.group,
                                      async_op=not wait)
        self.bytes_sent += self._out_push * packed.shape[1]

        def received() -> Any:
            if work is not None:
                work.wait()
            got = out
            if with_ids:
                self.served = self.sharding.local(got[:, :8].reshape(-1).view(torch.int64))
                got = got[:, 8:]
            self._keep = None
            return unpack(got)

        self._keep = packed  # alive until the transfer is done
        return received() if wait else received


def _pack(rows: Tensor | Mapping[str, Tensor]):
    """Rows (or several per-row fields) as one (n, bytes) uint8 tensor, and the inverse."""
    if isinstance(rows, Tensor):
        t = rows.contiguous()
        cols, dtype = t.shape[1], t.dtype
        width = cols * t.element_size()
        if t.numel():
            packed = t.view(torch.uint8).reshape(t.shape[0], width)
        else:
            packed = torch.empty((t.shape[0], width), dtype=torch.uint8)

        def unpack_one(b: Tensor) -> Tensor:
            if not b.numel():  # an empty slice may keep strides that no dtype view accepts
                return torch.empty((b.shape[0], cols), dtype=dtype)
            return b.contiguous().view(dtype).reshape(b.shape[0], cols)

        return packed, unpack_one
    names = list(rows)
    parts = [_pack(rows[n]) for n in names]
    widths = [p[0].shape[1] for p in parts]
    packed = torch.cat([p[0] for p in parts], dim=1) if parts else torch.empty(0, 0, dtype=torch.uint8)

    def unpack(b: Tensor) -> dict[str, Tensor]:
        out, at = {}, 0
        for name, (_, un), w in zip(names, parts, widths):
            out[name] = un(b[:, at : at + w])
            at += w
        return out

    return packed, unpack


class Clock:
    """Seconds the training thread spent in exchanges (added to the store's io_wait_seconds for the
    profiler). Exchanges run ahead by a background thread (`RunAhead`, for announced lookups) are
    overlapped with training, so only the thread that made the clock counts."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes_sent = 0
        self._owner = threading.get_ident()
        self._t0 = 0.0

    def __enter__(self) -> Clock:
        if threading.get_ident() == self._owner:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.get_ident() == self._owner:
            self.seconds += time.perf_counter() - self._t0
