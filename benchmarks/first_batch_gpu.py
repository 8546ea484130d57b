"""Time to the first trained batch on a GPU: rows in host RAM trained in place, against
``nn.Embedding(sparse=True)`` + ``SparseAdam`` created on the GPU (one run per call; a diagnosis).

    python -m benchmarks.first_batch_gpu {store,anchor} ROWS
"""
import sys
import time

import torch

kind, rows = sys.argv[1], int(sys.argv[2])
D, B = 128, 4096
torch.manual_seed(0)
t0 = time.perf_counter()
if kind == "anchor":
    emb = torch.nn.Embedding(rows, D, sparse=True, device="cuda")
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    def step(ids):
        z = emb(ids.cuda())
        (z * z).sum().backward()
        opt.step()
        opt.zero_grad()
else:
    from lightning_embcache import EmbeddingStore, TrainableRows, make_row_optimizer, trainable_fields
    from lightning_embcache.host_mapped_tier import HostMappedTier
    ro = make_row_optimizer("adam", lr=1e-2)
    store = EmbeddingStore.create(None, rows, D, init="normal", fields=trainable_fields(ro, D, torch.float32))
    t1 = time.perf_counter()
    tier = HostMappedTier.create(store, "cuda")
    t2 = time.perf_counter()
    print(f"  create {t1 - t0:.2f}s register {t2 - t1:.2f}s", flush=True)
    tr = TrainableRows(store, ro, device_tier=tier)
    def step(ids):
        z = tr.lookup(ids)
        (z * z).sum().backward()
        tr.apply(step=1)
step(torch.randint(0, rows, (B,)))
torch.cuda.synchronize()
t3 = time.perf_counter()
for i in range(20):
    step(torch.randint(0, rows, (B,)))
torch.cuda.synchronize()
print(f"{kind} rows={rows}: first batch {t3 - t0:.2f}s, then {(time.perf_counter() - t3) / 20 * 1e3:.2f} ms/step", flush=True)
