"""Timing and reporting helpers of the benchmark CLI: CUDA events, medians, the copy ceiling, tables."""

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch


def time_us(fn: Callable[[], object], device: str, warmup: int = 5, iters: int = 30) -> tuple:
    """Median and (max - min) spread in microseconds of fn(): device time on the GPU.

    On the GPU each sample is fn() between two CUDA events, queued behind a sleep kernel (at least
    ~0.5 ms, and twice the shortest host time of a warm-up call) so that the host has enqueued all of
    fn's launches before the GPU reaches them: the sample is the GPU time of fn's kernels, without
    the host's launch latency (reported separately as host overhead). On the CPU it is wall time.
    """
    cycles = _warm_up(fn, device, warmup)
    times = [_sample(fn, device, cycles) for _ in range(iters)]
    return statistics.median(times), max(times) - min(times)


def time_us_interleaved(fns: Sequence[Callable[[], object]], device: str, warmup: int = 3, rounds: int = 5) -> list:
    """``time_us`` of several fns sampled in turn (fn 0, fn 1, ..., then again): a drift of the card's
    clock or temperature over the run falls on every fn alike, so the ratios between them hold.
    Returns ``[(median, spread)]`` in microseconds, in the order of ``fns``."""
    cycles = [_warm_up(fn, device, warmup) for fn in fns]
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, c, t in zip(fns, cycles, times):
            t.append(_sample(fn, device, c))
    return [(statistics.median(t), max(t) - min(t)) for t in times]


def _warm_up(fn: Callable[[], object], device: str, warmup: int) -> int:
    """Runs fn `warmup` times; returns the sleep (cycles) that outlasts the host's enqueueing of fn
    twice over (about 2000 cycles a microsecond), at least ~0.5 ms."""
    host = float("inf")
    for _ in range(max(1, warmup)):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host = min(host, time.perf_counter() - t)
    return max(1_000_000, int(2 * host * 1e6 * 2000))


def _sample(fn: Callable[[], object], device: str, cycles: int) -> float:
    """One timed call of fn in microseconds (see time_us)."""
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


