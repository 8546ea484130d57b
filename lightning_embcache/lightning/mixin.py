"""`EmbeddingStoreMixin`: per-sample tables for a LightningModule, checkpointed by version."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_embcache.lightning.arguments import (
    check_choice,
    check_hot_bytes,
    check_optimizer,
    check_unknown_keywords,
    named_options,
)
from lightning_embcache.lightning.auto_lookahead import AutoLookahead
from lightning_embcache.lightning.checkpoint_pins import CHECKPOINT_KEY, CheckpointPins, PinningCheckpointIO
from lightning_embcache.lightning.handle import IF_EXISTS, EmbeddingStoreHandle
from lightning_embcache.lightning.sharded import (
    follow_checkpoint_files,
    gather_shard_refs,
    local_ref,
    shard_handles,
)
from lightning_embcache.optim import make_row_optimizer
from lightning_embcache.optim.clip import check_max_norm
from lightning_embcache.store.errors import InvalidArgumentError
from lightning_embcache.trainable import check_stochastic_rounding, trainable_fields

log = logging.getLogger(__name__)
warning_cache = WarningCache()


class EmbeddingStoreMixin:
    """Gives a LightningModule per-sample tables that live in `EmbeddingStore`s, not in its parameters.

    Put it before ``LightningModule`` in the bases and call :meth:`add_embedding_store` in
    ``__init__``. The store behind each handle opens when training sets up (created if absent),
    is flushed when ``fit`` ends and when a checkpoint is saved, and is closed on teardown and on
    an exception; afterwards the handle reopens it on demand, so rows can be read after ``fit``.

    Example::

        class AutoDecoder(EmbeddingStoreMixin, L.LightningModule):
            def __init__(self):
                super().__init__()
                self.latents = self.add_embedding_store("latents", num_rows=N, dim=64,
                                                        path="runs/latents", hot_bytes=256 << 20)

            def training_step(self, batch, batch_idx):
                ids, x = batch
                z = self.latents.get(ids)          # rows on the module's device
                ...
                self.latents.update(ids, z_new)    # direct write

    Notes:
        - Checkpoints are exact: saving one flushes every store and records
          ``{name: {path, version, manifest_checksum}}`` under ``checkpoint["embedding_stores"]``;
          that version stays pinned while a checkpoint file naming it exists. ``fit(ckpt_path=...)``
          and ``load_from_checkpoint`` reopen each store at its recorded version.
        - The mixin's hooks (``on_save_checkpoint``, ``on_load_checkpoint``, ``configure_callbacks``)
          call ``super()``; if you override them, call ``super()`` too.
        - A store with ``path=None`` lives in memory: fast, but not part of checkpoints.
        - In ``fit``, the training ``DataLoader``'s batch sampler is wrapped in a `LookaheadSampler`
          that announces each coming batch to the disk-mode stores, once the first 2 batches show
          that the loader's indices are the ids the step reads (``announce_upcoming = False``
          turns it off; docs/lightning.md, "Announcing coming rows").
        - A path that already holds a store is read freely (validate, test, predict, ``get``),
          but written only when a checkpoint names one of its versions (``fit(ckpt_path=...)``,
          ``load_from_checkpoint``) or ``if_exists`` says so; otherwise ``fit`` stops before
          the first step, rather than training a fresh model on old rows.

    Raises:
        TypeError: the mixin placed after ``LightningModule`` in the bases (its hooks would never
            run).
        InvalidArgumentError: a store name that is not an identifier or is already used; an
            ``if_exists`` or ``optimizer`` that is not one of the allowed values; ``hot_bytes``
            below one record; a keyword that is neither a store option nor an option of the chosen
            optimizer (also a ``TypeError``). Each message names the allowed values and, for a
            near miss, the argument probably meant (``hot_byte=`` -> ``hot_bytes=``).
    """

    #: announce the rows of the training loader's coming batches to the stores (see
    #: docs/lightning.md, "Announcing coming rows"); set ``self.announce_upcoming = False`` to turn off
    announce_upcoming: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_base_order(cls)

    # ------------------------------------------------------------------ public API
    def add_embedding_store(
        self,
        name: str,
        num_rows: int,
        dim: int,
        *,
        path: str | os.PathLike[str] | None = None,
        hot_bytes: int | None = None,
        warm_bytes: int = 0,
        device_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        chunk_rows: int = 1024,
        compression: str | None = None,
        init: str | Callable[[torch.Tensor], torch.Tensor] = "zeros",
        seed: int = 0,
        init_std: float = 1.0,
        check_finite: bool = True,
        fields: Mapping[str, tuple[torch.dtype, int]] | None = None,
        optimizer: str | None = None,
        lr: float | None = None,
        if_exists: str = "error",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        stochastic_rounding: bool | None = None,
        **optim_kwargs: Any,
    ) -> EmbeddingStoreHandle:
        """Declare a table of `num_rows` x `dim` rows; returns its handle (the store opens at setup).

        Args:
            name: key in ``self.embedding_stores`` and in checkpoints; a Python identifier.
            num_rows, dim: table shape.
            path: store directory; ``None`` keeps the table in memory (not checkpointed).
            hot_bytes: RAM budget of uncompressed rows; ``None`` keeps the whole table resident.
            device_bytes: GPU memory for the device tier of a CUDA module: rows *and* their
                optimizer state live there, `lookup`, the row-wise update and `get`/`update` run on
                the GPU, and only rows missing from it travel from host RAM. ``None`` (default):
                the whole table if it takes at most a quarter of the GPU's memory, else a quarter
                of it. ``0``: no device tier (rows stay in host RAM). Ignored on CPU.
            warm_bytes, dtype, chunk_rows, compression, init, seed, init_std, check_finite, fields:
                passed to ``EmbeddingStore.create`` (``warm_bytes``, ``hot_bytes`` and
                ``check_finite`` also to ``EmbeddingStore.open``).
            optimizer, lr, optim_kwargs: trainable rows through :meth:`EmbeddingStoreHandle.lookup`:
                ``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"`` or ``"adamw"`` with their
                arguments (``momentum``, ``betas``, ``eps``, ``weight_decay``, ...); the moments live
                beside each row in the store. ``max_grad_norm=`` clips each row's summed gradient.
            if_exists: what ``fit`` (or any write) does when `path` already holds a store that this
                handle did not create and that no checkpoint being resumed names: ``"error"``
                (default) stops with a message, ``"resume"`` continues its rows (and moments),
                ``"overwrite"`` deletes it and starts from ``init``. Reads never need it.
            max_norm, norm_type: bound the rows as ``nn.Embedding(max_norm=...)`` does: ``lookup``
                first rescales every looked-up row whose ``norm_type``-norm exceeds ``max_norm``
                (by ``max_norm / (norm + 1e-7)``), in the store, then returns the rows.
            stochastic_rounding: 16-bit rows (``dtype=torch.bfloat16`` or ``float16``) with an
                optimizer: the update is computed in float32 (moments are float32) and written back
                with unbiased stochastic rounding, deterministic in ``(seed, step, id)``. ``None``
                (default): on for 16-bit rows; ``False``: round to nearest; ``True`` on 32-bit
                rows is refused.
        """
        _check_base_order(type(self))
        stores = self._embcache_stores()
        # every argument checked before anything is made: a rejected call leaves no trace
        check_choice("if_exists", if_exists, IF_EXISTS)
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgumentError(f"Invalid value for name={name!r}. Must be a Python identifier")
        if name in stores:
            raise InvalidArgumentError(
                f"Invalid value for name={name!r}. An embedding store of that name already exists "
                f"(names so far: {', '.join(stores)})")
        if device_bytes is not None and (isinstance(device_bytes, bool) or not isinstance(device_bytes, int)
                                         or device_bytes < 0):
            raise InvalidArgumentError(
                f"Invalid value for device_bytes={device_bytes!r}. Must be None or an int >= 0 (bytes)")
        check_optimizer(optimizer)
        check_unknown_keywords(optim_kwargs, optimizer, named_options(EmbeddingStoreMixin.add_embedding_store))
        create_options: dict[str, Any] = dict(
            dtype=dtype, chunk_rows=chunk_rows, hot_bytes=hot_bytes, warm_bytes=warm_bytes,
            compression=compression, init=init, seed=seed, init_std=init_std, check_finite=check_finite,
        )
        row_optimizer = None
        max_grad_norm = optim_kwargs.pop("max_grad_norm", None)
        # checked here, where the mistake is made, not at the first lookup
        max_norm, norm_type = check_max_norm(max_norm, norm_type)
        if isinstance(dtype, torch.dtype):  # (a bad dtype is named by the store)
            check_stochastic_rounding(stochastic_rounding, dtype)
        if optimizer is not None:
            row_optimizer = make_row_optimizer(optimizer, **optim_kwargs, **({} if lr is None else {"lr": lr}))
            # optimizer moments and per-row metadata live beside each row, flushed with it
            fields = {**dict(fields or {}), **trainable_fields(row_optimizer, dim, dtype)}
        check_hot_bytes(hot_bytes, dim, dtype, fields)
        if fields:
            create_options["fields"] = dict(fields)
        open_options: dict[str, Any] = dict(hot_bytes=hot_bytes, warm_bytes=warm_bytes, check_finite=check_finite)
        if callable(init):
            open_options["init"] = init
        handle = EmbeddingStoreHandle(
            name, num_rows, dim,
            path=Path(path).absolute() if path is not None else None,
            create_options=create_options,
            open_options=open_options,
            optim_config=dict(optimizer=optimizer, lr=lr, **optim_kwargs),
            module=self,  # type: ignore[arg-type]
            if_exists=if_exists,
            device_bytes=device_bytes,
        )
        handle._row_optimizer, handle._max_grad_norm = row_optimizer, max_grad_norm
        handle._row_options = dict(max_norm=max_norm, norm_type=norm_type, stochastic_rounding=stochastic_rounding)
        stores[name] = handle
        return handle

    @property
    def embedding_stores(self) -> Mapping[str, EmbeddingStoreHandle]:
        """Handles by name, in the order they were added."""
        return dict(self._embcache_stores())

    # ------------------------------------------------------------------ LightningModule hooks
    def configure_callbacks(self) -> Any:
        callbacks = super().configure_callbacks()  # type: ignore[misc]
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        trainer = getattr(self, "_trainer", None)
        if trainer is not None and any(isinstance(c, _StoreLifecycle) for c in trainer.callbacks):
            # a Trainer used again (validate after fit) keeps its lifecycle callback: returning a new
            # one makes Lightning log that it overrides the old one at every call
            return callbacks
        return [*callbacks, _StoreLifecycle()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        refs: dict[str, dict[str, Any]] = {}
        for name, handle in self._embcache_stores().items():
            if handle.path is None:
                warning_cache.warn(
                    f"Embedding store {name!r} has path=None: it lives in memory and is not part of checkpoints."
                )
                refs[name] = {"path": None, "version": None, "manifest_checksum": None}
                continue
            version = handle.flush()
            store = handle.store
            self._embcache_pins(handle).pin(store, version)
            refs[name] = {"path": str(handle.path), "version": version,
                          "manifest_checksum": store.manifest_checksum(version)}
            if handle.optimizer is not None:
                refs[name]["row_optimizer"] = handle.optimizer.state_dict()
        gather_shard_refs(self, refs)  # several processes: every rank's shard version (a collective)
        checkpoint[CHECKPOINT_KEY] = refs
        self._embcache_install_io()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        stores = self._embcache_stores()
        refs = checkpoint.get(CHECKPOINT_KEY)
        if refs is None:
            if any(h.path is not None for h in stores.values()):
                warning_cache.warn(
                    "The checkpoint names no embedding store versions (saved without EmbeddingStoreMixin, or an "
                    "on_save_checkpoint override skipped super()); stores open at their latest version."
                )
            return
        trainer = getattr(self, "_trainer", None)
        writable = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        for name, ref in refs.items():
            handle = stores.get(name)
            if handle is None:
                warning_cache.warn(f"The checkpoint names embedding store {name!r}, which this module does not add.")
                continue
            if handle.optimizer is not None and "row_optimizer" in ref:
                handle.optimizer.load_state_dict(ref["row_optimizer"])
            if ref.get("version") is None:
                continue
            checkpoint_file = _checkpoint_file(trainer)
            # several processes: this rank's shard (streamed from another world size's shards in fit)
            ref = local_ref(handle, ref, checkpoint_file, fitting=writable)
            moved = handle.path is None or Path(ref["path"]) != handle.path
            if moved:
                warning_cache.warn(
                    f"Embedding store {name!r} was at {ref['path']} when checkpointed and is at {handle.path} now "
                    f"(a moved or copied folder, or another path= than the run that saved "
                    f"{checkpoint_file or 'the checkpoint'}); opening version {ref['version']} there (its manifest "
                    f"checksum is verified)."
                )
            handle._open(readonly=not writable, version=int(ref["version"]), checksum=ref.get("manifest_checksum"),
                         checkpoint=checkpoint_file)
            if moved and writable and handle.path is not None:
                self._embcache_follow_move(handle, Path(ref["path"]), checkpoint_file, int(ref["version"]))

    def _apply_batch_transfer_handler(self, batch: Any, device: torch.device | None = None,
                                      dataloader_idx: int = 0) -> Any:
        """Lightning's batch transfer (``transfer_batch_to_device`` and ``on_after_batch_transfer``,
        the module's or the DataModule's), remembering the host copy of every integer tensor in the
        batch, so that ``get``/``lookup`` of ids that are now on the GPU read the store without a
        device sync. Lightning's internal entry point rather than the public hook: overriding
        ``transfer_batch_to_device`` made Lightning warn on every run with a DataModule, and a
        DataModule's own transfer would have bypassed it."""
        moved = super()._apply_batch_transfer_handler(batch, device, dataloader_idx)  # type: ignore[misc]
        device = device or self.device  # type: ignore[attr-defined]
        host_ids = self.__dict__.setdefault("_embcache_host_ids", {})
        host_ids.clear()
        if device.type != "cpu":
            before, after = _int_tensors(batch), _int_tensors(moved)
            if len(before) == len(after):
                for src, dst in zip(before, after):
                    if src.device.type == "cpu" and dst.device.type != "cpu":
                        host_ids[(dst.data_ptr(), tuple(dst.shape))] = src
        return moved

    def _embcache_host_copy(self, ids: torch.Tensor) -> torch.Tensor | None:
        return self.__dict__.get("_embcache_host_ids", {}).get((ids.data_ptr(), tuple(ids.shape)))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        for handle in self._embcache_stores().values():
            handle._bind(self)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ private
    def _embcache_stores(self) -> dict[str, EmbeddingStoreHandle]:
        # Plain dict in __dict__ (not a Module/Parameter): invisible to .to(), state_dict() and DDP.
        return self.__dict__.setdefault("_embedding_stores", {})

    def _embcache_pins(self, handle: EmbeddingStoreHandle) -> CheckpointPins:
        pins = self.__dict__.setdefault("_embedding_store_pins", {})
        if handle.name not in pins:
            assert handle.path is not None
            pins[handle.name] = CheckpointPins(handle.path)
        return pins[handle.name]

    def _embcache_follow_move(self, handle: EmbeddingStoreHandle, old: Path, checkpoint_file: str | None,
                              version: int) -> None:
        """A store resumed from another path than it was saved at: the checkpoint registry names
        files under the old folder, which the next save's sweep would find missing, unpinning (and
        so reclaiming) the versions of every checkpoint that moved with the store. Follow them."""
        assert handle.path is not None
        pins = self._embcache_pins(handle)
        followed = follow_moved_files(pins.versions, old, handle.path)
        if checkpoint_file is not None and version in pins.versions:
            here = os.path.abspath(checkpoint_file)
            if here not in pins.versions[version]:
                pins.versions[version].append(here)  # the file being resumed pins its version wherever it is
                followed += 1
        if followed:
            pins.save()
            log.info("Embedding store %r moved from %s to %s: %d checkpoint file(s) of its registry followed",
                     handle.name, old, handle.path, followed)

    def _embcache_install_io(self) -> None:
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return
        strategy = trainer.strategy
        follow_checkpoint_files(self, trainer)  # ranks > 0: pins follow the strategy's saves/removals
        io = strategy.checkpoint_io
        if not isinstance(io, PinningCheckpointIO):
            strategy.checkpoint_io = PinningCheckpointIO(io, self._embcache_saved, self._embcache_removed)

    def _embcache_uninstall_io(self, trainer: Any) -> None:
        io = getattr(trainer.strategy, "_checkpoint_io", None)
        if isinstance(io, PinningCheckpointIO):
            trainer.strategy.checkpoint_io = io.checkpoint_io

    def _embcache_saved(self, checkpoint: dict[str, Any], file: str) -> None:
        refs = checkpoint.get(CHECKPOINT_KEY)
        stores = self._embcache_stores()
        if refs is None:
            if any(h.path is not None for h in stores.values()):
                warning_cache.warn(
                    f"Checkpoint {file} names no embedding store versions: an on_save_checkpoint override in "
                    f"{type(self).__name__} does not call super(); resuming from it will not restore the stores."
                )
            return
        for name, ref in refs.items():
            handle = stores.get(name)
            if handle is None or ref.get("version") is None:
                continue
            pins = self._embcache_pins(handle)
            pins.attach(int(ref["version"]), file)
            pins.sweep(handle.store)

    def _embcache_removed(self, file: str) -> None:
        for handle in self._embcache_stores().values():
            if handle.path is None:
                continue
            pins = self._embcache_pins(handle)
            pins.detach(file)
            pins.sweep(handle.store)

    def _embcache_setup(self, stage: str) -> None:
        fitting = stage == TrainerFn.FITTING.value
        shard_handles(self, fitting)  # several processes: each handle's path becomes its rank's shard
        for handle in self._embcache_stores().values():
            handle._in_fit = fitting
            # Rows found at the path with if_exists="error" are opened for reading until a
            # checkpoint (restored after setup) claims them; _embcache_claim_for_fit decides. So are
            # shards of another world size, which only a checkpoint of them can stream to this one.
            deferred = fitting and (handle._needs_claim() or handle._absent_before_claim()
                                    or getattr(handle, "_layout_error", None) is not None)
            handle._ensure_open(writable=fitting and not deferred)
        if fitting:
            self._embcache_install_io()

    def _embcache_claim_for_fit(self) -> None:
        """After any checkpoint is restored: every store writable, or the if_exists error now."""
        for handle in self._embcache_stores().values():
            layout_error = getattr(handle, "_layout_error", None)
            if layout_error is not None:  # no checkpoint streamed its shards
                raise layout_error
            handle._ensure_open(writable=True)

    def _embcache_flush_all(self) -> None:
        for handle in self._embcache_stores().values():
            handle.flush()

    def _embcache_release(self, trainer: Any) -> None:
        self._embcache_uninstall_io(trainer)
        for handle in self._embcache_stores().values():
            handle._in_fit = False
            handle._release()


