"""A compiled CPU loop for the Adam/AdamW step on rows of tables in memory (opt-in).

`step_rows(..., fused=True)` on CPU float32 tables with `Adam`/`AdamW` (global step) sorts the ids
(stable) and makes one C++ pass over them: each run of equal ids has its gradient rows summed in
position order (deterministic), then the row's weights and both moments are loaded, updated and
stored back, with no temporaries, prefetching the rows a few ids ahead (random rows of a large
table cost memory latency, not arithmetic). Ids outside the table are skipped. Built on first use with
`torch.utils.cpp_extension.load_inline` (needs a C++ compiler and ninja; about 30-90 s, cached by
torch under `~/.cache/torch_extensions` or `TORCH_EXTENSIONS_DIR`), so it is never built implicitly:
`fused=None` uses it only once it is loaded in this process (`load()`).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from lightning_embcache.optim.rounding import noise_offset

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <vector>

// The gradient of the run of equal ids starting at `i` (rows of G in `order`): the row itself, or
// the sum of the run's rows in `acc`; `i` moves past the run.
static inline const float* run_gradient(const int64_t* id, const int64_t* pos, const float* g0, int64_t sg,
                                        int64_t n, int64_t d, int64_t& i, float* acc) {
  const int64_t r = id[i];
  const float* g = g0 + pos[i] * sg;
  int64_t j = i + 1;
  if (j < n && id[j] == r) {  // duplicates: sum the run
    for (int64_t k = 0; k < d; ++k) acc[k] = g[k];
    for (; j < n && id[j] == r; ++j) {
      const float* h = g0 + pos[j] * sg;
      for (int64_t k = 0; k < d; ++k) acc[k] += h[k];
    }
    g = acc;
  }
  i = j;
  return g;
}

// sorted: ids ascending; order: their positions in G. Each run of equal ids is summed (in sorted,
// i.e. stable position, order), then the row gets one pass: coupled L2 (l2), decoupled decay
// (decay), SparseAdam's moments and update. Ids outside [0, rows) are skipped.
void adam_rows_(torch::Tensor W, torch::Tensor M, torch::Tensor V, torch::Tensor sorted,
                torch::Tensor order, torch::Tensor G, double step_size, double one_minus_beta1,
                double one_minus_beta2, double eps, double l2, double decay) {
  const int64_t n = sorted.size(0), d = W.size(1), rows = W.size(0);
  const int64_t sw = W.stride(0), sm = M.stride(0), sv = V.stride(0), sg = G.stride(0);
  float* w0 = W.data_ptr<float>();
  float* m0 = M.data_ptr<float>();
  float* v0 = V.data_ptr<float>();
  const float* g0 = G.data_ptr<float>();
  const int64_t* id = sorted.data_ptr<int64_t>();
  const int64_t* pos = order.data_ptr<int64_t>();
  const float ss = step_size, c1 = one_minus_beta1, c2 = one_minus_beta2, e = eps, l = l2, dc = decay;
  const int64_t ahead = 6;  // rows prefetched ahead: enough misses in flight to hide latency
  std::vector<float> acc(d);
  int64_t i = 0;
  while (i < n) {
    if (i + ahead < n) {
      const int64_t r = id[i + ahead];
      if (r >= 0 && r < rows) {
        for (int64_t k = 0; k < d; k += 16) {
          __builtin_prefetch(w0 + r * sw + k, 1);
          __builtin_prefetch(m0 + r * sm + k, 1);
          __builtin_prefetch(v0 + r * sv + k, 1);
        }
      }
    }
    const int64_t r = id[i];
    const float* g = run_gradient(id, pos, g0, sg, n, d, i, acc.data());
    if (r < 0 || r >= rows) continue;
    float* __restrict w = w0 + r * sw;
    float* __restrict m = m0 + r * sm;
    float* __restrict v = v0 + r * sv;
    #pragma omp simd
    for (int64_t k = 0; k < d; ++k) {
      const float gk = g[k] + l * w[k];
      const float mk = m[k] + c1 * (gk - m[k]);
      const float vk = v[k] + c2 * (gk * gk - v[k]);
      m[k] = mk;
      v[k] = vk;
      w[k] = w[k] * dc - ss * (mk / (std::sqrt(vk) + e));
    }
  }
}

// The splitmix64 hash of lightning_embcache.optim.rounding.uniform_noise: 24 bits in [0, 1).
static inline float noise24(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z = z ^ (z >> 31);
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

static inline uint32_t bits_of(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
static inline float float_of(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }

// x rounded into bfloat16, as float: stochastically (the upper neighbour with probability
// (x - lo) / (hi - lo)) or to nearest even; exactly what rounding.stochastic_round picks.
static inline uint16_t to_bf16(float x, float u, bool stochastic) {
  const uint32_t b = bits_of(x);
  if (std::isnan(x)) return (uint16_t)((b >> 16) | 0x40);
  if (!stochastic) {  // round to nearest even
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  }
  const uint32_t t = b & 0xFFFF0000u;  // toward zero
  if (t == b) return (uint16_t)(b >> 16);
  const float a = float_of(t), c = float_of(t + 0x10000u);  // c: one step further from zero
  const float lo = x > 0 ? a : c, hi = x > 0 ? c : a;
  const float gap = hi - lo;
  if (!std::isfinite(gap) || gap == 0.0f) return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  const bool up = u < (x - lo) / gap;
  return (uint16_t)(bits_of(up ? hi : lo) >> 16);
}

// adam_rows_ for bfloat16 rows (float32 moments): the update in float32, the row rounded back
// once, stochastically keyed by (offset, id * d + column) when `stochastic`.
void adam_rows_bf16_(torch::Tensor W, torch::Tensor M, torch::Tensor V, torch::Tensor sorted,
                     torch::Tensor order, torch::Tensor G, double step_size, double one_minus_beta1,
                     double one_minus_beta2, double eps, double l2, double decay, int64_t offset,
                     bool stochastic) {
  const int64_t n = sorted.size(0), d = W.size(1), rows = W.size(0);
  const int64_t sw = W.stride(0), sm = M.stride(0), sv = V.stride(0), sg = G.stride(0);
  uint16_t* w0 = reinterpret_cast<uint16_t*>(W.data_ptr<at::BFloat16>());
  float* m0 = M.data_ptr<float>();
  float* v0 = V.data_ptr<float>();
  const float* g0 = G.data_ptr<float>();
  const int64_t* id = sorted.data_ptr<int64_t>();
  const int64_t* pos = order.data_ptr<int64_t>();
  const float ss = step_size, c1 = one_minus_beta1, c2 = one_minus_beta2, e = eps, l = l2, dc = decay;
  std::vector<float> acc(d);
  int64_t i = 0;
  while (i < n) {
    const int64_t r = id[i];
    const float* g = run_gradient(id, pos, g0, sg, n, d, i, acc.data());
    if (r < 0 || r >= rows) continue;
    uint16_t* w = w0 + r * sw;
    float* m = m0 + r * sm;
    float* v = v0 + r * sv;
    const uint64_t key = (uint64_t)r * (uint64_t)d + (uint64_t)offset;
    for (int64_t k = 0; k < d; ++k) {
      const float wk = float_of(((uint32_t)w[k]) << 16);
      const float gk = g[k] + l * wk;
      const float mk = m[k] + c1 * (gk - m[k]);
      const float vk = v[k] + c2 * (gk * gk - v[k]);
      m[k] = mk;
      v[k] = vk;
      const float nw = wk * dc - ss * (mk / (std::sqrt(vk) + e));
      w[k] = to_bf16(nw, stochastic ? noise24(key + (uint64_t)k) : 0.0f, stochastic);
    }
  }
}
"""

