"""The systems compared by ``embcache bench store``.

Every system exposes the same small surface, so the worker times them with one loop:

* ``get(b)`` -> rows for ``b.ids`` (a fresh tensor/array),
* ``update(b, values)`` -> writes rows,
* ``flush()`` -> makes the writes durable (``None`` = the system has no durability),
* ``close()``.

``b`` is a :class:`Batch` carrying the ids both as a torch int64 tensor and a numpy view of it,
so no system pays for a conversion the others do not.

Systems:

``torch``       a plain tensor, ``index_select`` / ``index_copy_`` (the in-memory bound)
``numpy``       a plain ndarray, ``take`` / fancy assignment (the in-memory bound)
``torch_thp``   a tensor over anonymous ``mmap`` memory that was ``madvise(MADV_HUGEPAGE)``d
``memmap``      ``numpy.memmap`` over a raw file; ``flush`` = msync
``naive``       the field report's design: chunk files of 1024 rows, an unbounded dict of loaded
                chunks, and a whole-chunk ``torch.load`` + ``torch.save`` of every touched chunk on
                every update (sync per update, no fsync, exactly as the report's code)
``store``       :class:`lightning_embcache.EmbeddingStore`
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IN_MEMORY = ("torch", "numpy", "torch_thp")
ALL_SYSTEMS = ("torch", "numpy", "torch_thp", "memmap", "naive", "store")
HUGE_PAGE = 2 << 20


@dataclass
class Batch:
    ids: torch.Tensor  # int64, 1-D
    ids_np: np.ndarray  # a view of the same memory

    @classmethod
    def of(cls, ids: torch.Tensor) -> Batch:
        ids = ids.to(torch.int64).contiguous()
        return cls(ids, ids.numpy())


# --------------------------------------------------------------------------------------------
# table contents: random normal rows, generated as one random block tiled over the table (a
# 1M x 128 randn costs ~2 s on this machine; the tiling is a memcpy and still incompressible
# for LZ4, whose window is 64 KiB)
# --------------------------------------------------------------------------------------------
_BLOCK_ROWS = 1 << 15


def random_block(dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(_BLOCK_ROWS, dim, generator=g)


def fill_rows(dst: torch.Tensor, start: int, block: torch.Tensor) -> None:
    """Fill ``dst`` (rows ``start..start+len(dst)`` of the table) with the tiled block."""
    n = dst.shape[0]
    pos = 0
    while pos < n:
        src_off = (start + pos) % _BLOCK_ROWS
        take = min(n - pos, _BLOCK_ROWS - src_off)
        dst[pos : pos + take].copy_(block[src_off : src_off + take])
        pos += take


def table_rows(start: int, stop: int, block: torch.Tensor) -> torch.Tensor:
    out = torch.empty(stop - start, block.shape[1], dtype=block.dtype)
    fill_rows(out, start, block)
    return out


# --------------------------------------------------------------------------------------------
# /proc helpers
# --------------------------------------------------------------------------------------------
def smaps_anon_huge_kb(addr: int | None = None) -> int:
    """AnonHugePages (KiB) of the mapping containing ``addr``, or of the whole process."""
    if addr is None:
        try:
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    if line.startswith("AnonHugePages:"):
                        return int(line.split()[1])
        except OSError:
            return -1
        return 0
    total = 0
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
    except OSError:
        return -1
    return total


def drop_file_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) every file under ``root`` (our files only); returns files done."""
    done = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return done


# --------------------------------------------------------------------------------------------
# systems
# --------------------------------------------------------------------------------------------
class System:
    name = "?"
    durable = False

    def info(self) -> dict:
        return {}

    def flush(self):  # pragma: no cover - overridden
        return None

    def close(self) -> None:
        pass


class TorchTable(System):
    name = "torch"

    def __init__(self, num_rows: int, dim: int, block: torch.Tensor, table: torch.Tensor | None = None):
        if table is None:
            table = torch.empty(num_rows, dim, dtype=torch.float32)
            fill_rows(table, 0, block)
        self.table = table

    def get(self, b: Batch):
        return self.table.index_select(0, b.ids)

    def update(self, b: Batch, values) -> None:
        self.table.index_copy_(0, b.ids, values)