@contextlib.contextmanager
def path_override(name: str, value: Optional[str]):
    """A CUDA path choice forced inside the block (``name``: MMFUSE_MOE_PLAN, MMFUSE_MOE_PLAN_HIST,
    MMFUSE_MOE_BWD, MMFUSE_RMS_NORM_BWD or MMFUSE_LCE_GRAD; None or "auto": the automatic rule), then
    back to auto."""
    torch.ops.mmfuse._set_path_override(name, value or "auto")
    try:
        yield
    finally:
        torch.ops.mmfuse._set_path_override(name, "auto")


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy ceiling, bytes read + written, in GB/s."""
    if device != "cuda":
        nbytes = 1 << 26
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t, _ = time_us(lambda: dst.copy_(src), device, warmup=3, iters=20)
    return 2 * nbytes / (t * 1e-6) / 1e9


@dataclass
class Row:
    name: str
    us: float
    spread: float
    nbytes: Optional[int] = None
    baseline_us: Optional[float] = None
    baseline: str = ""
    verified: str = ""
    extra: dict = field(default_factory=dict)


def print_table(title: str, rows: List[Row], copy_gbs: Optional[float]) -> None:
    print(f"\n## {title}")
    hdr = f"| {'case':<46} | {'us':>9} | {'+-':>6} | {'GB/s':>7} | {'% copy':>6} | {'speedup':>16} | verified |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        gbs = r.nbytes / (r.us * 1e-6) / 1e9 if r.nbytes else None
        pct = f"{100 * gbs / copy_gbs:6.1f}" if gbs and copy_gbs else " " * 6
        sp = f"{r.baseline_us / r.us:5.2f}x {r.baseline:<9}" if r.baseline_us else ""
        gbs_s = f"{gbs:7.0f}" if gbs else " " * 7
        print(f"| {r.name:<46} | {r.us:9.1f} | {r.spread:6.1f} | {gbs_s} | {pct} | {sp:>16} | {r.verified:<8} |")


def run_bandwidth_family(family: str, title: str, shapes, rows_of, device: str, quick: bool) -> dict:
    """A memory-bound family's run: the copy ceiling, rows_of(*shape, device, quick) for each shape, the
    table, and a '% of copy' line for each mmfuse row (on the GPU)."""
    copy = copy_bandwidth_gbs(device)
    print(f"\ncopy bandwidth (read + write): {copy:.0f} GB/s")
    rows = [r for shape in shapes for r in rows_of(*shape, device, quick)]
    print_table(title, rows, copy)
    if device == "cuda":
        for r in rows:
            if "mmfuse" in r.name:
                print(f"{family} {r.name}: {100 * r.nbytes / (r.us * 1e-6) / 1e9 / copy:.1f}% of copy")
    return dict(copy_gbs=copy, rows=[r.__dict__ for r in rows],
                all_verified=all(not r.verified.startswith("FAIL") for r in rows))


def add_step_ratios(rows: List[dict], eager: str, compiled: str) -> None:
    """Sets vs_eager, vs_compiled (None without that variant) and mem_vs_eager on each timed training-step
    row, against the rows named ``eager`` and ``compiled``."""
    base = {r["variant"]: r for r in rows}
    for r in rows:
        r["vs_eager"] = base[eager]["ms"] / r["ms"]
        r["vs_compiled"] = base[compiled]["ms"] / r["ms"] if compiled in base else None
        r["mem_vs_eager"] = r["peak_gib"] / base[eager]["peak_gib"]


def verify_step_rows(rows: List[dict], failed: dict, tolerances) -> bool:
    """Marks each training-step row "close" or "FAIL" by ``tolerances(variant) -> (gradient error,
    relative loss)``, appends the variants that failed to run (``failed``: name -> reason), and returns
    whether every row is close."""
    for r in rows:
        grad_tol, loss_tol = tolerances(r["variant"])
        r["verified"] = "close" if r["grad_err"] <= grad_tol and r["loss_rel"] <= loss_tol else "FAIL"
    rows += [dict(variant=name, verified=why) for name, why in failed.items()]
    return all(r["verified"] == "close" for r in rows)


def print_step_table(rows: List[dict], steps: int, column: tuple, first: tuple = ()) -> None:
    """The training-step table of ``mmfuse-bench train`` / ``model``. ``column``: (title, key, format) of
    the one column the two differ in; ``first``: rows (label, ms, tokens/s, that column's value) above
    the variants (the bound rows)."""
    w = max([18] + [len(r["variant"]) for r in rows] + [len(f[0]) for f in first])
    title, key, fmt = column
    cw = max(8, len(title))
    hdr = (f"| {'variant':<{w}} | {'ms/step':>8} | {'tokens/s':>9} | {'vs eager':>8} | {'vs compiled':>11} | "
           f"{'peak GiB':>8} | {title:>{cw}} | {'grad err':>8} | loss after {steps} (rel) |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for label, ms, tps, value in first:
        print(f"| {label:<{w}} | {ms:8.2f} | {tps:9.0f} | {'':>8} | {'':>11} | {'':>8} | {fmt.format(value):>{cw}} | "
              f"{'':>8} | |")
    for r in rows:
        vc = f"{r['vs_compiled']:10.2f}x" if r["vs_compiled"] else f"{'-':>11}"
        print(f"| {r['variant']:<{w}} | {r['ms']:8.2f} | {r['tokens_per_s']:9.0f} | {r['vs_eager']:7.2f}x | {vc} | "
              f"{r['peak_gib']:8.2f} | {fmt.format(r[key]):>{cw}} | {r['grad_err']:8.1e} | "
              f"{r['loss_last']:.5f} ({r['loss_rel']:.1e}) |")