_lock = threading.Lock()
_module = None


def loaded() -> bool:
    return _module is not None


def load(verbose: bool = False):
    """Build (first time on this machine) and load the extension; returns the module."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline("embcache_adam_rows_cpu_v3", cpp_sources=_SOURCE,
                                  functions=["adam_rows_", "adam_rows_bf16_"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=verbose)
    return _module


def fused_cpu_adam_step_rows(optimizer, weight: Tensor, state: dict[str, Tensor], ids: Tensor,
                             grads: Tensor, *, step: int, lr: float, stochastic_rounding: bool = False,
                             seed: int = 0) -> bool:
    """Run the compiled step (duplicates allowed) if this case is covered; else return False.

    float32 rows, or bfloat16 rows with float32 moments (rounded back to nearest, or with
    ``stochastic_rounding`` as `lightning_embcache.optim.rounding` rounds them, keyed alike).
    """
    from lightning_embcache.optim.adam import Adam

    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if (not isinstance(optimizer, Adam) or optimizer.per_row_step or m is None or v is None
            or len(state) != 2 or weight.dtype not in (torch.float32, torch.bfloat16)
            or not all(t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1 for t in (weight, m, v))
            or m.dtype != torch.float32 or v.dtype != torch.float32
            or isinstance(step, bool) or not isinstance(step, int) or step < 1):
        return False
    module = load()
    beta1, beta2 = optimizer.betas
    wd = optimizer.weight_decay
    step_size = lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
    grads = grads.to(torch.float32).contiguous()
    sorted_ids, order = torch.sort(ids.to(torch.int64), stable=True)
    scalars = (step_size, 1.0 - beta1, 1.0 - beta2, optimizer.eps, 0.0 if optimizer._decoupled else wd,
               1.0 - lr * wd if optimizer._decoupled else 1.0)
    if weight.dtype == torch.bfloat16:
        module.adam_rows_bf16_(weight, m, v, sorted_ids, order, grads, *scalars,
                               noise_offset(step, seed), bool(stochastic_rounding))
    else:
        module.adam_rows_(weight, m, v, sorted_ids, order, grads, *scalars)
    return True