class NumpyTable(System):
    name = "numpy"

    def __init__(self, num_rows: int, dim: int, block: torch.Tensor):
        t = torch.empty(num_rows, dim, dtype=torch.float32)
        fill_rows(t, 0, block)
        self.table = t.numpy()

    def get(self, b: Batch):
        return self.table.take(b.ids_np, axis=0)

    def update(self, b: Batch, values) -> None:
        self.table[b.ids_np] = values


class THPTable(TorchTable):
    """A tensor over anonymous memory advised MADV_HUGEPAGE (2 MiB aligned)."""

    name = "torch_thp"

    def __init__(self, num_rows: int, dim: int, block: torch.Tensor):
        nbytes = num_rows * dim * 4
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.madvise_ok = True
        self.madvise_error = None
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError) as exc:  # kernel without THP: fall back to 4 KiB pages
            self.madvise_ok = False
            self.madvise_error = repr(exc)
        offset = (-base) % HUGE_PAGE
        self.addr = base + offset
        arr = np.frombuffer(self._map, dtype=np.float32, count=num_rows * dim, offset=offset)
        table = torch.from_numpy(arr.reshape(num_rows, dim))
        fill_rows(table, 0, block)  # first touch after madvise: faults in huge pages
        super().__init__(num_rows, dim, block, table=table)
        self.nbytes = nbytes

    def info(self) -> dict:
        huge_kb = smaps_anon_huge_kb(self.addr)
        return {
            "madvise_hugepage": self.madvise_ok,
            "madvise_error": self.madvise_error,
            "thp_granted_kib": huge_kb,
            "table_kib": self.nbytes // 1024,
            "thp_granted_fraction": round(huge_kb * 1024 / self.nbytes, 4) if huge_kb >= 0 else None,
        }

    def close(self) -> None:
        self.table = None
        # the mmap is released when the last numpy/torch view goes away


class MemmapTable(System):
    name = "memmap"
    durable = True

    def __init__(self, path: Path, num_rows: int, dim: int):
        self.table = np.memmap(path, dtype=np.float32, mode="r+", shape=(num_rows, dim))

    def get(self, b: Batch):
        return self.table[b.ids_np]

    def update(self, b: Batch, values) -> None:
        self.table[b.ids_np] = values

    def flush(self):
        self.table.flush()  # msync(MS_SYNC)
        return 0

    def close(self) -> None:
        self.table.flush()
        del self.table


