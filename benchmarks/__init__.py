"""The benchmarks of lightning_embcache: run from a source checkout with ``embcache bench NAME``.

They are not part of the installed package. Importing this package puts the checkout's root on
``PYTHONPATH``, so the worker processes a benchmark starts (``python -m benchmarks.X``) find it."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if str(ROOT) not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([*_paths, str(ROOT)])
