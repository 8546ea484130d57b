"""ResumableLoader: a DataLoader whose place in the epoch Lightning saves, for exact mid-epoch resume."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_embcache.store.errors import InvalidArgumentError, InvalidTypeError

# indices turned into Python ints this many at a time (a whole epoch of ints is ~36 bytes each)
_SLICE = 1 << 16


class EpochOrder(Sampler[int]):
    """Every index once per epoch, shuffled in an order fixed by ``(seed, epoch)``, from a position.

    Holds one epoch's order as a compact integer array (4 bytes per sample below 2**31 samples),
    not as Python ints; a resumed epoch starts at its position without reading what came before.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int, sampler: Any = None) -> None:
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.sampler = sampler  # the user's own (deterministic for an epoch), else None
        self.epoch = 0
        self.start = 0  # indices of this epoch to leave out at the next iteration (a resume)

    def __len__(self) -> int:
        return len(self.sampler) if self.sampler is not None else self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        if self.sampler is not None:
            return itertools.islice(iter(self.sampler), start, None)
        if self.shuffle:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.epoch & 0xFFFFFFFF])
            small = self.num_samples < 2**31
            order: np.ndarray = rng.permutation(self.num_samples).astype(np.int32 if small else np.int64)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        return itertools.chain.from_iterable(
            order[i : i + _SLICE].tolist() for i in range(start, self.num_samples, _SLICE))


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that resumes in the middle of an epoch exactly where a checkpoint left it.

    Lightning saves the state of a training loader that has ``state_dict``/``load_state_dict`` in
    every checkpoint and restores it on ``fit(ckpt_path=...)``. This one saves the epoch and the
    batches it delivered, and its shuffle depends only on ``(seed, epoch)``, so a resumed run
    reads the rest of the interrupted epoch in the same order, skipping the batches already
    trained without loading them: with `EmbeddingStoreMixin`'s checkpoints, rows and parameters
    after a kill and a resume equal those of an uninterrupted run, bit for bit.

    Example::

        loader = ResumableLoader(MyDataset(), batch_size=512, shuffle=True, seed=0, num_workers=4)
        trainer.fit(model, loader, ckpt_path="runs/checkpoints/last.ckpt")

    Notes:
        * A plain shuffled ``DataLoader`` restarts the interrupted epoch from its beginning on a
          resume (Lightning warns), so some samples are trained twice in that epoch and others
          not at all: the rows then differ from an uninterrupted run.
        * ``sampler=``: your own sampler instead of ``shuffle``; it must give the same order for
          the same epoch (seed it and give it ``set_epoch``). Skipping then iterates over the
          indices already trained.
        * The dataset must return the same sample for the same index (random augmentation in
          workers is not replayed). One process: under DDP use torchdata's
          ``StatefulDataLoader`` with a ``DistributedSampler``.
        * Everything else (``num_workers``, ``persistent_workers``, ``collate_fn``, ...) is the
          ``DataLoader``'s; the mixin announces its batches to the stores as for a ``DataLoader``.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size, drop_last: as for ``DataLoader``.
        shuffle: a new order every epoch, fixed by ``(seed, epoch)``.
        seed: the base of every epoch's order.
        sampler: a sampler to use instead of ``shuffle`` (see Notes).
        **kwargs: any other ``DataLoader`` argument except ``batch_sampler``.

    Raises:
        InvalidTypeError: an iterable-style dataset.
        InvalidArgumentError: ``batch_sampler=``, ``sampler=`` together with ``shuffle=True``, a
            ``batch_size`` below 1, or a state that is not one this loader saved.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 sampler: Any = None, drop_last: bool = False, **kwargs: Any) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise InvalidTypeError(
                f"ResumableLoader needs a map-style dataset with __len__; got {type(dataset).__name__}"
            )
        if "batch_sampler" in kwargs:
            raise InvalidArgumentError(
                "ResumableLoader makes its own batches: pass batch_size= (and sampler= for "
                "your own order), not batch_sampler="
            )
        if sampler is not None and shuffle:
            raise InvalidArgumentError(
                "Invalid value for shuffle=True with sampler=...: the sampler decides the order; pass one or the other"
            )
        if type(batch_size) is not int or batch_size < 1:
            raise InvalidArgumentError(f"Invalid value for batch_size={batch_size!r}. Must be an int >= 1")
        order = sampler if isinstance(sampler, EpochOrder) else EpochOrder(len(dataset), shuffle, seed, sampler)
        super().__init__(dataset, batch_size=batch_size, sampler=order, drop_last=drop_last, **kwargs)
        self._delivered = 0  # batches of this epoch handed out so far
        self._resume: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        order: EpochOrder = self.sampler  # type: ignore[assignment]
        resume, self._resume = self._resume, None
        skip = 0
        if resume is not None:
            # Lightning asks a restored loader for its iterator before it sets the epoch again, and
            # workers draw indices at once: the order must be the saved epoch's already
            if resume["batches"] >= len(self):  # saved at the epoch's last batch: the next one starts
                order.set_epoch(resume["epoch"] + 1)
            else:
                order.set_epoch(resume["epoch"])
                skip = resume["batches"]
        order.start = skip * self.batch_size  # type: ignore[operator]
        self._delivered = skip
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches of it delivered so far (Lightning saves this in checkpoints)."""
        return {"epoch": self.sampler.epoch, "batches": self._delivered}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration of epoch ``state["epoch"]`` starts after its first ``state["batches"]`` batches."""
        if not isinstance(state, dict) or not all(
            type(state.get(k)) is int and state[k] >= 0 for k in ("epoch", "batches")
        ):
            raise InvalidArgumentError(
                f"state must be {{'epoch': int >= 0, 'batches': int >= 0}} as saved by "
                f"ResumableLoader.state_dict(); got {state!r}"
            )
        self._resume = {"epoch": state["epoch"], "batches": state["batches"]}
