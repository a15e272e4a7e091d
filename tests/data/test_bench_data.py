"""`python -m llm_jax.bench data --quick` writes its JSON: tokens/s and RSS for a generated
ArrayRecord corpus, and deletes the corpus afterwards."""

import json

from llm_jax.bench.__main__ import main


def test_bench_data_quick_writes_json_and_cleans_up(tmp_path, capsys):
    out = tmp_path / "data.json"
    scratch = tmp_path / "scratch"
    assert main(["data", "--quick", "--json_out", str(out), "--dir", str(scratch)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "data" and {"date", "load_average"} <= set(r["machine"])
    (row,) = r["rows"]
    assert row["tokens_per_s"] > 0 and row["batches"] > 0 and 0 < row["rss_main_mb"]
    assert row["rss_main_mb"] <= row["rss_total_mb"] and r["corpora"][0]["shards"] >= 2
    assert list(scratch.iterdir()) == []  # the generated corpus and workdir are gone
    assert "| generated 1 MB |" in capsys.readouterr().out
