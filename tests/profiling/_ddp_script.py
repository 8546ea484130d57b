"""A real 2-process DDP fit on CPU (Gloo) with a straggler: rank 1's forward costs 25 ms more.

Run as `python _ddp_script.py OUT.json [ACCELERATOR STRATEGY]` (default `cpu ddp`: Gloo; `cuda ddp`
is NCCL, `cuda fsdp` FSDP); Lightning's launcher starts rank 1 by re-running this script. Rank 0
writes the profiler's summary and its logged metrics to OUT.json.
"""

import json
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
from _profiling_helpers import MS, BatchDataset, Cost, CostModel, loader  # noqa: E402

from lightning_embcache import StepProfiler  # noqa: E402


class Straggler(CostModel):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(25 * MS)
        return super().training_step(batch, batch_idx)


def main(out: str, accelerator: str = "cpu", strategy: str = "ddp") -> None:
    cost = Cost()
    logger = mock.Mock()
    logger.save_dir = logger.log_dir = os.path.dirname(out)
    profiler = StepProfiler(log_every_n_steps=4, report=True)
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_epochs=2, logger=logger,
                        callbacks=[profiler], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    # 16 batches -> 8 per rank per epoch (DistributedSampler over whole-batch items)
    trainer.fit(Straggler(cost, 2 * MS, 1 * MS, 1 * MS), loader(BatchDataset(16, cost, 2 * MS)))
    if trainer.global_rank == 0:
        logged = [c.kwargs["metrics"] for c in logger.log_metrics.call_args_list
                  if any(k.startswith("profile/") for k in c.kwargs["metrics"])]
        with open(out, "w") as f:
            json.dump({"summary": profiler.summary(), "logged": logged}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
