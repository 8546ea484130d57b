"""Two epochs of a real Trainer.fit with a memory-mode store (1M x 64, 244 MiB) and fork
DataLoader workers (num_workers=2, not persistent: forked again each epoch, after the table was
populated): epoch wall times, and the machine's anonymous memory (AnonPages) at its peak during
epoch 2 over its value before the fit. Run: python fork_workers_epochs.py [rows] [epochs]"""
import os, sys, time, threading, tempfile
import torch, lightning as L
from torch.utils.data import DataLoader, Dataset
from lightning_embcache import EmbeddingStoreMixin

torch.set_num_threads(1)
ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
DIM, BATCH = 64, 4096


def anon_mib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonPages:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Batches(Dataset):
    def __init__(self):
        self.perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return ROWS // BATCH

    def __getitem__(self, i):
        ids = self.perm[i * BATCH : (i + 1) * BATCH]
        return ids, torch.sin(ids.float()[:, None] * torch.linspace(0.001, 0.01, 8))


class M(EmbeddingStoreMixin, L.LightningModule):
    def __init__(self, path):
        super().__init__()
        self.automatic_optimization = False
        self.z = self.add_embedding_store("z", ROWS, DIM, path=path, hot_bytes=None)
        self.dec = torch.nn.Linear(DIM, 8)

    def training_step(self, batch, i):
        ids, y = batch
        z = self.z.get(ids).requires_grad_()
        loss = torch.nn.functional.mse_loss(self.dec(z), y)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        with torch.no_grad():
            self.z.update(ids, z - 0.1 * z.grad)

    def configure_optimizers(self):
        return torch.optim.SGD(self.dec.parameters(), lr=0.1)


class Clock(L.Callback):
    def __init__(self):
        self.times, self.peak, self.base, self._stop = [], 0.0, anon_mib(), False

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if i == 0:
            self.first = time.perf_counter() - self.t0

    def on_train_epoch_end(self, trainer, pl_module):
        self.times.append((round(time.perf_counter() - self.t0, 2), round(self.first, 2)))

    def watch(self):
        while not self._stop:
            self.peak = max(self.peak, anon_mib())
            time.sleep(0.02)


with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
    clock = Clock()
    t = threading.Thread(target=clock.watch, daemon=True)
    t.start()
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    loader = DataLoader(Batches(), batch_size=None, num_workers=2, persistent_workers=False,
                        multiprocessing_context="fork")
    trainer.fit(M(os.path.join(d, "z")), loader)
    clock._stop = True
    t.join()
    print("epochs_s (total, to first batch)", clock.times, "anon_peak_over_start_mib", round(clock.peak - clock.base))
