/* A disk-mode get over page-cached chunk files (store/mappedget.py) as one loop: per id, its hot
 * slot or its row in the read-only maps of the chunk files (store/mapped.py), the 4 KiB blocks
 * that row lies in checked against their stored CRC-32 the first time any row of them is read,
 * and the row copied into the output. numpy needs some 20 calls of 1-3 us each for the same work
 * (store/tiers.py `_mapped_get`, the reference), and a first read of a block went through the
 * general miss path. Called through ctypes, which lets go of the interpreter lock for the call.
 *
 * Every array comes through the context `cx` (int64 slots, layout in mappedget.py) so a call
 * converts four arguments, not thirty. Nothing is changed on a return other than 0 except block
 * flags of blocks that did pass their check and reference bits of hot rows (both true).
 * any_hot 0 says the hot tier holds no row (its lookups are skipped). */
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

typedef uint32_t (*em_crc32_fn)(uint32_t crc, const unsigned char *buf, uint64_t len);

enum {
    CX_NUM_ROWS, CX_CHUNK_ROWS, CX_ROW_BYTES, CX_BLOCK, CX_BPC, CX_STRIDE,
    CX_SLOT_OF, CX_POOL, CX_REF, CX_BITS, CX_CMAP,
    CX_FAST_GEN, CX_FAST_BASE, CX_MAP_GEN, CX_FILE_GEN, CX_OK_GEN, CX_SPARSE, CX_OFF, CX_LEN,
    CX_OK, CX_CRC, CX_MAPS, CX_CRC_FN, CX_STAMP, CX_CALL,
    CX_PAGE, CX_REGION, CX_RPC, CX_SEEN_GEN, CX_COLD, CX_ASKED, CX_FIRST_READS, CX_FIRST_STAMP, CX_WHOLE_AFTER,
    /* results */
    CX_HOT, CX_CHUNKS, CX_BLOCKS, CX_AT, CX_BAD_CHUNK, CX_BAD_BLOCK, CX_ASKS,
    CX_SIZE
};

enum { EM_DONE = 0, EM_GENERAL = 1, EM_DELTA = 2, EM_BAD_BLOCK = 3, EM_BAD_ID = 4 };

#define PTR(type, k) ((type)(uintptr_t)cx[k])
#define EM_AHEAD 8

/* 1 if every page of [a, a + nbytes) (a page-aligned) is in the page cache, else 0. */
static uint8_t em_resident(const uint8_t *a, int64_t nbytes, int64_t page) {
#ifdef __linux__
    unsigned char vec[1024];
    for (int64_t done = 0; done < nbytes; done += 1024 * page) {
        int64_t part = nbytes - done < 1024 * page ? nbytes - done : 1024 * page;
        int64_t pages = (part + page - 1) / page;
        if (mincore((void *)(a + done), (size_t)part, vec) != 0) return 1; /* cannot tell: no hints */
        for (int64_t p = 0; p < pages; p++)
            if (!(vec[p] & 1)) return 0;
    }
#endif
    (void)a; (void)nbytes; (void)page;
    return 1;
}

/* Before the gather: rows of chunks whose files were not all in the page cache when first seen
 * at their generation, in blocks not verified yet, get the region of cx[CX_REGION] bytes around
 * them asked from the kernel (MADV_WILLNEED: read-ahead, not waited for), each region once per
 * (chunk, generation). The gather's page faults then wait for reads already running together,
 * not one at a time as a memmap's do. A file found in the page cache is asked nothing. Returns
 * the regions asked. */