def _loss_scale(trainer: Any) -> float | None:
    """The GradScaler's current scale under ``precision="16-mixed"`` (None without a scaler).

    Reading it waits for the GPU; the scaler itself does so at every step to skip overflow steps.
    """
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    scale = scaler.get_scale()
    return float(scale) if scale else None


def follow_moved_files(versions: dict[int, list[str]], old: Path, new: Path) -> int:
    """Rewrite registered checkpoint files that are missing under the folder that moved (`old`
    without the end it shares with `new`) to their place under the new one, if they exist there;
    returns how many were rewritten."""
    old_parts, new_parts = Path(os.path.abspath(old)).parts, Path(os.path.abspath(new)).parts
    tail = 0
    while tail < min(len(old_parts), len(new_parts)) - 1 and old_parts[-1 - tail] == new_parts[-1 - tail]:
        tail += 1
    # the folders that moved: what is left of both paths once their common end is taken off
    # (runs/a/latents -> runs/b/latents: runs/a -> runs/b), else the store's parents
    tail = max(tail, 1)
    old_root, new_root = Path(*old_parts[: len(old_parts) - tail]), Path(*new_parts[: len(new_parts) - tail])
    count = 0
    for files in versions.values():
        for i, file in enumerate(files):
            path = Path(file)
            if path.exists() or not path.is_relative_to(old_root):
                continue
            moved = new_root / path.relative_to(old_root)
            if moved.exists() and str(moved) not in files:
                files[i] = str(moved)
                count += 1
    return count


