"""The benchmark's timing helpers (python/mmfuse/bench/common.py), without timing anything: the
samples are replaced by fixed values."""

from mmfuse.bench import common


def test_paired_ratio_is_b_over_a_in_both_orders(monkeypatch):
    order = []

    def fake_sample(fn, device, cycles):
        order.append(fn.__name__)
        return {"a": 10.0, "b": 15.0}[fn.__name__]

    def a():
        pass

    def b():
        pass

    monkeypatch.setattr(common, "_sample", fake_sample)
    monkeypatch.setattr(common, "_warm_up", lambda fn, device, warmup: 0)
    ratio, (lo, hi) = common.paired_ratio(a, b, "cpu", iters=4)
    assert (ratio, lo, hi) == (1.5, 1.5, 1.5)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # alternating, so that drift cancels


def test_time_us_median_and_spread(monkeypatch):
    samples = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(common, "_sample", lambda fn, device, cycles: next(samples))
    monkeypatch.setattr(common, "_warm_up", lambda fn, device, warmup: 0)
    assert common.time_us(lambda: None, "cpu", iters=3) == (2.0, 2.0)
