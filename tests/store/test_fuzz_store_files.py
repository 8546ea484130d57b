"""Fuzzing every file the store reads: META, manifests, LATEST, chunk maps, raw and LZ4 chunk
files, segment headers/directories/records, PINS and the Lightning layer's checkpoint registry.

Two kinds of damage: bytes changed as a disk or a careless copy would (never re-checksummed:
every one must be *detected*, or the rows read must still be the right ones), and crafted files
whose header, uuid and checksums are valid but whose payload is fuzzed (only named StoreErrors,
no hang, no allocation beyond a bound). Read-only opens, so the template is never changed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_embcache import CorruptStoreError, EmbeddingStore, StoreError
from lightning_embcache.store import fileio

N, DIM, CHUNK = 256, 8, 32
ALLOC_BOUND = 64 << 20  # bytes a read of this 8 KiB table may allocate, whatever a file claims
EXAMPLES = int(os.environ.get("EMBCACHE_FUZZ_EXAMPLES", "60"))  # figures in docs/reliability.md: 2000


def _build(root: Path, compression) -> dict:
    path = root / f"store-{compression}"
    s = EmbeddingStore.create(path, N, DIM, chunk_rows=CHUNK, compression=compression,
                              fields={"step": (torch.int32, 1)})
    rng = np.random.default_rng(0)
    for i in range(4):
        ids = torch.from_numpy(rng.choice(N, 80, replace=False))
        s.update_fields(ids, {"weight": torch.from_numpy(rng.standard_normal((80, DIM)).astype(np.float32)),
                              "step": torch.full((80, 1), i, dtype=torch.int32)})
        v = s.flush()
        if i == 1:
            s.pin(v)
            s.compact()
            s.flush()
    want = {k: t.clone() for k, t in s.get_fields(torch.arange(N), ["weight", "step"]).items()}
    s.close()
    return {"path": path, "want": want}


_TEMPLATES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _remove_templates():
    yield
    for t in _TEMPLATES.values():
        shutil.rmtree(t["path"].parent, ignore_errors=True)
    _TEMPLATES.clear()


def _template(compression):
    if compression not in _TEMPLATES:
        root = Path(tempfile.mkdtemp(prefix="embcache-fuzz-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        _TEMPLATES[compression] = _build(root, compression)
    return _TEMPLATES[compression]


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in ("LOCK",) and not p.name.startswith("readers-"))


class _Timeout(Exception):
    pass


def _read_everything(path: Path):
    """Open read-only and read every row and field of every retained version."""
    out = {}
    with EmbeddingStore.open(path, readonly=True) as s:
        versions = s.versions()
        s.pinned()
        out["latest"] = s.get_fields(torch.arange(N), ["weight", "step"])
    for v in versions:
        with EmbeddingStore.open(path, version=v, readonly=True) as s:
            s.get_fields(torch.arange(N), ["weight", "step"])
    return out


def _guarded(fn):
    """Run fn with a wall-clock alarm (no hang) and an allocation bound (no unbounded allocation)."""
    def alarm(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(10)
    tracemalloc.start()
    try:
        return fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        assert peak < ALLOC_BOUND, f"reading a damaged store allocated {peak >> 20} MiB"


def _copy(template) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="embcache-fuzzcase-", dir=template["path"].parent)) / "s"
    shutil.copytree(template["path"], dst)
    return dst


STATS = {"damaged": 0, "detected": 0, "read_correctly": 0, "missed": 0, "crafted": 0, "crafted_named": 0,
         "crafted_read": 0}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(compression=st.sampled_from([None, "lz4"]), pick=st.integers(0, 10**6), data=st.data())
def test_damaged_bytes_are_detected_or_read_correctly(compression, pick, data):
    t = _template(compression)
    path = _copy(t)
    try:
        files = _files(path)
        target = files[pick % len(files)]
        raw = bytearray(target.read_bytes())
        how = data.draw(st.sampled_from(["flip", "truncate", "extend", "zero-run"]))
        if how == "flip" and raw:
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "truncate":
            raw = raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
        elif how == "extend":
            raw += data.draw(st.binary(min_size=1, max_size=64))
        elif raw:
            a = data.draw(st.integers(0, len(raw) - 1))
            raw[a : a + data.draw(st.integers(1, 64))] = bytes(min(64, len(raw) - a))
        target.write_bytes(bytes(raw))
        STATS["damaged"] += 1
        try:
            out = _guarded(lambda: _read_everything(path))
        except StoreError:
            STATS["detected"] += 1
            return
        # not detected: acceptable only if nothing read was wrong (e.g. a damaged file no version uses)
        ok = all(torch.equal(out["latest"][k], t["want"][k]) for k in t["want"])
        STATS["read_correctly" if ok else "missed"] += 1
        assert ok, f"{how} of {target.name} went undetected and served wrong rows"
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def _json_values():
    return st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


def _bound_name(target: Path) -> str:
    """The name a file's header is bound to: its own, but LATEST's is the manifest it links to."""
    if target.name != "LATEST":
        return target.name
    version = json.loads(target.read_bytes()[fileio.HEADER_SIZE :])["version"]
    return f"manifest-{version:012d}"


def _split(target: Path) -> tuple[bytes, bytes, bytes]:
    """(header, checksummed payload, tail): raw chunks and segments checksum only their directory
    in the header; their records follow, with checksums of their own."""
    data = target.read_bytes()
    head = data[: fileio.HEADER_SIZE]
    length, _ = fileio.parse_header(target, head, head[8:16].rstrip(b"\0"), name=_bound_name(target))
    return head, data[fileio.HEADER_SIZE : fileio.HEADER_SIZE + length], data[fileio.HEADER_SIZE + length :]


def _craft(target: Path, payload: bytes) -> None:
    head, _, tail = _split(target)
    kind = head[8:16].rstrip(b"\0")
    sealed = fileio.pack(kind, payload, fileio.header_uuid(head), _bound_name(target))
    target.write_bytes(b"".join(bytes(p) for p in sealed) + tail)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(compression=st.sampled_from([None, "lz4"]), pick=st.integers(0, 10**6), data=st.data())
def test_crafted_checksummed_files_give_only_named_errors(compression, pick, data):
    t = _template(compression)
    path = _copy(t)
    try:
        files = [p for p in _files(path) if p.read_bytes()[:8] == fileio.MAGIC]
        target = files[pick % len(files)]
        payload = bytearray(_split(target)[1])
        if target.name in ("META", "PINS", "LATEST") or target.name.startswith("manifest-"):
            obj = json.loads(payload)
            if isinstance(obj, dict) and obj and data.draw(st.booleans()):
                key = data.draw(st.sampled_from(sorted(obj)))
                obj[key] = data.draw(_json_values())
            else:
                obj = data.draw(_json_values())
            payload = bytearray(json.dumps(obj).encode())
        else:  # binary payloads: chunk map, chunk directory/records, segment directory
            for _ in range(data.draw(st.integers(1, 4))):
                if payload:
                    pos = data.draw(st.integers(0, len(payload) - 1))
                    payload[pos] = data.draw(st.integers(0, 255))
            if data.draw(st.booleans()):
                payload = payload[: data.draw(st.integers(0, len(payload)))]
        _craft(target, bytes(payload))
        STATS["crafted"] += 1
        try:
            _guarded(lambda: _read_everything(path))
            STATS["crafted_read"] += 1
        except StoreError:
            STATS["crafted_named"] += 1
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=200), _json_values().map(lambda v: json.dumps(v).encode()),
                     st.dictionaries(st.text(max_size=4), _json_values(), max_size=3).map(
                         lambda d: json.dumps({"format": 1, "versions": d}).encode())))
def test_a_damaged_checkpoint_registry_is_a_named_error(raw):
    from lightning_embcache.lightning.checkpoint_pins import CheckpointPins, registry_path

    root = Path(tempfile.mkdtemp(prefix="embcache-reg-"))
    try:
        registry_path(root / "store").write_bytes(raw)
        try:
            pins = _guarded(lambda: CheckpointPins(root / "store"))
        except CorruptStoreError:
            return
        assert all(isinstance(v, int) and isinstance(f, list) for v, f in pins.versions.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_checkpoint_registry_version_of_digits_int_refuses_is_a_named_error():
    """Found by the fuzz above: '²' passes str.isdigit() but not int()."""
    from lightning_embcache.lightning.checkpoint_pins import CheckpointPins, registry_path

    root = Path(tempfile.mkdtemp(prefix="embcache-reg-"))
    try:
        registry_path(root / "store").write_bytes(json.dumps({"format": 1, "versions": {"\u00b2": []}}).encode())
        with pytest.raises(CorruptStoreError, match="is not version"):
            CheckpointPins(root / "store")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_fuzz_figures():
    """Prints the figures docs/reliability.md reports (run after the fuzz tests, -s to see them)."""
    print(f"\nFUZZ {json.dumps(STATS)}")
    assert STATS["missed"] == 0


def test_a_sparse_chunk_directory_of_a_length_that_is_no_whole_checksum_is_a_named_error():
    """Found by the crafted-files test: a sparse chunk's directory, checksum valid, one byte
    short of its last block checksum raised numpy's ValueError instead of CorruptStoreError."""
    path = _copy(_template(None))
    try:
        sparse = [p for p in _files(path) if p.read_bytes()[8:16].rstrip(b"\0") == b"sparse"]
        assert sparse, "the template store has no sparse chunk to craft"
        _craft(sparse[0], _split(sparse[0])[1][:-1])
        with pytest.raises(CorruptStoreError, match="does not fit"):
            _read_everything(path)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
