"""`embcache bench shuffle`: the randomness ChunkShuffleSampler trades, against a uniform shuffle."""

from __future__ import annotations

import json

import pytest

from lightning_embcache import cli


@pytest.mark.bench
def test_chunked_orders_trade_randomness_as_measured(tmp_path):
    """On data stored class by class, batches of a narrow window see fewer classes and their
    gradients spread wider than a uniform shuffle's; store ids given in a random order make the
    same window as good as uniform; no shuffle is the worst. Every order visits each sample once
    (the benchmark asserts it)."""
    out = tmp_path / "s.json"
    assert cli.main(["bench", "shuffle", "--samples", "40000", "--chunk-rows", "500", "--windows", "2,40",
                     "--seeds", "1", "--json", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    uniform, narrow, wide = s["uniform"], s["chunks W=2"], s["chunks W=40"]
    mixed, none = s["chunks W=2, random ids"], s["sequential"]
    assert uniform["gradient_spread_vs_uniform"] == 1.0 and uniform["classes_per_batch"] == 10
    assert narrow["classes_per_batch"] < 3 and narrow["gradient_spread_vs_uniform"] > 5
    assert 1 < wide["gradient_spread_vs_uniform"] < narrow["gradient_spread_vs_uniform"]
    assert mixed["classes_per_batch"] == 10 and mixed["gradient_spread_vs_uniform"] < 1.3
    assert none["test_accuracy"] < narrow["test_accuracy"] <= uniform["test_accuracy"] + 0.02