def create_memmap_file(path: Path, num_rows: int, dim: int, block: torch.Tensor) -> None:
    step = 1 << 16
    with open(path, "wb") as f:
        for start in range(0, num_rows, step):
            stop = min(num_rows, start + step)
            f.write(table_rows(start, stop, block).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


class NaiveChunkStore(System):
    """The field report's TrainableEmbeddingManager (see field-reports/000_*.txt).

    ``get``: group ids by chunk, ``torch.load`` every chunk not yet in ``loaded_chunks`` (an
    unbounded dict), gather. ``update``: write into loaded chunks, then sync: for every touched
    chunk, ``torch.load`` the chunk file, modify, ``torch.save`` it back (no fsync, as in the
    report). In memory mode (``preload``) every chunk is loaded up front.
    """

    name = "naive"
    durable = True

    def __init__(self, root: Path, num_rows: int, dim: int, chunk_rows: int, preload: bool):
        self.root = Path(root)
        self.num_rows, self.dim, self.chunk_rows = num_rows, dim, chunk_rows
        self.loaded_chunks: dict[int, torch.Tensor] = {}
        if preload:
            for c in range(-(-num_rows // chunk_rows)):
                self.loaded_chunks[c] = torch.load(self._path(c), map_location="cpu")

    def _path(self, c: int) -> Path:
        return self.root / f"embeddings_chunk_{c}.pt"

    def _groups(self, ids: torch.Tensor):
        chunk = ids // self.chunk_rows
        order = torch.argsort(chunk, stable=True)
        chunks, counts = torch.unique_consecutive(chunk[order], return_counts=True)
        pos = 0
        for c, n in zip(chunks.tolist(), counts.tolist()):
            sel = order[pos : pos + n]
            pos += n
            yield c, sel

    def get(self, b: Batch):
        ids = b.ids
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        for c, sel in self._groups(ids):
            data = self.loaded_chunks.get(c)
            if data is None:
                data = self.loaded_chunks[c] = torch.load(self._path(c), map_location="cpu")
            out[sel] = data[ids[sel] - c * self.chunk_rows]
        return out

    def update(self, b: Batch, values) -> None:
        ids = b.ids
        for c, sel in self._groups(ids):
            local = ids[sel] - c * self.chunk_rows
            vals = values[sel]
            cached = self.loaded_chunks.get(c)
            if cached is not None:
                cached[local] = vals
            # sync per update: load the whole chunk, modify, save the whole chunk
            path = self._path(c)
            chunk_data = torch.load(path, map_location="cpu")
            chunk_data[local] = vals
            torch.save(chunk_data, path)

    def flush(self):
        return 0  # already synced on every update

    def info(self) -> dict:
        return {"loaded_chunks": len(self.loaded_chunks)}


def create_naive_files(root: Path, num_rows: int, dim: int, chunk_rows: int, block: torch.Tensor) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for c in range(-(-num_rows // chunk_rows)):
        start = c * chunk_rows
        stop = min(num_rows, start + chunk_rows)
        torch.save(table_rows(start, stop, block), root / f"embeddings_chunk_{c}.pt")
    os.sync()


class StoreSystem(System):
    name = "store"
    durable = True

    def __init__(self, path: Path, hot_bytes, warm_bytes: int):
        from lightning_embcache.store import EmbeddingStore

        self.store = EmbeddingStore.open(path, hot_bytes=hot_bytes, warm_bytes=warm_bytes)

    def get(self, b: Batch):
        return self.store.get(b.ids)

    def update(self, b: Batch, values) -> None:
        self.store.update(b.ids, values)

    def flush(self):
        return self.store.flush()

    def prefetch_all(self, num_rows: int, step: int = 1 << 16) -> None:
        """Bring the whole table into the hot tier (in-RAM mode steady state)."""
        for start in range(0, num_rows, step):
            self.store.get(torch.arange(start, min(num_rows, start + step)))

    def stats(self) -> dict:
        try:
            s = self.store.stats()
        except Exception as exc:  # pragma: no cover - engine in flux
            return {"error": repr(exc)}
        try:
            from dataclasses import asdict

            return {k: (v if isinstance(v, (int, float, str, type(None))) else repr(v)) for k, v in asdict(s).items()}
        except TypeError:
            return {"repr": repr(s)}

    def info(self) -> dict:
        return {"stats": self.stats()}

    def close(self) -> None:
        self.store.close()


def create_store(path: Path, num_rows: int, dim: int, chunk_rows: int, hot_bytes, warm_bytes: int,
                 block: torch.Tensor, step: int = 1 << 16) -> dict:
    """Create and populate a store (every row written, then flushed) so reads hit real data."""
    from lightning_embcache.store import EmbeddingStore

    store = EmbeddingStore.create(path, num_rows, dim, dtype=torch.float32, chunk_rows=chunk_rows,
                                  hot_bytes=hot_bytes, warm_bytes=warm_bytes)
    try:
        for start in range(0, num_rows, step):
            stop = min(num_rows, start + step)
            store.update(torch.arange(start, stop), table_rows(start, stop, block))
            if hot_bytes is not None and (start // step) % 8 == 7:
                store.flush()
        store.flush()
        # a store at rest: its rows in base chunks, as after training's background compaction.
        # Without this the timed loop would overlap the first full-table compaction.
        store.compact()
        version = store.flush()
    finally:
        store.close()
    return {"version": version}
