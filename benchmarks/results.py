"""Where a benchmark's result file goes: one helper, so every benchmark writes it the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_plain))


def _plain(o: Any) -> Any:
    """numpy scalars (counters in stats) as plain numbers: json cannot write them."""
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
