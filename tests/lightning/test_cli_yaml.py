"""LightningCLI configures the callbacks and the module's store options from YAML."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("jsonargparse", reason="jsonargparse[signatures] is in the dev extra")
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from lightning_embcache import DeferredSync, EmbeddingStore, MemoryPressure  # noqa: E402
from lightning_embcache.demo import AutoDecoder  # noqa: E402

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_embcache.DeferredSync
      init_args:
        every_n_steps: 2
        every_n_epochs: null
        on_checkpoint: true
        background: false
    - class_path: lightning_embcache.MemoryPressure
      init_args:
        high: 0.95
        target: 0.9
        check_every_n_steps: 2
        include_workers: false
        cgroup_root: {root}/no-cgroup
model:
  num_samples: 256
  code_dim: 8
  out_dim: 4
  hidden: 16
  store_path: {root}/latents
  hot_bytes: 4096
  batch_size: 32
"""


def test_yaml_configures_callbacks_and_store_options(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path))
    cli = LightningCLI(AutoDecoder, args=["fit", "--config", str(config)], save_config_callback=None)
    sync = next(c for c in cli.trainer.callbacks if isinstance(c, DeferredSync))
    pressure = next(c for c in cli.trainer.callbacks if isinstance(c, MemoryPressure))
    assert (sync.every_n_steps, sync.every_n_epochs, sync.on_checkpoint, sync.background) == (2, None, True, False)
    assert (pressure.high, pressure.target, pressure.check_every_n_steps, pressure.include_workers) == (0.95, 0.9, 2, False)
    assert sync.syncs >= 2 and pressure.last_reading is not None
    assert cli.model.latents.path == tmp_path / "latents" and cli.model.hparams.hot_bytes == 4096
    with EmbeddingStore.open(tmp_path / "latents", readonly=True) as store:
        assert store.num_rows == 256 and store.dim == 8 and store.version >= 2
        assert store.get(torch.arange(4)).abs().sum() > 0


def test_bad_values_from_yaml_fail_with_the_argument_named(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path).replace("every_n_steps: 2", "every_n_steps: 0", 1))
    with pytest.raises(ValueError, match="every_n_steps=0"):
        LightningCLI(AutoDecoder, args=["fit", "--config", str(config)], save_config_callback=None)
