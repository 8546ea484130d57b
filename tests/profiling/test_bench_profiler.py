"""`embcache bench profiler` runs end to end on a tiny setting and writes its JSON."""

import json

from lightning_embcache.cli import main as cli_main


def test_bench_profiler_quick_run_writes_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = cli_main(["bench", "profiler", "--reps", "1", "--models", "small", "--workers", "0",
                   "--configs", "step", "--batches", "30", "--warmup", "5", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert {r["config"] for r in res["runs"]} == {"none", "step"}
    agg = res["aggregate"]["small/workers=0"]
    # the true average and the phase sum agree with the reference callback's wall time
    assert agg["true_avg_vs_ref_wall_err_pct_max"] < 1.0
    assert agg["phase_sum_vs_ref_wall_err_pct_max"] < 2.0
    assert res["own_cost"]["own_us_per_step"] > 0
    assert "wrote" in capsys.readouterr().out
