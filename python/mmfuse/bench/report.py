"""``mmfuse-bench report``: turns committed benchmark results (``docs/results/*.json``, the output of
``mmfuse-bench --json`` on a GPU) into ``docs/benchmarks.md``: one current table per family and
result file, and PNG plots (matplotlib) next to it. Nothing here measures; it only reads data."""

import glob
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

_FAMILIES = ("train", "model", "rope", "positions", "moe", "gemm", "fp8", "rms_norm", "swiglu", "linear_cross_entropy",
             "seed")


def _f(v, fmt: str = "{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def _row_name(r: dict) -> str:
    return r.get("name") or r.get("case") or ""


# ---- each family's table: (title, header, rows, plot) --------------------------------------------
# A plot is (title, x label, [(label, value)]) drawn as horizontal bars, or None.

Plot = Optional[Tuple[str, str, List[Tuple[str, float]]]]


def _bandwidth(fam: str, res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    """rope and moe: achieved bandwidth as % of the copy ceiling measured in the same run."""
    copy = res.get("copy_gbs")
    header = ["case", "µs", "GB/s", "% of copy", "speedup", "verified"]
    rows, bars = [], []
    for r in res.get("rows", []):
        gbs = r["nbytes"] / (r["us"] * 1e-6) / 1e9 if r.get("nbytes") else None
        pct = 100 * gbs / copy if gbs and copy else None
        sp = f"{r['baseline_us'] / r['us']:.2f}x {r.get('baseline', '')}".strip() if r.get("baseline_us") else ""
        rows.append([_row_name(r), _f(r["us"]), _f(gbs, "{:.0f}"), _f(pct), sp, r.get("verified", "")])
        if pct is not None and r.get("verified") not in ("", None, "-"):
            bars.append((_row_name(r), pct))
    return header, rows, (f"{fam}: mmfuse's bandwidth, % of the copy ceiling", "% of copy", bars)


def _positions(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    header = ["case", "device µs", "wall µs", "HF wall µs", "speedup", "syncs", "HF syncs", "verified"]
    rows, bars = [], []
    for r in res.get("rows", []):
        sp = r["hf_wall_us"] / r["wall_us"] if r.get("hf_wall_us") else None
        rows.append([r["case"], _f(r["device_us"]), _f(r["wall_us"]), _f(r.get("hf_wall_us"), "{:.0f}"),
                     _f(sp, "{:.0f}x"), _f(r.get("syncs"), "{}"), _f(r.get("hf_syncs"), "{}"), r.get("verified", "")])
        if sp:
            bars.append((r["case"], sp))
    return header, rows, ("positions: speedup over transformers (wall time)", "x transformers", bars)


def _gemm(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    header = ["case", "GEMM", "µs", "2x cuBLAS µs", "TFLOP/s", "% of ideal", "speedup", "verified"]
    rows, bars = [], []
    for r in res.get("rows", []):
        rows.append([r["case"], r["gemm"], _f(r["us"]), _f(r.get("two_cublas_us")), _f(r.get("tflops"), "{:.0f}"),
                     _f(r.get("pct_ideal")), _f(r.get("speedup"), "{:.2f}x"), r.get("verified", "")])
        if r.get("pct_ideal") is not None:
            bars.append((f"{r['case'].split(':')[0]} {r['gemm']}", r["pct_ideal"]))
    return header, rows, ("dual GEMM: % of ideal (both products at cuBLAS's rate on the big one)", "% of ideal", bars)


def _fp8(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    header = ["shape (M x K x N)", "pass", "bf16 µs", "mmfuse µs", "share of bf16", "delayed", "auto", "cached w",
              "torch fp8 compiled", "verified"]
    rows, bars = [], []
    for r in res.get("rows", []):
        rows.append([r["shape"], r["pass_"], _f(r["bf16_us"]), _f(r["us"]), _f(r["share"], "{:.2f}"),
                     _f(r.get("delayed_share"), "{:.2f}"), _f(r.get("auto_share"), "{:.2f}"),
                     _f(r.get("cached_share"), "{:.2f}"), _f(r.get("torch_compiled_share"), "{:.2f}"),
                     r.get("verified", "")])
        share = r.get("auto_share") or r.get("share")
        if r["pass_"] == "fwd+bwd" and share is not None:
            bars.append((r["shape"], share))
    for q in res.get("quantize", []):
        rows.append([q.get("case") or f"quantize 16384x8192, {q['mode']}", "", "", _f(q["us"]), "", "", "", "", "",
                     "bitwise" if q.get("verified") else "FAIL"])
    return header, rows, ("fp8 linear: fwd+bwd time as a share of bf16 (Fp8Linear as shipped; < 1 is faster)",
                          "share of bf16 time", bars)


def _variant_rows(res: dict, key: str, fmt: str, rows: list, bars: list) -> None:
    """The training-step table's variant rows (the column ``key`` in ``fmt`` is the one train and model
    differ in) and their bars, appended."""
    for r in res.get("rows", []):
        if "loss_last" not in r:  # a variant that failed
            rows.append([r["variant"], "", "", "", "", "", "", "", "", r.get("verified", "")])
            continue
        rows.append([r["variant"], _f(r.get("ms"), "{:.2f}"), _f(r.get("tokens_per_s"), "{:.0f}"),
                     _f(r.get("vs_eager"), "{:.2f}x"), _f(r.get("vs_compiled"), "{:.2f}x"), _f(r.get("peak_gib"), "{:.2f}"),
                     _f(r.get(key), fmt), _f(r.get("grad_err"), "{:.1e}"),
                     f"{r['loss_last']:.5f} ({r['loss_rel']:.1e})", r.get("verified", "")])
        if r.get("ms") is not None:
            bars.append((r["variant"], r["ms"]))


def _train(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    c = res.get("config", {})
    header = ["variant", "ms/step", "tokens/s", "vs PyTorch eager", "vs PyTorch compiled", "peak extra GiB",
              "x bound", "grad error", f"loss after {c.get('steps', '?')} steps (rel)", "verified"]
    rows, bars = [], []
    for key, label in (("bound_ms", "bound: the step's GEMMs + attention alone"),
                       ("bound_fp8_ms", "bound, with the fp8 model's GEMMs in fp8")):
        if res.get(key):
            rows.append([label, _f(res[key], "{:.2f}"), "", "", "", "", "1.00", "", "", ""])
            bars.append((label.split(":")[0], res[key]))
    _variant_rows(res, "x_bound", "{:.2f}", rows, bars)
    eb = res.get("expert_block")
    if eb:  # one layer's experts alone, forward + backward
        rows.append([f"one layer's expert block: bf16 {eb['bf16_ms']:.2f} ms, fp8 {eb['fp8_ms']:.2f} ms",
                     _f(eb["fp8_ms"], "{:.2f}"), "", "", "", "", "", "", f"fp8 / bf16 {eb['fp8_share']:.2f}", ""])
    title = (f"train: ms a step, preset {c.get('preset')} ({c.get('layers')} layers), batch {c.get('batch')} x "
             f"{c.get('seq')}, {c.get('action')} action tokens a sample")
    return header, rows, (title, "ms / step", bars)


def _model(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    c = res.get("config", {})
    header = ["variant", "ms/step", "tokens/s", "vs transformers eager", "vs transformers compiled", "peak extra GiB",
              "memory vs eager", "grad error", f"loss after {c.get('steps', '?')} steps (rel)", "verified"]
    rows, bars = [], []
    _variant_rows(res, "mem_vs_eager", "{:.2f}x", rows, bars)
    title = (f"model: Qwen2.5-VL training step, {c.get('preset')} shapes, {c.get('layers')} text layers, vision depth "
             f"{c.get('vision_depth')}, batch {c.get('batch')} x {c.get('seq')}")
    return header, rows, (title, "ms / step", bars)


def _lce(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    header = ["variant", "ms (fwd + bwd)", "x bound", "peak extra GiB", "loss", "verified"]
    rows = [[r["name"], _f(r.get("us") and r["us"] / 1e3, "{:.2f}"), _f(r.get("x_bound"), "{:.2f}"),
             _f(r.get("peak_gib"), "{:.2f}"), _f(r.get("loss"), "{:.5f}"), r.get("verified", "")]
            for r in res.get("rows", [])]
    bars = [(r["name"], r["peak_gib"]) for r in res.get("rows", []) if r.get("peak_gib") is not None]
    return header, rows, ("linear cross-entropy: peak extra memory of forward + backward", "GiB", bars)


def _seed(res: dict) -> Tuple[List[str], List[List[str]], Plot]:
    header = ["case", "µs", "speedup", "verified"]
    rows, bars = [], []
    for r in res.get("rows", []):
        sp = r["baseline_us"] / r["us"] if r.get("baseline_us") else None
        rows.append([r["name"], _f(r["us"]), f"{sp:.2f}x {r.get('baseline', '')}" if sp else "", r.get("verified", "")])
        if sp:
            bars.append((r["name"], sp))
    return header, rows, ("seed API: the alternative's time / the seed call's", "speedup", bars)


_VIEWS: Dict[str, Callable[[dict], Tuple[List[str], List[List[str]], Plot]]] = {
    "rope": lambda res: _bandwidth("rope", res),
    "moe": lambda res: _bandwidth("moe", res),
    "rms_norm": lambda res: _bandwidth("rms_norm", res),
    "swiglu": lambda res: _bandwidth("swiglu", res),
    "positions": _positions,
    "gemm": _gemm,
    "fp8": _fp8,
    "train": _train,
    "model": _model,
    "linear_cross_entropy": _lce,
    "seed": _seed,
}


def _table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plot(plot: Plot, path: str) -> bool:
    """Horizontal bars of plot into path (PNG); False where there is nothing to draw."""
    if not plot or not plot[2]:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title, xlabel, bars = plot
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.2))
    labels = [b[0] for b in bars][::-1]
    values = [b[1] for b in bars][::-1]
    ax.barh(range(len(values)), values, color="#3b6ea5")
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}" if v < 10 else f" {v:.1f}" if v < 100 or "%" in xlabel else f" {v:.0f}",
                va="center", fontsize=6)
    if "transformers" in xlabel:
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _run_line(run: dict, h: dict) -> str:
    """Where a family's rows come from, where that is not the file's header (tools/merge-results keeps
    each family's run), and its note."""
    keys = ("commit", "date", "torch", "transformers")
    diff = ", ".join(f"{k} {run[k]}" for k in keys if run.get(k) and run.get(k) != h.get(k))
    parts = ([f"Measured at {diff}."] if diff else []) + ([run["note"]] if run.get("note") else [])
    return " ".join(parts) if parts else f"Measured at commit {run.get('commit', '?')}."


def _header_line(h: dict) -> str:
    keys = ("device", "driver", "torch", "cuda", "transformers", "commit", "date")
    return ", ".join(f"{k} {h[k]}" for k in keys if h.get(k))


def _summary_line(fam: str, res: dict) -> Optional[str]:
    """One headline of a family's results (ranges over its mmfuse rows)."""
    rows = [r for r in res.get("rows", []) if r.get("verified") not in (None, "", "-")]
    if not rows:
        return None

    def rng(vals, fmt):
        vals = [v for v in vals if v is not None]
        return "" if not vals else (fmt.format(min(vals)) if min(vals) == max(vals) else
                                    f"{fmt.format(min(vals))}-{fmt.format(max(vals))}")

    if fam in ("rope", "moe", "rms_norm", "swiglu") and res.get("copy_gbs"):
        pct = [100 * r["nbytes"] / (r["us"] * 1e-6) / 1e9 / res["copy_gbs"] for r in rows if r.get("nbytes")]
        sp = [r["baseline_us"] / r["us"] for r in rows if r.get("baseline_us")]
        return f"{rng(pct, '{:.0f}')} % of copy bandwidth" + (f"; {rng(sp, '{:.2f}')}x its baseline" if sp else "")
    if fam == "gemm":
        return (f"{rng([r.get('pct_ideal') for r in rows], '{:.0f}')} % of ideal; "
                f"{rng([r.get('speedup') for r in rows], '{:.2f}')}x two cuBLAS calls")
    if fam == "positions":
        sp = [r["hf_wall_us"] / r["wall_us"] for r in rows if r.get("hf_wall_us")]
        return f"{rng(sp, '{:.0f}')}x transformers' wall time, 0 host syncs" if sp else None
    if fam == "fp8":
        fb = [r for r in rows if r.get("pass_") == "fwd+bwd"]
        return f"fwd+bwd {rng([r.get('auto_share') or r.get('share') for r in fb], '{:.2f}')} of the bf16 time"
    if fam == "linear_cross_entropy":
        by = {r["name"]: r for r in rows}
        ours, eager, comp = (by.get(k) for k in ("mmfuse.linear_cross_entropy", "F.linear + cross_entropy, eager",
                                                  "same, torch.compile"))
        if ours and eager and comp and ours.get("us"):
            return (f"{comp['us'] / ours['us']:.2f}x compiled PyTorch's time, {ours['peak_gib'] / eager['peak_gib']:.3f}x "
                    f"eager PyTorch's peak memory")
        return None
    if fam == "train":
        by = {r["variant"]: r for r in rows}
        parts = []
        for v in ("mmfuse eager", "mmfuse compiled", "mmfuse eager fp8", "mmfuse compiled fp8"):
            r = by.get(v)
            if r and r.get("ms"):
                vc = f", {r['vs_compiled']:.2f}x PyTorch compiled" if r.get("vs_compiled") else ""
                parts.append(f"{v} {r['vs_eager']:.2f}x PyTorch eager{vc}, {r['mem_vs_eager']:.2f}x its peak memory")
        return "; ".join(parts) or None
    if fam == "seed":
        sp = [r["baseline_us"] / r["us"] for r in res.get("rows", []) if r.get("baseline_us") and "seed" in r["name"]]
        return f"seed calls at {rng(sp, '{:.2f}')}x their native or plain alternative" if sp else None
    if fam == "model":
        parts = []
        for r in rows:
            if r["variant"].startswith("mmfuse") and r.get("ms"):
                vc = f", {r['vs_compiled']:.2f}x transformers compiled" if r.get("vs_compiled") else ""
                parts.append(f"{r['variant']} {r['vs_eager']:.2f}x transformers eager{vc}, "
                             f"{r['mem_vs_eager']:.2f}x its peak memory")
        return "; ".join(parts) or None
    return None


def readme_summary(results_dir: str, plots_rel: str = "docs/plots") -> str:
    """The README's results section body: a table of each GPU's headline per family, and one plot."""
    files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    if not files:
        return ("No benchmark results are committed yet: run `tools/gpu-check` on a GPU, merge its `bench.json` into "
                "`docs/results/<gpu>.json` (`tools/merge-results`) and run `mmfuse-bench report`.")
    lines = ["| GPU | family | result |", "|---|---|---|"]
    plot = None
    for path in files:
        with open(path) as f:
            data = json.load(f)
        gpu = data.get("header", {}).get("device", _stem(path))
        for fam in _FAMILIES:
            if fam in data:
                line = _summary_line(fam, data[fam])
                if line:
                    lines.append(f"| {gpu} | {fam} | {line} |")
                    if plot is None:
                        plot = f"{plots_rel}/{_stem(path)}-{fam}.png"
    if plot:
        lines += ["", f"![{plot}]({plot})"]
    return "\n".join(lines)


def update_readme(readme: str, results_dir: str) -> bool:
    """Replaces the text between the README's results markers; False where it has none."""
    begin, end = "<!-- results: generated by mmfuse-bench report -->", "<!-- /results -->"
    with open(readme) as f:
        text = f.read()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(readme, "w") as f:
        f.write(head + begin + "\n" + readme_summary(results_dir) + "\n" + end + tail)
    return True


def render(results_dir: str, out_md: str, plots_dir: Optional[str] = None) -> List[str]:
    """Writes out_md (and the plots, in plots_dir: default <out_md's folder>/plots) from every
    results_dir/*.json; returns the paths written."""
    files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    plots_dir = plots_dir or os.path.join(os.path.dirname(out_md) or ".", "plots")
    os.makedirs(plots_dir, exist_ok=True)
    written = []
    md = ["# Benchmarks", "",
          "Generated by `mmfuse-bench report` from the committed results in "
          f"`{os.path.relpath(results_dir, os.path.dirname(out_md) or '.')}/` (each the output of "
          "`mmfuse-bench --json` on one GPU). Do not edit by hand: run the benchmark on a GPU, commit its "
          "JSON, regenerate. Ratios are measured side by side in one run; absolute times vary between "
          "machines. The reasoning behind each kernel is in `design/`.", ""]
    if not files:
        md += ["No results are committed yet: run `tools/gpu-check` on a GPU (it writes `bench.json`), merge the file "
               "into `docs/results/<gpu>.json` (`tools/merge-results`) and run `mmfuse-bench report`.", ""]
    for path in files:
        with open(path) as f:
            data = json.load(f)
        h = data.get("header", {})
        md += [f"## {h.get('device', _stem(path))}", "", _header_line(h) + ".", ""]
        for fam in _FAMILIES:
            if fam not in data:
                continue
            header, rows, plot = _VIEWS[fam](data[fam])
            md += [f"### {fam}", ""]
            png = os.path.join(plots_dir, f"{_stem(path)}-{fam}.png")
            if _plot(plot, png):
                written.append(png)
                md += [f"![{fam}]({os.path.relpath(png, os.path.dirname(out_md) or '.')})", ""]
            md += [_table(header, rows), ""]
            run = data[fam].get("run")
            if run:
                md += [_run_line(run, h), ""]
    with open(out_md, "w") as f:
        f.write("\n".join(md))
    written.append(out_md)
    return written
