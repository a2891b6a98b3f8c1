"""The benchmark CLI: its timing helpers (the samples replaced by fixed values), its CPU mode (agreement
only, no timings) and the report generated from result JSON."""

import os

from mmfuse.bench import common


def test_time_us_median_and_spread(monkeypatch):
    samples = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(common, "_sample", lambda fn, device, cycles: next(samples))
    monkeypatch.setattr(common, "_warm_up", lambda fn, device, warmup: 0)
    assert common.time_us(lambda: None, "cpu", iters=3) == (2.0, 2.0)


def test_cpu_run_checks_agreement_and_prints_no_timings(capsys):
    from mmfuse.bench.__main__ import main
    assert main(["gemm", "moe", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "no GPU: checking agreement" in out
    assert "speedup" not in out and " us" not in out and "GB/s" not in out and "% of copy" not in out
    assert "== moe: all outputs agree" in out
    assert out.rstrip().splitlines()[-1].startswith("mmfuse-bench agreement: PASS (gemm, moe;")


def test_report_renders_tables_and_plots(tmp_path):
    import json

    from mmfuse.bench.report import render
    results = tmp_path / "results"
    results.mkdir()
    data = {
        "header": {"device": "NVIDIA H100 80GB HBM3", "driver": "580", "torch": "2.11.0", "cuda": "13.0",
                   "commit": "abc", "date": "2026-01-01 00:00 UTC"},
        "moe": {"copy_gbs": 3000.0, "rows": [
            {"name": "T16k permute mmfuse", "us": 100.0, "spread": 1.0, "nbytes": 270_000_000, "baseline_us": 300.0,
             "baseline": "vs torch", "verified": "exact"},
            {"name": "T16k permute PyTorch", "us": 300.0, "spread": 1.0, "nbytes": 270_000_000, "verified": ""}]},
        "gemm": {"rows": [{"case": "large: a", "gemm": "fwd", "us": 10.0, "two_cublas_us": 10.1, "tflops": 700.0,
                           "pct_ideal": 99.0, "speedup": 1.01, "verified": "close"}]},
        "positions": {"rows": [{"case": "rope_index", "device_us": 70.0, "wall_us": 85.0, "hf_wall_us": 24000.0,
                                "syncs": 0, "hf_syncs": 337, "verified": "exact"}]},
    }
    (results / "h100.json").write_text(json.dumps(data))
    out = tmp_path / "benchmarks.md"
    written = render(str(results), str(out))
    md = out.read_text()
    assert "## NVIDIA H100 80GB HBM3" in md and "commit abc" in md
    assert "| T16k permute mmfuse | 100.0 | 2700 | 90.0 | 3.00x vs torch | exact |" in md
    assert "| large: a | fwd | 10.0 | 10.1 | 700 | 99.0 | 1.01x | close |" in md
    assert "| rope_index | 70.0 | 85.0 | 24000 | 282x | 0 | 337 | exact |" in md
    pngs = [p for p in written if p.endswith(".png")]
    assert sorted(os.path.basename(p) for p in pngs) == ["h100-gemm.png", "h100-moe.png", "h100-positions.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "![moe](plots/h100-moe.png)" in md