def _checkpoint_file(trainer: Any) -> str | None:
    """The checkpoint file being restored by `trainer` (None: ``load_from_checkpoint`` or unknown)."""
    path = getattr(getattr(trainer, "_checkpoint_connector", None), "_ckpt_path", None)
    return str(path) if path else None


def _check_base_order(cls: type) -> None:
    from lightning.pytorch import LightningModule

    mro = cls.__mro__
    if LightningModule in mro and mro.index(LightningModule) < mro.index(EmbeddingStoreMixin):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        raise TypeError(
            f"{cls.__name__}({bases}): put EmbeddingStoreMixin before LightningModule in the bases, e.g. "
            f"class {cls.__name__}(EmbeddingStoreMixin, L.LightningModule); after it, the mixin's hooks never run "
            "and no row would be opened, trained or checkpointed"
        )


def _int_tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, lambda t: found.append(t) if not t.is_floating_point() else None)
    return found


class _StoreLifecycle(Callback):
    """Opens, flushes and releases the module's stores; added by `EmbeddingStoreMixin.configure_callbacks`.

    A callback rather than module hooks because only callbacks see ``on_exception``, and because a
    module's own ``setup``/``teardown`` overrides rarely call ``super()``.
    """

    def __init__(self) -> None:
        self._stepped: dict[str, int] = {}  # handle -> global step its rows were applied at
        self._lookahead: AutoLookahead | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stepped.clear()  # a Trainer used again may count global steps from 0 again
        if isinstance(pl_module, EmbeddingStoreMixin):
            pl_module._embcache_setup(stage)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(pl_module, EmbeddingStoreMixin) and not trainer.strategy.restore_checkpoint_after_setup:
            pl_module._embcache_claim_for_fit()
        if (isinstance(pl_module, EmbeddingStoreMixin) and pl_module.announce_upcoming and trainer.world_size == 1
                and not trainer.overfit_batches):  # overfit_batches makes Lightning rebuild the loader's sampler
            self._lookahead = AutoLookahead(pl_module)  # before Lightning asks for the training loader
            self._lookahead.install(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(pl_module, EmbeddingStoreMixin):
            pl_module._embcache_claim_for_fit()
            if self._lookahead is not None:
                self._lookahead._start_probe()  # the stores are open now

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._lookahead is not None and self._lookahead.probing:
            self._lookahead.after_batch()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        # Take each micro-batch's gradient rows as soon as they exist (accumulation sums them).
        if isinstance(pl_module, EmbeddingStoreMixin):
            for handle in pl_module._embcache_stores().values():
                if handle._trainable is not None:
                    handle._trainable.collect()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # Automatic optimization: the rows step with the model, at the same global step.
        if isinstance(pl_module, EmbeddingStoreMixin) and getattr(pl_module, "automatic_optimization", True):
            step = trainer.global_step + 1
            scale = _loss_scale(trainer)
            for handle in pl_module._embcache_stores().values():
                rows = handle._trainable
                if rows is not None and self._stepped.get(handle.name) != step:
                    self._stepped[handle.name] = step
                    if scale is None:
                        rows.apply(step)
                    else:  # 16-mixed: the rows' gradients carry the loss scale the scaler unscales
                        rows.apply(step, grad_scale=scale)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if isinstance(pl_module, EmbeddingStoreMixin):
            pl_module._embcache_flush_all()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove_lookahead()
        if isinstance(pl_module, EmbeddingStoreMixin):
            pl_module._embcache_release(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove_lookahead()
        if isinstance(pl_module, EmbeddingStoreMixin):
            pl_module._embcache_release(trainer)

    def _remove_lookahead(self) -> None:
        if self._lookahead is not None:
            self._lookahead.remove()
            self._lookahead = None
