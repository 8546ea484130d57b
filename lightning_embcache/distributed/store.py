"""`ShardedStore`: one table of `num_rows` rows split row-wise over the ranks of a process group.

Each rank keeps the ids it owns (see :mod:`.sharding`) in its own `EmbeddingStore` under
``<path>/rank-RRRRR-of-WWWWW/`` (node-local disk is enough: no rank opens another's directory),
so creation never races and each shard has its own writer lock. Reads and writes take global ids
and exchange ids and rows with their owners (see :mod:`.exchange`): they are collectives, so every
rank makes the same calls. Flushing, versions, pins, budgets and stats are per shard and local,
so a background flush never enters a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_embcache.distributed.ahead import RunAhead
from lightning_embcache.distributed.exchange import Clock, Route, ahead_group, store_group, world
from lightning_embcache.distributed.sharding import (
    GlobalCallableInit,
    GlobalNormalInit,
    RowSharding,
    shard_dir,
    shard_layouts,
)
from lightning_embcache.store import (
    EmbeddingStore,
    InvalidArgumentError,
    InvalidTypeError,
    ReadOnlyError,
    StoreError,
    StoreStats,
    VersionNotFoundError,
)
from lightning_embcache.store.validate import as_ids

RESHARD_HINT = "embcache reshard --checkpoint CKPT --world-size N"
_INVALID = torch.empty(0, dtype=torch.int64)
_STORE_BUDGET = object()  # trainable_rows(device_bytes=...) not given: the store's device_bytes


class ShardedStore:
    """A row-sharded `EmbeddingStore`: global ids in, rows out, each rank storing its own shard.

    Example (every rank runs it; torch.distributed is initialised)::

        store = ShardedStore.open_or_create("runs/latents", num_rows=10_000_000, dim=64, hot_bytes=1 << 30)
        z = store.get(ids)             # rows of any ids, fetched from their owners
        store.update(ids, z - lr * g)  # sent to their owners; of an id written by several ranks
        store.flush()                  # in one call the highest rank wins. flush() is per shard.

    Notes:
        ``get``/``update``/``get_fields``/``update_fields`` and ``grow`` are collectives over a
        Gloo group: every rank calls them in the same order (an empty batch is fine). Everything
        else acts on this rank's shard only. ``num_rows`` is the whole table's (each shard's
        manifest records it, so a grown table reopens at its size). ``version`` is the shard's
        version; a checkpoint records all.

    Raises:
        InvalidArgumentError: invalid ids on any rank (every rank raises); a path holding a
            single-process store or shards of another world size (names the reshard command).
    """

    def __init__(self, path: Path | None, num_rows: int, local: EmbeddingStore, group: object,
                 rank: int, world_size: int, ahead: object | None = None) -> None:
        self.path = path
        self.num_rows = num_rows
        self.local = local
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.sharding = RowSharding(num_rows, world_size)
        self._clock = Clock()
        # called before every exchange: finishes a transfer still in flight (ShardedTrainableRows'
        # gradient rows), so a read never misses an update and collectives stay in order
        self.before_exchange: Callable[[], Any] | None = None
        #: GPU budget of this rank's shard for trainable rows on a GPU (None: automatic, 0: host rows)
        self.device_bytes: int | None = None
        #: the `ShardedDeviceRows` holding this shard's hot rows on the GPU, if any
        self.device_rows: Any = None
        # announced lookups (`prefetch`): their id exchanges run ahead on a group of their own
        self._ahead_group = ahead
        self.ahead = RunAhead(self._exchange_ahead)

    sharded = True  # the handle leaves device tiers to the store (`trainable_rows`): one per shard

    # ------------------------------------------------------------------ construction
    @classmethod
    def open_or_create(cls, path: str | os.PathLike | None, num_rows: int, dim: int, *, version: int | None = None,
                       readonly: bool = False, **create_options: Any) -> ShardedStore:
        """This rank's shard of the table at `path`: opened if it exists, else created.

        ``path=None`` keeps every shard in memory. `create_options` are those of
        `EmbeddingStore.create`; the budgets and ``check_finite`` also apply when opening.
        ``device_bytes`` (also when opening): each shard's GPU budget for trainable rows when the
        ranks train on GPUs (see `trainable_rows`).
        A read-only open of a shard never written gives its initial rows, in memory.
        """
        factory = ShardFactory(int(num_rows), dim, create_options)
        if path is None:
            return factory.create(None, num_rows, dim)
        mine = factory.shard_path(Path(path))
        if (mine / "META").exists():
            return factory.open(mine, version=version, readonly=readonly)
        if version is not None:
            raise VersionNotFoundError(f"{mine}: no shard here, so version {version} cannot be opened")
        if readonly:
            return factory.create(None, num_rows, dim)
        return factory.create(mine, num_rows, dim)

    # ------------------------------------------------------------------ collectives (every rank calls)
    def get(self, ids: Any) -> Tensor:
        """Rows of global `ids` as a new (len(ids), dim) CPU tensor, fetched from their owners."""
        return self.get_fields(ids, ("weight",))["weight"]

    def get_fields(self, ids: Any, names: Sequence[str] = ("weight",)) -> dict[str, Tensor]:
        """Several per-row fields of global `ids` at once."""
        _, _, route = self.route(ids)
        with self._clock:
            if route.served is not None and len(route.served):
                served = self.local.get_fields(route.served, tuple(names))
            else:
                served = {n: torch.empty((0, self.local.field_spec(n)[1]), dtype=self.local.field_spec(n)[0])
                          for n in names}
            out = route.fetch(served)
            self._clock.bytes_sent += route.bytes_sent
        assert isinstance(out, dict)  # a dict of fields in, a dict out
        return out

    def update(self, ids: Any, values: Any) -> None:
        """Write rows of global `ids` at their owners (of duplicates the last wins; across ranks the highest rank)."""
        self.update_fields(ids, {"weight": values})

    def update_fields(self, ids: Any, values: Mapping[str, Any]) -> None:
        """Write several fields of global `ids` at their owners."""
        if self.device_rows is not None and isinstance(values, Mapping) and set(values) - {"weight"}:
            raise InvalidArgumentError(
                f"values names fields {sorted(set(values) - {'weight'})}; while the owners train rows on their GPUs "
                f"only 'weight' can be written directly")
        idx, vals, route = self.route(ids, values, deliver=True)
        with self._clock:
            # of duplicate ids within this call the last one wins, as in EmbeddingStore.update
            last = torch.full((route.num_unique,), -1, dtype=torch.int64)
            last.scatter_reduce_(0, route.inverse, torch.arange(len(idx)), reduce="amax")
            got = route.push({n: v.index_select(0, last) for n, v in vals.items()})
            assert route.served is not None
            if len(route.served):
                self.local.update_fields(route.served, got)
                if self.device_rows is not None:
                    self.device_rows.write_served(route.served, got)
            self._clock.bytes_sent += route.bytes_sent

    def route(self, ids: Any, values: Mapping[str, Any] | None = None, deliver: bool = False,
              unique: bool = False, hook: bool = True, group: object | None = None
              ) -> tuple[Tensor, dict[str, Tensor], Route]:
        """Validate `ids` (and `values`) on this rank, then agree with every rank on who sends what.

        A rank whose arguments are invalid raises its own error; the others raise one naming it.
        Nothing is written anywhere in either case. ``hook=False``: skip `before_exchange` (the
        GPU rows' own lookups, which read the rows where they are).
        """
        if hook and self.before_exchange is not None:
            self.before_exchange()
        error: StoreError | None = None
        idx = torch.empty(0, dtype=torch.int64)
        vals: dict[str, Tensor] = {}
        try:
            idx = torch.from_numpy(as_ids(ids, self.num_rows).copy())
            if values is not None:
                if not isinstance(values, Mapping) or not values:
                    raise InvalidTypeError("values must be a non-empty mapping of field name -> tensor")
                vals = {n: self._check_values(n, v, len(idx)) for n, v in values.items()}
        except StoreError as exc:
            error, idx, vals = exc, torch.empty(0, dtype=torch.int64), {}
        with self._clock:
            try:
                route = Route(self.group if group is None else group, self.sharding, idx,
                              None if error is None else str(error), deliver, unique, size=self.num_rows)
            except InvalidArgumentError:
                if error is not None:
                    raise error from None
                raise
        if values is not None and not vals:
            vals = {n: torch.empty((0, self.local.field_spec(n)[1]), dtype=self.local.field_spec(n)[0])
                    for n in values}
        return idx, vals, route

    def _check_values(self, name: str, v: Any, n: int) -> Tensor:
        from lightning_embcache.store.validate import as_values
        if name not in self.local.field_names:
            raise InvalidArgumentError(f"values names field {name!r}; the store has {list(self.local.field_names)}")
        dtype, cols = self.local.field_spec(name)
        return as_values(v, n, cols, dtype, arg="values" if name == "weight" else f"values[{name!r}]",
                         check_finite=getattr(self.local, "_check_finite", True))

    # ------------------------------------------------------------------ this rank's shard
    dim = property(lambda self: self.local.dim)
    dtype = property(lambda self: self.local.dtype)
    version = property(lambda self: self.local.version, doc="Version of this rank's shard.")
    readonly = property(lambda self: self.local.readonly)
    closed = property(lambda self: self.local.closed)
    field_names = property(lambda self: self.local.field_names)

    @property
    def io_wait_seconds(self) -> float:
        """Seconds in the shard's own I/O plus in exchanges with the other ranks."""
        return self.local.io_wait_seconds + self._clock.seconds

    @property
    def exchanged_bytes(self) -> int:
        """Bytes this rank sent to others (ids, split sizes and rows) since it opened."""
        return self._clock.bytes_sent

    def field_spec(self, name: str) -> tuple[torch.dtype, int]:
        return self.local.field_spec(name)

    def trainable_rows(self, optimizer: Any, *, max_grad_norm: float | None = None,
                       device: torch.device | str | None = None, device_bytes: Any = _STORE_BUDGET,
                       switch_interval: float | None = None, max_norm: float | None = None,
                       norm_type: float = 2.0, stochastic_rounding: bool | None = None) -> Any:
        """Trainable rows over this store (what `TrainableRows` is for one process).

        On a GPU (``device``, or by default this rank's current CUDA device when the training
        group runs NCCL) each owner keeps its shard's hot rows and their optimizer state in a
        `DeviceTier` of ``device_bytes`` (default: the store's ``device_bytes``; None: the whole
        shard up to a quarter of the GPU) and rows travel GPU to GPU (`ShardedDeviceRows`).
        ``device_bytes=0`` or a CPU device: the owners' rows stay in host memory
        (`ShardedTrainableRows`). ``switch_interval``: see `ShardedDeviceRows` (rows on GPUs only).
        ``max_norm``, ``norm_type``, ``stochastic_rounding``: as for `TrainableRows`, applied by
        each row's owner to the rows it serves (in host memory or on its GPU).
        """
        from lightning_embcache.distributed.device_rows import ShardedDeviceRows
        from lightning_embcache.distributed.trainable import ShardedTrainableRows

        budget = self.device_bytes if device_bytes is _STORE_BUDGET else device_bytes
        if device is None and budget != 0 and torch.cuda.is_available() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        if device is not None and torch.device(device).type == "cuda" and budget != 0:
            if self.device_rows is not None:
                self.device_rows.write_down()
                self.device_rows.close()
            return ShardedDeviceRows(self, optimizer, torch.device(device), budget, max_grad_norm=max_grad_norm,
                                     switch_interval=switch_interval, max_norm=max_norm, norm_type=norm_type,
                                     stochastic_rounding=stochastic_rounding)
        if switch_interval is not None:
            raise InvalidArgumentError(
                f"switch_interval={switch_interval!r} applies to rows on the owners' GPUs; these rows stay in host "
                f"memory (device={device!r}, device_bytes={budget!r}): leave it None")
        return ShardedTrainableRows(self, optimizer, max_grad_norm=max_grad_norm, max_norm=max_norm,
                                    norm_type=norm_type, stochastic_rounding=stochastic_rounding)

    def prefetch(self, ids: Any) -> None:
        """Announce a coming lookup of `ids`: its id exchange with the owners runs ahead in a
        background thread (and, with rows on the owners' GPUs, the owners bring the rows up), so
        the lookup of exactly these ids only moves rows; the rows this rank owns are hinted to its
        shard. A collective: every rank announces as many batches, in the same order, and looks
        them up in the same pattern (a `LookaheadSampler` over a ``DistributedSampler`` does).
        A lookup of other ids works as without the announcement.

        Raises:
            InvalidArgumentError: invalid ids (the other ranks' lookups of this batch raise too).
        """
        idx = self.announce(ids)
        mine = idx[self.sharding.owner(idx) == self.rank]
        if len(mine):
            self.local.prefetch(self.sharding.local(mine))

    def announce(self, ids: Any, explicit: bool = False, *, raise_invalid: bool = True) -> Tensor:
        """Queue the exchange of a coming lookup (`prefetch`); returns the validated ids. Invalid
        ids are announced too, so that the other ranks' lookups of this batch fail with them."""
        try:
            idx = torch.from_numpy(as_ids(ids, self.num_rows).copy())
        except StoreError as exc:
            try:
                raw = torch.as_tensor(ids).detach().to("cpu", torch.int64).reshape(-1)
            except Exception:
                raw = _INVALID
            self.ahead.announce(raw, explicit, error=str(exc))
            if raise_invalid:
                raise
            return _INVALID
        self.ahead.announce(idx, explicit)
        return idx

    def _exchange_ahead(self, idx: Tensor, error: str | None = None) -> Route:
        """The announced lookup's id exchange (`RunAhead`'s exchange thread)."""
        return Route(self._ahead_group or self.group, self.sharding, idx, error)

    def take_ahead(self, ids: Tensor) -> Route | None:
        """The route of an announced lookup of exactly `ids` (validated), exchanged ahead; or None."""
        return self.ahead.take(ids)

    def flush(self) -> int:
        """Make this shard's updates durable; returns its version (each rank flushes its own)."""
        if self.device_rows is not None:
            self.device_rows.write_down()  # the GPU's newer rows first
        return self.local.flush()

    @property
    def unflushed_share(self) -> float:
        """This shard's `EmbeddingStore.unflushed_share`."""
        return self.local.unflushed_share

    def stats(self) -> StoreStats:
        """This shard's `StoreStats` (``io_wait_seconds`` includes the exchanges)."""
        s = self.local.stats()
        s.io_wait_seconds += self._clock.seconds
        return s

    # per-shard operations, as on an EmbeddingStore
    def pin(self, version: int) -> None:
        self.local.pin(version)

    def unpin(self, version: int) -> None:
        self.local.unpin(version)

    def pinned(self) -> list[int]:
        return self.local.pinned()

    def versions(self) -> list[int]:
        return self.local.versions()

    def manifest_checksum(self, version: int) -> str:
        return self.local.manifest_checksum(version)

    def evict(self, nbytes: int) -> int:
        return self.local.evict(nbytes)

    def set_budget(self, hot_bytes: int | None = None, warm_bytes: int | None = None) -> None:
        self.local.set_budget(hot_bytes=hot_bytes, warm_bytes=warm_bytes)

    def compact(self) -> None:
        self.local.compact()

    def grow(self, num_rows: int) -> None:
        """Raise the table to ``num_rows`` rows. A collective: every rank calls it with the same
        ``num_rows``. Each owner grows its shard by the ids it owns under ``id % world_size`` (no
        old id moves); the new rows hold their initial values, exactly those of a table created
        at that size. Durable with each shard's next flush, whose manifest records the table's
        size: a version (or checkpoint) from before the growth reopens the old size. ``num_rows``
        equal to the current size does nothing.

        Raises (on every rank, nothing changed anywhere):
            InvalidTypeError: ``num_rows`` is not an int.
            InvalidArgumentError: fewer rows than now, past the id limit, ranks passing different
                values.
            ReadOnlyError: a shard open read-only (names the rank).
            StoreError: a shard closed; growing a shard failed (the table keeps its size).

        Rows trained on the owners' GPUs (`trainable_rows` on CUDA) are written down into the
        shards and their GPU memory released first: call `trainable_rows` again after the growth
        (the Lightning handle does).
        """
        if self.before_exchange is not None:
            self.before_exchange()  # gradient rows in flight reach their owners first
        asked = int(num_rows) if isinstance(num_rows, (int, np.integer)) and not isinstance(num_rows, bool) \
            else repr(num_rows)
        error: StoreError | None = None
        try:
            target = self._grow_target(num_rows)
        except StoreError as exc:
            error, target = exc, 0
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (asked, None if error is None else str(error), self.num_rows), group=self.group)
        refused = {r: e[1] for r, e in enumerate(every) if e[1] is not None}
        if refused:
            if error is not None:
                raise error
            raise InvalidArgumentError(
                f"grow(num_rows={num_rows!r}) was refused by rank(s) {sorted(refused)} "
                f"({'; '.join(f'rank {r}: {m}' for r, m in refused.items())}); nothing changed on any rank")
        values = {r: e[0] for r, e in enumerate(every)}
        if len(set(values.values())) > 1:
            raise InvalidArgumentError(
                f"num_rows must be the same on every rank (grow is a collective); got {values} (by rank). "
                f"The table keeps its {self.num_rows} rows on every rank")
        n = int(values[self.rank])
        if all(e[2] == n for e in every):  # every rank sees this size already (some may: a growth
            return                         # that only some shards had flushed is completed here)
        if self.device_rows is not None:
            # The owners' GPU rows went down (before_exchange, above); their tier is sized by the
            # shard: released here, made again at the new size by the next trainable_rows().
            self.device_rows.close()
            self.device_rows = self.before_exchange = None
        failed: str | None = None
        try:
            if target > self.local.num_rows:
                self.local.grow(target)
        except Exception as exc:  # a shard that could not grow keeps its size (growth.py)
            failed = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        every = [None] * self.world_size
        dist.all_gather_object(every, failed, group=self.group)
        if any(e is not None for e in every):
            # A shard that did grow holds rows past its share, which no id reaches until a growth
            # that gives them ids (their initial values, as they were never written). One that
            # failed was reopened at its last flush's size record: the table's is this one's.
            if not self.local.closed:
                self.local._versions.table_rows = self.num_rows
            raise StoreError(
                f"grow(num_rows={n}) failed: {'; '.join(e for e in every if e is not None)}. The table keeps its "
                f"{self.num_rows} rows on every rank")
        self.local._versions.table_rows = n  # the next flush's manifest records the table's size
        self.num_rows, self.sharding = n, RowSharding(n, self.world_size)

    def _grow_target(self, num_rows: Any) -> int:
        """This shard's rows at ``num_rows`` (validated on this rank; nothing changed)."""
        from lightning_embcache.store.growth import check_rows
        from lightning_embcache.store.validate import MAX_ROWS

        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
            raise InvalidTypeError(f"num_rows must be an int; got {type(num_rows).__name__} {num_rows!r}")
        n = int(num_rows)
        if n < self.num_rows:
            raise InvalidArgumentError(
                f"num_rows must be in [{self.num_rows}, {MAX_ROWS}]; got {n}: the table has {self.num_rows} rows "
                f"and a store grows, it never shrinks (ids are never taken back)")
        if n > MAX_ROWS:
            raise InvalidArgumentError(f"num_rows must be in [{self.num_rows}, {MAX_ROWS}] (the id limit); got {n}")
        if self.local.closed:
            raise StoreError(f"grow(num_rows={n}): rank {self.rank}'s shard is closed")
        if self.local.readonly:
            raise ReadOnlyError(
                f"grow(num_rows={n}): rank {self.rank}'s shard is open read-only; open the table writable to grow it")
        target = max(RowSharding(n, self.world_size).shard_rows(self.rank), 1)
        if target > self.local.num_rows:
            check_rows(self.local, target)  # e.g. init="normal" of a store made by version 0.1
        return target

    def close(self) -> None:
        self.ahead.close()
        if self.device_rows is not None:
            self.device_rows.close()
            self.device_rows = None
        self.local.close()

    def __repr__(self) -> str:
        return (f"ShardedStore(path={str(self.path) if self.path else None!r}, num_rows={self.num_rows}, "
                f"rank={self.rank}, world_size={self.world_size}, shard={self.local!r})")


