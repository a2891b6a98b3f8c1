"""mmfuse-bench positions: rope_index and the vision preprocessing (positions, rot_pos_emb, window index,
cu_seqlens) against the installed transformers' own functions, wall time including host work, the
device time of mmfuse's kernels, and the host syncs of each (torch.cuda.set_sync_debug_mode)."""

import statistics
import sys
import time
import warnings

import torch

import mmfuse
from .common import time_us
from .references import QWEN_IDS, hf5_get_rope_index, hf5_vision_utils, mixed_vision_grids, multimodal_batch


def _wall_us(fn, device, iters=20, warmup=3):
    """Median wall time of fn() through to the end of its GPU work (host work included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _syncs(fn, device):
    """Host syncs of one fn() call, as counted by torch.cuda.set_sync_debug_mode("warn"): its warnings
    reach Python (from Python-level calls) or stderr (from inside C++ ops); both are counted."""
    if device != "cuda":
        return None
    import os
    import tempfile
    torch.cuda.synchronize()
    needle = "called a synchronizing CUDA operation"
    with tempfile.TemporaryFile(mode="w+") as err, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return sum(needle in str(x.message) for x in w) + err.read().count(needle)


def _same(a, b):
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def _rope_index_rows(device, quick):
    B, L, n_img, n_vid = (8, 8192, 64, 8) if device == "cuda" else (2, 1024, 6, 2)
    c = multimodal_batch(B, L, n_img, n_vid, device=device, seed=7)
    args = (c["input_ids"], c["image_grid_thw"], c["video_grid_thw"], c["second_per_grid_ts"], c["attention_mask"])
    rows = []
    hf = hf5_get_rope_index()
    for mode in ("qwen", "hf5"):
        kw = dict(mode=mode, mm_token_type_ids=c["mm_token_type_ids"] if mode == "hf5" else None)
        ours = lambda: mmfuse.rope_index(*args, **kw)  # noqa: E731
        dev_us, _ = time_us(ours, device, iters=10 if quick else 30)
        row = dict(case=f"rope_index {mode} B{B} L{L} {n_img} img + {n_vid} vid", device_us=dev_us,
                   wall_us=_wall_us(ours, device), syncs=_syncs(ours, device), hf_wall_us=None, hf_syncs=None,
                   verified="")
        if mode == "hf5" and hf is not None:
            theirs = lambda: hf(input_ids=c["input_ids"], mm_token_type_ids=c["mm_token_type_ids"],  # noqa: E731
                                image_grid_thw=c["image_grid_thw"], video_grid_thw=c["video_grid_thw"],
                                second_per_grid_ts=c["second_per_grid_ts"], attention_mask=c["attention_mask"])
            want = theirs()
            got = ours()
            row.update(hf_wall_us=_wall_us(theirs, device, iters=3 if quick else 5, warmup=1),
                       hf_syncs=_syncs(theirs, device),
                       verified="exact" if _same(got, (want[0], want[1].reshape(-1, 1))) else "FAIL")
        rows.append(row)
    return rows


def _vision_rows(device, quick):
    n = 256 if device == "cuda" else 16
    grid = mixed_vision_grids(n, seed=3)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 20, 2, dtype=torch.float) / 20))).to(device)
    vu = hf5_vision_utils()
    dgrid = grid.to(device)
    m, ws, ps = 2, 112, 14

    def ours(g):
        w = mmfuse.window_index(g, m, ws, ps, device=device)
        return w.window_index, w.cu_window_seqlens, w.reverse_index, w.cu_seqlens, \
            mmfuse.vision_positions(g, m, device=device), mmfuse.rot_pos_emb(inv_freq, g, m)

    def theirs():
        idx, cu = vu.get_vision_window_index(dgrid, m, ws, ps)
        pos = vu.get_vision_position_ids(dgrid, m)
        freqs = pos[..., None].float() * inv_freq
        return idx, cu, torch.argsort(idx), vu.get_vision_cu_seqlens(dgrid), pos, \
            torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)

    rows = []
    # the processor's host grid (no sync); a device grid copied to the host once (one sync)
    for label, f in (("host grid_thw", lambda: ours(grid)), ("device grid_thw, one .cpu()", lambda: ours(dgrid.cpu()))):
        dev_us, _ = time_us(f, device, iters=10 if quick else 30)
        row = dict(case=f"vision {n} images, {label}", device_us=dev_us, wall_us=_wall_us(f, device),
                   syncs=_syncs(f, device), hf_wall_us=None, hf_syncs=None, verified="")
        if vu is not None:
            row.update(hf_wall_us=_wall_us(theirs, device, iters=3 if quick else 5, warmup=1),
                       hf_syncs=_syncs(theirs, device), verified="exact" if _same(f(), theirs()) else "FAIL")
        rows.append(row)
    return rows


def run(device: str, quick: bool = False) -> dict:
    try:
        import transformers
        version = transformers.__version__
    except ImportError:
        version = "(not installed: no baseline)"
    rows = _rope_index_rows(device, quick) + _vision_rows(device, quick)
    print(f"\n## positions (against transformers {version}; wall = host work + GPU work, "
          f"synchronized; speedup = transformers wall / mmfuse wall)")
    hdr = (f"| {'case':<44} | {'device us':>9} | {'wall us':>9} | {'HF wall us':>10} | {'speedup':>8} | "
           f"{'syncs':>5} | {'HF syncs':>8} | verified |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        hf = f"{r['hf_wall_us']:10.0f}" if r["hf_wall_us"] else " " * 10
        sp = f"{r['hf_wall_us'] / r['wall_us']:7.0f}x" if r["hf_wall_us"] else " " * 8
        sy = "" if r["syncs"] is None else str(r["syncs"])
        hs = "" if r["hf_syncs"] is None else str(r["hf_syncs"])
        print(f"| {r['case']:<44} | {r['device_us']:9.1f} | {r['wall_us']:9.1f} | {hf} | {sp} | {sy:>5} | {hs:>8} | "
              f"{r['verified']:<8} |")
    return dict(rows=rows, all_verified=all(r["verified"] != "FAIL" for r in rows))
