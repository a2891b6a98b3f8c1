"""Timing and reporting helpers of the benchmark CLI: CUDA events, medians, the copy ceiling, tables."""

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

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


def paired_ratio(fn_a: Callable[[], object], fn_b: Callable[[], object], device: str, warmup: int = 5,
                 iters: int = 30) -> tuple:
    """time(fn_b) / time(fn_a) from `iters` pairs of samples (as time_us takes them) taken back to
    back, in alternating order: the median ratio and the (min, max) of the pairs' ratios. Drift
    between separate measurements (clocks, the machine) cancels within a pair, so a difference of a
    percent or two between two paths shows in one run."""
    ca, cb = _warm_up(fn_a, device, warmup), _warm_up(fn_b, device, warmup)
    ratios = []
    for i in range(iters):
        if i % 2 == 0:
            ta, tb = _sample(fn_a, device, ca), _sample(fn_b, device, cb)
        else:
            tb, ta = _sample(fn_b, device, cb), _sample(fn_a, device, ca)
        ratios.append(tb / ta)
    return statistics.median(ratios), (min(ratios), max(ratios))


@contextlib.contextmanager
def env(name: str, value: Optional[str]):
    """Environment variable `name` set to `value` (None: unset) inside the block: the CUDA backends
    read their path knobs (MMFUSE_DUAL_GEMM_PATH, _SCHEDULE, _EPILOGUE, MMFUSE_MOE_PLAN, _BWD, _UNPERMUTE)
    at every call."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


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
