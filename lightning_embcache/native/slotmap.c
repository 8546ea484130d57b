/* The device tier's slot bookkeeping (lightning_embcache/device_slots.py SlotMap) as plain loops
 * over the map's numpy arrays. Called through ctypes, which releases the interpreter lock for
 * the call: the prefetch thread's bookkeeping then runs beside the training thread instead of
 * taking turns with it. Every function checks its indices and returns a negative value (nothing
 * changed) on one out of range; the numpy implementation in device_slots.py is the reference. */
#include <stdint.h>

/* out[i] = slot of ids[i] or -1; every hit gets its reference bit. Returns the misses, or -1. */
int64_t em_find(const int32_t *slot_of, int64_t num_rows, const int64_t *ids, int64_t n,
                uint8_t *ref, int64_t *out) {
    int64_t misses = 0;
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)num_rows) return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = (int64_t)slot_of[ids[i]] - 1;
        out[i] = s;
        if (s >= 0) ref[s] = 1; else misses++;
    }
    return misses;
}

/* stamp[slots[i]] = value for every slot in range (-1 entries are skipped). */
int64_t em_stamp(int64_t *stamp, int64_t cap, const int64_t *slots, int64_t n, int64_t value) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= cap) return -1;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= 0) stamp[slots[i]] = value;
    return 0;
}

/* CLOCK from *hand: pick up to `need` occupied slots whose stamp is not `sid` (and whose row no
 * announced batch wants, if want is given) and whose reference bit is clear; every slot passed
 * loses its bit. The hand moves in windows of max(4 * need, 4096) slots (or to the end of the
 * slots) and stops once a window ends past `limit` slots, as the numpy reference does. Picked
 * slots get stamp `sid`. Returns how many were picked (written to out). */
int64_t em_sweep(const int64_t *id_of, uint8_t *ref, int64_t *stamp, int64_t sid, const int32_t *want,
                 int64_t cap, int64_t *hand, int64_t need, int64_t limit, int64_t *out) {
    int64_t h = *hand, got = 0, swept = 0;
    while (got < need && swept <= limit) {
        int64_t left = need - got, w = 4 * left > 4096 ? 4 * left : 4096;
        int64_t hi = h + w < cap ? h + w : cap, i = h;
        for (; i < hi && got < need; i++) {
            int64_t id = id_of[i];
            if (id >= 0 && stamp[i] != sid && (want == 0 || want[id] == 0) && ref[i] == 0) {
                out[got++] = i;
                stamp[i] = sid;
            }
            ref[i] = 0;
        }
        swept += i - h;
        h = i == cap ? 0 : i;
    }
    *hand = h;
    return got;
}

/* Rows ids[0..k) take slots got[0..k) (free slots, then the victims): the victims' rows leave. */
int64_t em_replace(int32_t *slot_of, int64_t num_rows, int64_t *id_of, uint8_t *ref, int64_t cap,
                   const int64_t *victims, int64_t nv, const int64_t *got, const int64_t *ids, int64_t k) {
    for (int64_t i = 0; i < nv; i++)
        if ((uint64_t)victims[i] >= (uint64_t)cap || (uint64_t)id_of[victims[i]] >= (uint64_t)num_rows) return -1;
    for (int64_t i = 0; i < k; i++)
        if ((uint64_t)got[i] >= (uint64_t)cap || (uint64_t)ids[i] >= (uint64_t)num_rows) return -1;
    for (int64_t i = 0; i < nv; i++) slot_of[id_of[victims[i]]] = 0;
    for (int64_t i = 0; i < k; i++) {
        id_of[got[i]] = ids[i];
        slot_of[ids[i]] = (int32_t)(got[i] + 1);
        ref[got[i]] = 1;
    }
    return 0;
}

/* want[u[i]] += delta. */
int64_t em_want(int32_t *want, int64_t num_rows, const int64_t *u, int64_t n, int32_t delta) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)u[i] >= (uint64_t)num_rows) return -1;
    for (int64_t i = 0; i < n; i++) want[u[i]] += delta;
    return 0;
}

/* A whole prefetch's bookkeeping in one call (SlotMap.plan): find the sorted unique ids, keep
 * the hits and `keep`, choose victims for the misses that find no free slot (announced rows
 * last), re-map, and write the swap kernel's index array. Returns the misses k (>= 0; counts[0]
 * = victims), -1 on an index out of range, -2 when too few slots may go (then only the hand,
 * reference bits and stamps changed, as in SlotMap.victims). Arrays: mids, hits: n; idx: 3n;
 * victims, vids: n; vdirty: n. */
int64_t em_plan(int32_t *slot_of, int64_t num_rows, int64_t *id_of, uint8_t *ref, int64_t *stamp,
                int64_t *sid_io, const int32_t *want, int64_t cap, int64_t *hand, int64_t *free_list,
                int64_t *nfree_io, uint8_t *dirty, const int64_t *ids, int64_t n, const int64_t *keep,
                int64_t nkeep, int64_t *mids, int64_t *hits, int64_t *idx, int64_t *victims, int64_t *vids,
                uint8_t *vdirty, int64_t *counts) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)ids[i] >= (uint64_t)num_rows) return -1;
    for (int64_t i = 0; i < nkeep; i++)
        if (keep[i] >= cap) return -1;
    int64_t k = 0, nh = 0, nfree = *nfree_io;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = (int64_t)slot_of[ids[i]] - 1;
        if (s >= 0) { ref[s] = 1; hits[nh++] = s; } else mids[k++] = ids[i];
    }
    int64_t nv = k > nfree ? k - nfree : 0;
    counts[0] = nv;
    if (nv) {
        int64_t sid = ++*sid_io;
        for (int64_t i = 0; i < nh; i++) stamp[hits[i]] = sid;
        for (int64_t i = 0; i < nkeep; i++) if (keep[i] >= 0) stamp[keep[i]] = sid;
        int64_t got = 0;
        if (want) got = em_sweep(id_of, ref, stamp, sid, want, cap, hand, nv, 2 * cap, victims);
        if (got < nv) got += em_sweep(id_of, ref, stamp, sid, 0, cap, hand, nv - got, 2 * cap, victims + got);
        if (got < nv) {
            for (int64_t i = 0; i < got; i++) stamp[victims[i]] = 0;
            return -2;
        }
    }
    int64_t nf = k - nv;  /* misses placed in free slots: the free list's last nf, in order */
    for (int64_t i = 0; i < nf; i++) idx[i] = free_list[nfree - nf + i];
    for (int64_t i = 0; i < nv; i++) {
        idx[nf + i] = victims[i];
        vids[i] = id_of[victims[i]];
        vdirty[i] = dirty[victims[i]];
        idx[k + nf + i] = vdirty[i] ? vids[i] : -1;
        slot_of[vids[i]] = 0;
        dirty[victims[i]] = 0;
    }
    for (int64_t i = 0; i < nf; i++) idx[k + i] = -1;
    for (int64_t i = 0; i < k; i++) {
        int64_t s = idx[i];
        idx[2 * k + i] = mids[i];
        id_of[s] = mids[i];
        slot_of[mids[i]] = (int32_t)(s + 1);
        ref[s] = 1;
    }
    *nfree_io = nfree - nf;
    return k;
}
