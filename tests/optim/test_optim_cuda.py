"""CUDA: coalesce and the row step agree with the CPU, deterministically; the fused kernel agrees too.

Runs through the device tool (`pytest -m gpu tests/optim/test_optim_cuda.py`); skipped without CUDA.
Also runnable as a script where pytest is missing.
"""

from __future__ import annotations

import pytest
import torch

from lightning_embcache.optim import coalesce, make_row_optimizer, step_rows
from lightning_embcache.optim.fused import triton

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ALL = ["sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"]


def _batch(seed, n=4096, rows=300, dim=64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows, (n,), generator=gen), torch.randn(n, dim, generator=gen)


def test_coalesce_on_cuda_matches_cpu_and_is_bitwise_deterministic():
    ids, grads = _batch(0)
    cpu = coalesce(ids, grads)
    a = coalesce(ids.cuda(), grads.cuda())
    b = coalesce(ids.cuda(), grads.cuda())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0].cpu(), cpu[0])
    torch.testing.assert_close(a[1].cpu(), cpu[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ALL)
def test_step_rows_on_cuda_matches_cpu_over_50_steps(name):
    kw = {"momentum": 0.9} if name == "sgd" else {}
    opt = make_row_optimizer(name, lr=0.01, **kw)
    rows, dim = 300, 64
    w_cpu = torch.randn(rows, dim)
    s_cpu = opt.init_state(rows, dim)
    w_gpu, s_gpu = w_cpu.cuda(), {k: v.cuda() for k, v in s_cpu.items()}
    for t in range(1, 51):
        ids, grads = _batch(t, n=512)
        step_rows(opt, w_cpu, s_cpu, ids, grads, step=t)
        step_rows(opt, w_gpu, s_gpu, ids.cuda(), grads.cuda(), step=t, fused=False)
    torch.testing.assert_close(w_gpu.cpu(), w_cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.parametrize("name,kw,scan_max", [("adam", {}, 2048), ("adam", {"weight_decay": 0.01}, 2048),
                                              ("adamw", {"weight_decay": 0.1}, 2048), ("adam", {}, 0),
                                              ("adamw", {"weight_decay": 0.1}, 0)])
def test_fused_kernel_matches_torch_path_with_duplicates(name, kw, scan_max):
    from lightning_embcache.optim import fused
    saved, fused.SCAN_MAX_IDS = fused.SCAN_MAX_IDS, scan_max     # 0: the sort kernel
    try:
        _fused_vs_torch(name, kw)
    finally:
        fused.SCAN_MAX_IDS = saved


def _fused_vs_torch(name, kw):
    opt = make_row_optimizer(name, lr=0.01, betas=(0.8, 0.99), **kw)
    rows, dim = 300, 96                               # dim not a power of two: masked columns
    w0 = torch.randn(rows, dim, device="cuda")
    ref_w, ref_s = w0.clone(), opt.init_state(rows, dim, device="cuda")
    w, s = w0.clone(), opt.init_state(rows, dim, device="cuda")
    for t in range(1, 51):
        ids, grads = _batch(100 + t, n=1024, rows=rows, dim=dim)
        ids, grads = ids.cuda(), grads.cuda()
        step_rows(opt, ref_w, ref_s, ids, grads, step=t, fused=False)
        step_rows(opt, w, s, ids, grads, step=t, fused=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s["exp_avg_sq"], ref_s["exp_avg_sq"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_fused_kernel_matches_sparse_adam_on_cuda_and_is_deterministic():
    rows, dim = 200, 128
    emb = torch.nn.Embedding(rows, dim, sparse=True, device="cuda")
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    opt = make_row_optimizer("adam", lr=0.01)
    w = emb.weight.detach().clone()
    s = opt.init_state(rows, dim, device="cuda")
    w2, s2 = w.clone(), {k: v.clone() for k, v in s.items()}
    for t in range(1, 201):
        ids, grads = _batch(t, n=256, rows=rows, dim=dim)
        ids, grads = ids.cuda(), grads.cuda()
        emb.weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (rows, dim))
        sparse_adam.step()
        step_rows(opt, w, s, ids, grads, step=t, fused=True)
        step_rows(opt, w2, s2, ids, grads, step=t, fused=True)
    torch.testing.assert_close(w, emb.weight.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(w, w2)


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.parametrize("scan_max", [2048, 0])
def test_fused_kernel_skips_ids_outside_the_table(scan_max):
    from lightning_embcache.optim import fused
    saved, fused.SCAN_MAX_IDS = fused.SCAN_MAX_IDS, scan_max
    try:
        opt = make_row_optimizer("adam")
        w = torch.zeros(4, 8, device="cuda")
        s = opt.init_state(4, 8, device="cuda")
        step_rows(opt, w, s, torch.tensor([1, 4, -1, 1000], device="cuda"), torch.ones(4, 8, device="cuda"),
                  step=1, fused=True)
        torch.cuda.synchronize()
        assert torch.count_nonzero(w[1]) == 8 and torch.count_nonzero(w[[0, 2, 3]]) == 0
    finally:
        fused.SCAN_MAX_IDS = saved


def test_fused_is_refused_where_it_does_not_apply():
    from lightning_embcache.store.errors import InvalidArgumentError
    opt = make_row_optimizer("sgd")
    with pytest.raises(InvalidArgumentError, match="fused=True needs Adam"):
        step_rows(opt, torch.zeros(4, 2, device="cuda"), {}, torch.tensor([1], device="cuda"),
                  torch.ones(1, 2, device="cuda"), step=1, fused=True)


if __name__ == "__main__":  # for a machine without pytest
    import sys
    failed = 0
    for name, fn in list(globals().items()):
        if not name.startswith("test_"):
            continue
        marks = getattr(fn, "pytestmark", [])
        cases = [()]
        for m in marks:
            if m.name == "parametrize":
                argnames = [a.strip() for a in m.args[0].split(",")]
                cases = [dict(zip(argnames, v if isinstance(v, tuple) else (v,))) for v in m.args[1]]
        for case in cases:
            try:
                fn(**case) if case else fn()
                print("PASS", name, case or "")
            except Exception as exc:  # noqa: BLE001
                failed += 1
                print("FAIL", name, case or "", repr(exc))
    sys.exit(1 if failed else 0)
