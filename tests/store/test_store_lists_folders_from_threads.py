"""Listing a folder the store holds open, from several threads at once (garbage collection in the
background beside `versions()` on the caller's thread), sees every file every time."""

from __future__ import annotations

import os
import threading

from lightning_embcache.store import fileio


def _concurrent_listings(tmp_path, listdir) -> list[int]:
    for i in range(300):
        (tmp_path / f"manifest-{i:012d}").write_bytes(b"")
    fd = os.open(tmp_path, os.O_RDONLY)
    counts: list[int] = []
    try:
        def work():
            for _ in range(40):
                counts.append(len(listdir(fd)))

        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return counts


def test_threads_listing_one_held_folder_each_see_all_of_it(tmp_path):
    counts = _concurrent_listings(tmp_path, fileio.listdir)
    assert set(counts) == {300}
