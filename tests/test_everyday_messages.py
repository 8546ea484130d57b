"""Error messages a new user meets say what to do."""

from __future__ import annotations


def test_the_disk_full_error_says_what_to_do():
    import errno

    from lightning_embcache.store.errors import DiskFullError, io_error

    err = io_error(OSError(errno.ENOSPC, "No space left on device"), "writing", "/runs/latents/seg-000012")
    assert isinstance(err, DiskFullError) and err.filename == "/runs/latents/seg-000012"
    msg = str(err)
    assert "/runs/latents/seg-000012" in msg and "previous version is intact" in msg
    assert "fewer checkpoints" in msg and "embcache compact" in msg and "troubleshooting" in msg
