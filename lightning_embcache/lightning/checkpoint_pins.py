"""Which checkpoint files refer to which store versions, so versions stay pinned exactly that long.

A Lightning checkpoint holds only a reference to a store version. The version is pinned in the
store when the checkpoint is saved and unpinned once no checkpoint file that refers to it exists.
Removals are seen two ways: `PinningCheckpointIO` sees `ModelCheckpoint`'s removals as they
happen (``strategy.remove_checkpoint``), and every save sweeps for files deleted any other way.

The table of version -> files (`store.pins_registry`) is kept beside the store, in
``<store path>.checkpoints.json``, so a resumed process can release versions pinned by the
process before it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

from lightning_embcache.store.pins_registry import CHECKPOINT_KEY, REGISTRY_SUFFIX, CheckpointPins, registry_path

__all__ = ["CHECKPOINT_KEY", "REGISTRY_SUFFIX", "CheckpointPins", "PinningCheckpointIO", "registry_path"]


class PinningCheckpointIO(_WrappingCheckpointIO):
    """Wraps the strategy's CheckpointIO to learn where each checkpoint file goes and when it is removed."""

    def __init__(
        self,
        checkpoint_io: Any,
        on_saved: Callable[[dict, str], None],
        on_removed: Callable[[str], None],
    ) -> None:
        super().__init__(checkpoint_io)
        self._on_saved = on_saved
        self._on_removed = on_removed

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        assert self.checkpoint_io is not None
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self._on_saved(checkpoint, os.path.abspath(os.fspath(path)))

    def remove_checkpoint(self, path: Any) -> None:
        assert self.checkpoint_io is not None
        self.checkpoint_io.remove_checkpoint(path)
        self._on_removed(os.path.abspath(os.fspath(path)))

    def teardown(self) -> None:
        if self.checkpoint_io is not None:
            self.checkpoint_io.teardown()