static int64_t em_ask_cold(int64_t *cx, const int64_t *ids, int64_t n) {
    int64_t asks = 0;
#ifdef __linux__
    const uint64_t num_rows = (uint64_t)cx[CX_NUM_ROWS];
    const int64_t cr = cx[CX_CHUNK_ROWS], rb = cx[CX_ROW_BYTES], block = cx[CX_BLOCK], bpc = cx[CX_BPC];
    const int64_t stride = cx[CX_STRIDE], page = cx[CX_PAGE], region = cx[CX_REGION], rpc = cx[CX_RPC];
    const int32_t *slot_of = PTR(const int32_t *, CX_SLOT_OF);
    const int32_t *cmap = PTR(const int32_t *, CX_CMAP);
    const int64_t *fast_gen = PTR(const int64_t *, CX_FAST_GEN);
    const int64_t *map_gen = PTR(const int64_t *, CX_MAP_GEN);
    const int64_t *off = PTR(const int64_t *, CX_OFF);
    const int64_t *len = PTR(const int64_t *, CX_LEN);
    const uint8_t *ok = PTR(const uint8_t *, CX_OK);
    const uint8_t *maps = PTR(const uint8_t *, CX_MAPS);
    int64_t *seen_gen = PTR(int64_t *, CX_SEEN_GEN);
    uint8_t *cold = PTR(uint8_t *, CX_COLD);
    uint8_t *asked = PTR(uint8_t *, CX_ASKED);
    const int64_t *first_reads = PTR(const int64_t *, CX_FIRST_READS);
    const int64_t *first_stamp = PTR(const int64_t *, CX_FIRST_STAMP);
    const int64_t whole_after = cx[CX_WHOLE_AFTER], call = cx[CX_CALL];
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if ((uint64_t)id >= num_rows || slot_of[id] > 0) continue;
        const int64_t c = id / cr, g = cmap[c];
        if (g <= 0 || fast_gen[c] == g || map_gen[c] != g) continue;
        const uint8_t *file = maps + c * stride;
        const int64_t o = (id - c * cr) * rb;
        if (o + rb > len[c]) continue;
        if (seen_gen[c] != g) {
            seen_gen[c] = g;
            memset(asked + c * rpc, 0, (size_t)rpc);
            cold[c] = !em_resident(file, off[c] + len[c], page);
        }
        if (!cold[c] || ok[c * bpc + o / block]) continue;
        if (first_reads[c] + (first_stamp[c] != call) > whole_after) {
            /* the loop checks this chunk whole in this call: ask for all of it now, with the
             * call's other such chunks, not one synchronous read each */
            int64_t r = 0;
            while (r < rpc && asked[c * rpc + r]) r++;
            if (r < rpc) {
                memset(asked + c * rpc, 1, (size_t)rpc);
                madvise((void *)file, (size_t)(off[c] + len[c]), MADV_WILLNEED);
                asks++;
            }
            continue;
        }
        const int64_t r = (off[c] + o) / region;
        if (r >= rpc || asked[c * rpc + r]) continue;
        asked[c * rpc + r] = 1;
        const int64_t lo = r * region, end = off[c] + len[c];
        const int64_t hi = lo + region < end ? lo + region : end;
        madvise((void *)(file + lo), (size_t)(hi - lo), MADV_WILLNEED);
        asks++;
    }
#endif
    (void)cx; (void)ids; (void)n;
    return asks;
}

/* Rows of ids[0..n) into out (n x row_bytes). Returns EM_DONE (cx[CX_HOT] rows were hot,
 * cx[CX_CHUNKS] distinct chunks read, cx[CX_BLOCKS] blocks checked), or stops at position
 * cx[CX_AT] with EM_GENERAL (a row this loop cannot serve: its file not mapped here, a sparse
 * file, no checksum function, a chunk never written), EM_DELTA (a row that may have a record in
 * a delta segment: the caller asks the row index), EM_BAD_ID (an id out of range), or
 * EM_BAD_BLOCK (block cx[CX_BAD_BLOCK] of chunk cx[CX_BAD_CHUNK] does not match the checksum
 * held: the caller checks it again through the general path, which names the file). */