class ShardFactory:
    """Makes this rank's `ShardedStore` where the handle would make an `EmbeddingStore`.

    Used in place of the `EmbeddingStore` class by an `EmbeddingStoreHandle` whose path was
    switched to this rank's shard directory: ``create(path, num_rows, dim, **options)`` and
    ``open(path, version=..., readonly=..., **options)`` take the shard's directory (or None) and
    the table's global `num_rows`.
    """

    def __init__(self, num_rows: int, dim: int, create_options: Mapping[str, Any]) -> None:
        self.rank, self.world_size = world()
        self.group = store_group()
        self.ahead_group = ahead_group()
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.sharding = RowSharding(self.num_rows, self.world_size)
        opts = dict(create_options)
        init = opts.pop("init", "zeros")
        if init == "normal":
            init = GlobalNormalInit(self.sharding, self.rank, dim, int(opts.get("seed", 0)),
                                    float(opts.get("init_std", 1.0)))
        elif callable(init):
            init = GlobalCallableInit(init, self.sharding, self.rank)
        self.init, self.options = init, opts
        self.device_bytes: int | None = opts.pop("device_bytes", None)  # the shard's GPU budget
        # a store needs one row; a rank >= num_rows owns none and is never asked for it
        self.local_rows = max(self.sharding.shard_rows(self.rank), 1)

    def shard_path(self, table_path: Path) -> Path:
        """This rank's directory under `table_path`, after refusing a layout it cannot use."""
        _check_layout(Path(table_path), self.world_size)
        return shard_dir(Path(table_path), self.rank, self.world_size)

    def resize(self, num_rows: int) -> None:
        """Make and open shards of a table of ``num_rows`` rows (a checkpoint's record of its size)."""
        self.num_rows = int(num_rows)
        self.sharding = RowSharding(self.num_rows, self.world_size)
        self.local_rows = max(self.sharding.shard_rows(self.rank), 1)

    def create(self, path: Path | None, num_rows: int, dim: int, **_: Any) -> ShardedStore:
        local = EmbeddingStore.create(path, self.local_rows, dim, init=self.init, **self.options)
        local._versions.table_rows = self.num_rows  # recorded by its flushes: a reopen knows the table's size
        return self._wrap(path, local)

    def open(self, path: Path, version: int | None = None, readonly: bool = False, **_: Any) -> ShardedStore:
        local = EmbeddingStore.open(
            path, version=version, readonly=readonly, hot_bytes=self.options.get("hot_bytes"),
            warm_bytes=self.options.get("warm_bytes", 0), check_finite=self.options.get("check_finite", True),
            init=self.init if callable(self.init) else None,
        )
        return self._wrap(path, local)

    def _wrap(self, path: Path | None, local: EmbeddingStore) -> ShardedStore:
        table = None if path is None else Path(path).parent
        # The table's size at the shard's version, as its manifest records it (a grown table's
        # differs from the size declared); shards flushed before sizes were recorded: as declared.
        num_rows = local._versions.table_rows or self.num_rows
        if local.num_rows < max(RowSharding(num_rows, self.world_size).shard_rows(self.rank), 1):
            local.close()
            raise InvalidArgumentError(
                f"{path}: this shard holds {local.num_rows} rows, fewer than rank {self.rank}'s share of a table of "
                f"num_rows={num_rows} over {self.world_size} ranks; open it with the num_rows it was made with")
        if not local.readonly:
            local._versions.table_rows = num_rows
        store = ShardedStore(table, num_rows, local, self.group, self.rank, self.world_size, self.ahead_group)
        store.device_bytes = self.device_bytes
        return store


def _check_layout(root: Path, world_size: int) -> None:
    """Refuse a path laid out for another world size, or holding a single-process store."""
    if (root / "META").exists():
        raise InvalidArgumentError(
            f"path={str(root)!r} holds a single-process store, but {world_size} processes run: each rank keeps its "
            f"shard in {root}/rank-RRRRR-of-{world_size:05d}/. Reshard it ({RESHARD_HINT}) or give a new path"
        )
    others = shard_layouts(root) - {world_size}
    if others and world_size not in shard_layouts(root):
        raise InvalidArgumentError(
            f"path={str(root)!r} holds shards for world_size={sorted(others)}, but {world_size} process(es) run. "
            f"Reshard them ({RESHARD_HINT}) or run with world_size={sorted(others)[0]}"
        )