int64_t em_gather_mapped(int64_t *cx, const int64_t *ids, int64_t n, uint8_t *out, int64_t any_hot) {
    const uint64_t num_rows = (uint64_t)cx[CX_NUM_ROWS];
    const int64_t cr = cx[CX_CHUNK_ROWS], rb = cx[CX_ROW_BYTES], block = cx[CX_BLOCK], bpc = cx[CX_BPC];
    const int64_t stride = cx[CX_STRIDE];
    /* (an empty hot tier, as in an evaluation pass, skips the lookups: one cache miss a row) */
    const int32_t *slot_of = any_hot ? PTR(const int32_t *, CX_SLOT_OF) : 0;
    const uint8_t *pool = PTR(const uint8_t *, CX_POOL);
    uint8_t *ref = PTR(uint8_t *, CX_REF);
    const uint8_t *bits = PTR(const uint8_t *, CX_BITS);
    const int32_t *cmap = PTR(const int32_t *, CX_CMAP);
    const int64_t *fast_gen = PTR(const int64_t *, CX_FAST_GEN);
    const int64_t *fast_base = PTR(const int64_t *, CX_FAST_BASE);
    const int64_t *map_gen = PTR(const int64_t *, CX_MAP_GEN);
    const int64_t *file_gen = PTR(const int64_t *, CX_FILE_GEN);
    const int32_t *ok_gen = PTR(const int32_t *, CX_OK_GEN);
    const uint8_t *sparse = PTR(const uint8_t *, CX_SPARSE);
    const int64_t *off = PTR(const int64_t *, CX_OFF);
    const int64_t *len = PTR(const int64_t *, CX_LEN);
    uint8_t *ok = PTR(uint8_t *, CX_OK);
    const uint32_t *crc = PTR(const uint32_t *, CX_CRC);
    const uint8_t *maps = PTR(const uint8_t *, CX_MAPS);
    em_crc32_fn crc32 = PTR(em_crc32_fn, CX_CRC_FN);
    int64_t *stamp = PTR(int64_t *, CX_STAMP);
    int64_t *first_reads = PTR(int64_t *, CX_FIRST_READS), *first_stamp = PTR(int64_t *, CX_FIRST_STAMP);
    const int64_t whole_after = cx[CX_WHOLE_AFTER];
    const int64_t call = ++cx[CX_CALL];
    cx[CX_ASKS] = cx[CX_COLD] ? em_ask_cold(cx, ids, n) : 0;
    int64_t hot = 0, chunks = 0, blocks = 0, status = EM_DONE, i = 0;
    for (; i < n; i++) {
        /* rows lie at random in a table larger than the caches: start the loads of rows a few
         * positions ahead (their slot entries further ahead), so that several misses overlap */
        if (slot_of && i + 2 * EM_AHEAD < n && (uint64_t)ids[i + 2 * EM_AHEAD] < num_rows)
            __builtin_prefetch(slot_of + ids[i + 2 * EM_AHEAD]);
        if (i + EM_AHEAD < n) {
            const int64_t ahead = ids[i + EM_AHEAD];
            if ((uint64_t)ahead < num_rows && (!slot_of || slot_of[ahead] == 0)) {
                const int64_t ca = ahead / cr;
                if (fast_gen[ca] == cmap[ca]) {
                    const uint8_t *p = maps + fast_base[ca] + ahead * rb;
                    for (int64_t line = 0; line < rb; line += 64) __builtin_prefetch(p + line);
                }
            }
        }
        const int64_t id = ids[i];
        uint8_t *dst = out + i * rb;
        if ((uint64_t)id >= num_rows) { status = EM_BAD_ID; break; }
        const int32_t s = slot_of ? slot_of[id] : 0;
        if (s > 0) {
            memcpy(dst, pool + (int64_t)(s - 1) * rb, (size_t)rb);
            ref[s - 1] = 1;
            hot++;
            continue;
        }
        if (bits && ((bits[id >> 3] >> (id & 7)) & 1)) { status = EM_DELTA; break; }
        const int64_t c = id / cr;
        const int64_t g = cmap[c];
        const uint8_t *src;
        if (fast_gen[c] == g) {
            src = maps + fast_base[c] + id * rb;
        } else {
            if (g <= 0 || map_gen[c] != g || file_gen[c] != g || ok_gen[c] != g || sparse[c] || !crc32) {
                status = EM_GENERAL;
                break;
            }
            const int64_t o = (id - c * cr) * rb, nbytes = len[c];
            if (o + rb > nbytes) { status = EM_GENERAL; break; }
            const uint8_t *rec = maps + c * stride + off[c];
            int64_t b = o / block;
            int64_t last = (o + rb - 1) / block;
            if (!ok[c * bpc + b] || !ok[c * bpc + last]) {
                /* a chunk that keeps needing first reads (an epoch over the table) is checked
                 * whole, in file order: one streaming pass, its page table filled in one call */
                if (first_stamp[c] != call) { first_stamp[c] = call; first_reads[c]++; }
                if (first_reads[c] > whole_after) {
                    b = 0;
                    last = (nbytes + block - 1) / block - 1;
#if defined(__linux__) && defined(MADV_POPULATE_READ)
                    const uint8_t *file = maps + c * stride;
                    madvise((void *)file, (size_t)(off[c] + nbytes), MADV_POPULATE_READ);
#endif
                }
            }
            for (; b <= last; b++) {
                const int64_t k = c * bpc + b;
                if (ok[k]) continue;
                const int64_t lo = b * block, hi = lo + block < nbytes ? lo + block : nbytes;
                if (crc32(0, rec + lo, (uint64_t)(hi - lo)) != crc[k]) break;
                ok[k] = 1;
                blocks++;
            }
            if (b <= last) {
                status = EM_BAD_BLOCK;
                cx[CX_BAD_CHUNK] = c;
                cx[CX_BAD_BLOCK] = b;
                break;
            }
            src = rec + o;
        }
        memcpy(dst, src, (size_t)rb);
        if (stamp[c] != call) { stamp[c] = call; chunks++; }
    }
    cx[CX_HOT] = hot;
    cx[CX_CHUNKS] = chunks;
    cx[CX_BLOCKS] = blocks;
    cx[CX_AT] = i;
    return status;
}
