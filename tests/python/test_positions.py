"""The position family against its oracles: rope_index modes qwen and hf4 against the golden fixtures
of transformers 4.49 / 4.57 (tools/make_rope_index_fixtures.py) and the contract's reference, mode hf5
and the vision ops against the installed transformers 5.x itself; CPU and CUDA, exactly; opcheck,
torch.compile, CUDA graphs, no host syncs, bad input; the seed-compatible backend functions."""

import os
import subprocess
import sys

import pytest
import torch

import mmfuse
from mmfuse import backend
from mmfuse.bench.references import (QWEN_IDS, hf5_get_rope_index, hf5_vision_utils, mixed_vision_grids,
                                     multimodal_batch, rope_index_reference)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
HF5 = hf5_get_rope_index()
VU = hf5_vision_utils()
needs_hf5 = pytest.mark.skipif(HF5 is None or VU is None, reason="needs transformers 5.x")

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


@pytest.mark.parametrize("mode,release", [("qwen", "4.49"), ("hf4", "4.57")])
def test_reference_matches_release_fixtures(mode, release):
    fx = torch.load(os.path.join(FIXTURES, f"rope_index_{mode}.pt"), weights_only=False)
    assert fx["mode"] == mode and fx["transformers"].startswith(release)
    ids = fx["ids"]
    for i, c in enumerate(fx["cases"]):
        pos, delta = rope_index_reference(mode, c["input_ids"], c["attention_mask"], c["image_grid_thw"],
                                          c["video_grid_thw"], c["second_per_grid_ts"], fx["spatial_merge_size"],
                                          ids["image_token_id"], ids["video_token_id"],
                                          ids["vision_start_token_id"], fx["tokens_per_second"])
        assert torch.equal(pos, c["position_ids"].long()), f"case {i}: positions"
        assert torch.equal(delta, c["deltas"]), f"case {i}: deltas"


def test_fixtures_tell_the_modes_apart():
    q = torch.load(os.path.join(FIXTURES, "rope_index_qwen.pt"), weights_only=False)
    h = torch.load(os.path.join(FIXTURES, "rope_index_hf4.pt"), weights_only=False)
    differ = sum(not torch.equal(a["position_ids"], b["position_ids"]) for a, b in zip(q["cases"], h["cases"]))
    assert differ > 0  # fractional second_per_grid_ts: qwen multiplies in fp32, hf4 truncates first


def test_hand_worked_case():
    # [text, text, <vs>, img x 4 (grid 1x4x4, merge 2 -> 2x2), <ve>, text], left padding of 1
    V, I, E = 9, 7, 8
    ids = torch.tensor([[0, 5, 5, V, I, I, I, I, E, 5]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    pos, delta = rope_index_reference("qwen", ids, mask, torch.tensor([[1, 4, 4]]), None, None, 2, I, 6, V, 2)
    # text 0, 1, vs 2; image at base 3: t 3,3,3,3  h 3,3,4,4  w 3,4,3,4; then ve 5, text 6 (max 4 + 1)
    assert pos[:, 0].tolist() == [[1, 0, 1, 2, 3, 3, 3, 3, 5, 6],
                                  [1, 0, 1, 2, 3, 3, 4, 4, 5, 6],
                                  [1, 0, 1, 2, 3, 4, 3, 4, 5, 6]]
    assert delta.tolist() == [[6 + 1 - 10]]


def _fixture_cases(mode):
    fx = torch.load(os.path.join(FIXTURES, f"rope_index_{mode}.pt"), weights_only=False)
    return fx, fx["cases"]


def _to(c, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in c.items()}


def _op(c, mode, **kw):
    return mmfuse.rope_index(c["input_ids"], c.get("image_grid_thw"), c.get("video_grid_thw"),
                             c.get("second_per_grid_ts"), c.get("attention_mask"), mode=mode, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["qwen", "hf4"])
def test_op_matches_release_fixtures(mode, device):
    fx, cases = _fixture_cases(mode)
    ids = fx["ids"]
    for i, c in enumerate(cases):
        c = _to(c, device)
        pos, delta = _op(c, mode, spatial_merge_size=fx["spatial_merge_size"], image_token_id=ids["image_token_id"],
                         video_token_id=ids["video_token_id"], vision_start_token_id=ids["vision_start_token_id"],
                         tokens_per_second=fx["tokens_per_second"])
        assert pos.device.type == device
        assert torch.equal(pos.cpu(), c["position_ids"].long().cpu()), f"case {i}: positions"
        assert torch.equal(delta.cpu(), c["deltas"].cpu()), f"case {i}: deltas"


def _types_of(c):
    ids = c["input_ids"]
    return ((ids == QWEN_IDS["image_token_id"]).long() + 2 * (ids == QWEN_IDS["video_token_id"]).long()) * \
        c["attention_mask"]


@needs_hf5
@pytest.mark.parametrize("device", DEVICES)
def test_hf5_equals_installed_transformers(device):
    # the fixture inputs (both files: 96 cases) plus model-size batches, against transformers' own code
    cases = [dict(c) for mode in ("qwen", "hf4") for c in _fixture_cases(mode)[1]]
    for c in cases:
        c["mm_token_type_ids"] = _types_of(c)
        c.pop("position_ids"), c.pop("deltas"), c.pop("left_padding")
    cases += [multimodal_batch(4, 2048, 12, 6, seed=s) for s in range(3)]
    for i, c in enumerate(cases):
        want_pos, want_delta = HF5(input_ids=c["input_ids"], mm_token_type_ids=c["mm_token_type_ids"],
                                   image_grid_thw=c["image_grid_thw"], video_grid_thw=c["video_grid_thw"],
                                   second_per_grid_ts=c["second_per_grid_ts"], attention_mask=c["attention_mask"])
        d = _to(c, device)
        pos, delta = _op(d, "hf5", mm_token_type_ids=d["mm_token_type_ids"])
        assert torch.equal(pos.cpu(), want_pos), f"case {i}: positions"
        assert torch.equal(delta.cpu(), want_delta.reshape(-1, 1)), f"case {i}: deltas"


@needs_gpu
@pytest.mark.parametrize("mode", ["qwen", "hf4", "hf5"])
def test_cuda_equals_cpu_at_model_size(mode):
    c = multimodal_batch(8, 8192, 64, 8, seed=3)
    want = _op(c, mode, mm_token_type_ids=c["mm_token_type_ids"])
    d = _to(c, "cuda")
    got = _op(d, mode, mm_token_type_ids=d["mm_token_type_ids"])
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    if mode == "qwen":  # and the contract's reference
        ref = rope_index_reference("qwen", c["input_ids"], c["attention_mask"], c["image_grid_thw"],
                                   c["video_grid_thw"], c["second_per_grid_ts"], 2, QWEN_IDS["image_token_id"],
                                   QWEN_IDS["video_token_id"], QWEN_IDS["vision_start_token_id"], 2.0)
        assert torch.equal(want[0], ref[0]) and torch.equal(want[1], ref[1])


@needs_gpu
def test_cuda_graph_capture_and_no_host_sync():
    c = _to(multimodal_batch(4, 4096, 16, 4, seed=1), "cuda")
    args = (c["input_ids"], c["image_grid_thw"], c["video_grid_thw"], c["second_per_grid_ts"], c["attention_mask"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pos, delta = mmfuse.rope_index(*args)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mmfuse.rope_index(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gpos, gdelta = mmfuse.rope_index(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gpos, pos) and torch.equal(gdelta, delta)
    # the graph reads its inputs at replay: mask out row 1's first valid token, replay, compare
    first = int((c["attention_mask"][1] == 1).nonzero()[0])
    c["attention_mask"][1, first] = 0
    want_pos, want_delta = mmfuse.rope_index(*args)
    assert not torch.equal(want_pos, pos)
    gpos.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gpos, want_pos) and torch.equal(gdelta, want_delta)


def test_op_opcheck_and_compile():
    fx, cases = _fixture_cases("qwen")
    c = next(c for c in cases if c["video_grid_thw"] is not None and c["image_grid_thw"] is not None)
    ids = fx["ids"]
    for device in DEVICES:
        d = _to(c, device)
        args = (d["input_ids"], d["image_grid_thw"], d["video_grid_thw"], d["second_per_grid_ts"],
                d["attention_mask"], 2, ids["image_token_id"], ids["video_token_id"], ids["vision_start_token_id"],
                2.0, "qwen", None)
        torch.library.opcheck(torch.ops.mmfuse.rope_index.default, args)
        f = torch.compile(lambda *a: mmfuse.rope_index(*a[:5], image_token_id=ids["image_token_id"],
                                                       video_token_id=ids["video_token_id"],
                                                       vision_start_token_id=ids["vision_start_token_id"]),
                          fullgraph=True)
        pos, delta = f(*args[:5])
        assert torch.equal(pos.cpu(), c["position_ids"].long()) and torch.equal(delta.cpu(), c["deltas"])


def test_op_bad_input_raises_value_error():
    ids = torch.tensor([[5, 151652, 151655, 5]])
    with pytest.raises(ValueError, match="more image spans than image_grid_thw rows"):
        mmfuse.rope_index(ids, torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        mmfuse.rope_index(ids, torch.tensor([[1, 3, 2]]))
    with pytest.raises(ValueError, match="mode"):
        mmfuse.rope_index(ids, torch.tensor([[1, 2, 2]]), mode="hf9")
    with pytest.raises(ValueError, match="mode hf5 needs mm_token_type_ids"):
        mmfuse.rope_index(ids, torch.tensor([[1, 2, 2]]), mode="hf5")
    with pytest.raises(ValueError, match="image_grid_thw: expected dtype int32 or int64"):
        mmfuse.rope_index(ids, torch.tensor([[1.0, 2, 2]]))
    vids = torch.tensor([[5, 151652, 151656, 151656, 5]])
    for mode in ("qwen", "hf4"):
        for bad in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match=r"second_per_grid_ts\[0\] = .*: expected a finite value in \[0, 2\^31\)"):
                mmfuse.rope_index(vids, None, torch.tensor([[2, 2, 2]]), torch.tensor([bad]), mode=mode)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="image_grid_thw: expected device cuda:0"):
            mmfuse.rope_index(ids.cuda(), torch.tensor([[1, 2, 2]]))


_DEVICE_ERRORS = [
    ("[[5, 151652, 151655, 5]]", "torch.zeros(0, 3, dtype=torch.long)", "more image spans than image_grid_thw rows"),
    ("[[5, 151652, 151655, 151655]]", "[[1, 4, 4]]", "is shorter than its grid"),
    ("[[5, 151652, 151655, 5]]", "[[1, 3, 2]]", "divisible by spatial_merge_size 2"),
    ("[[5, 5, 5, 151652]]", "[[1, 2, 2]]", "vision start token is the last valid token"),
    ("[[5, 151652, 151656, 151656, 5]]", "None, torch.tensor([[2, 2, 2]]).cuda(), torch.tensor([float('nan')])",
     "second_per_grid_ts[0] = nan: expected a finite value in [0, 2^31)"),
]


@needs_gpu
@pytest.mark.parametrize("ids,grid,message", _DEVICE_ERRORS)
def test_cuda_bad_input_stops_with_a_message(ids, grid, message):
    # a device-side assertion ends the CUDA context: run it in a child process
    code = ("import torch, mmfuse\n"
            f"g = {grid}\ng = g if isinstance(g, tuple) else (g if isinstance(g, torch.Tensor) else torch.tensor(g),)\n"
            "g = [t.cuda() if isinstance(t, torch.Tensor) else t for t in g]\n"
            f"p, d = mmfuse.rope_index(torch.tensor({ids}).cuda(), *g)\n"
            "torch.cuda.synchronize()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, r.stdout + r.stderr


# ---- vision ----

@needs_hf5
@pytest.mark.parametrize("device", DEVICES)
def test_vision_ops_equal_transformers(device):
    grid = torch.cat([mixed_vision_grids(120, seed=4),
                      torch.tensor([[3, 16, 32], [2, 8, 8], [1, 82, 242], [1, 2, 2], [4, 24, 94], [2, 8, 110]])])
    m, ws, ps = 2, 112, 14
    for g in (grid, grid.to(device)):  # a host grid (no sync) or one on the device (one copy)
        w = mmfuse.window_index(g, m, ws, ps, device=device)
        ref_idx, ref_cu = VU.get_vision_window_index(grid, m, ws, ps)
        assert w.window_index.device.type == device and w.cu_window_seqlens.dtype == torch.int32
        assert torch.equal(w.window_index.cpu(), ref_idx.long()) and torch.equal(w.cu_window_seqlens.cpu(), ref_cu)
        assert torch.equal(w.reverse_index.cpu(), torch.argsort(ref_idx))
        assert torch.equal(w.cu_seqlens.cpu(), VU.get_vision_cu_seqlens(grid))
        assert w.cu_window_seqlens.numel() > 1000
        sizes = (ref_cu[1:] - ref_cu[:-1])
        assert w.max_window_seqlen == int(sizes.max()) and w.max_seqlen == int((grid[:, 1] * grid[:, 2]).max())
        pos = mmfuse.vision_positions(g, m, device=device)
        ref_pos = VU.get_vision_position_ids(grid, m)
        assert pos.device.type == device and torch.equal(pos.cpu(), ref_pos)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 20, 2, dtype=torch.float) / 20))
    ang = mmfuse.rot_pos_emb(inv_freq.to(device), grid.to(device), m)
    ref = (ref_pos[..., None].float() * inv_freq)  # HF 5.x: [N, 2, F], then h | w
    assert torch.equal(ang.cpu(), torch.cat([ref[:, 0], ref[:, 1]], dim=-1))


def test_vision_ops_opcheck_compile_and_bad_input():
    grid = torch.tensor([[1, 6, 10], [2, 8, 8]])
    for device in DEVICES:
        torch.library.opcheck(torch.ops.mmfuse.window_index.default, (grid, 2, 112, 14, torch.device(device)))
        torch.library.opcheck(torch.ops.mmfuse.vision_positions.default, (grid, 2, torch.device(device)))
        torch.library.opcheck(torch.ops.mmfuse.rot_pos_emb.default, (torch.rand(5, device=device), grid, 2))
    w = mmfuse.window_index(grid)
    assert w.cu_window_seqlens.tolist() == [0, 48, 60, 124, 188] and w.window_index.numel() == 47
    assert w.cu_seqlens.tolist() == [0, 60, 124, 188] and (w.max_seqlen, w.max_window_seqlen) == (64, 64)
    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        mmfuse.window_index(torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="expected shape \\[n, 3\\]"):
        mmfuse.window_index(torch.tensor([[1, 4]]))
    with pytest.raises(ValueError, match="inv_freq: expected float32"):
        mmfuse.rot_pos_emb(torch.rand(5, dtype=torch.float64), grid)
    f = torch.compile(lambda g: torch.ops.mmfuse.vision_positions(g, 2) + 1, fullgraph=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):  # its sizes come from grid's values
        assert torch.equal(f(grid), mmfuse.vision_positions(grid) + 1)


# ---- the seed's backend functions ----

@pytest.mark.parametrize("device", DEVICES)
def test_seed_backend_functions(device):
    c = _to(multimodal_batch(3, 700, 4, 2, seed=9), device)
    pos, delta = backend.get_rope_index(c["input_ids"], c["image_grid_thw"], c["video_grid_thw"],
                                        c["second_per_grid_ts"], c["attention_mask"], 2, QWEN_IDS["image_token_id"],
                                        QWEN_IDS["video_token_id"], QWEN_IDS["vision_start_token_id"], 2.0)
    want = _op(c, "qwen")
    assert torch.equal(pos, want[0]) and torch.equal(delta, want[1])
    grid = mixed_vision_grids(7, seed=2).to(device)
    inv_freq = torch.rand(20, device=device)
    assert torch.equal(backend.rot_pos_emb(inv_freq, grid, 2), mmfuse.rot_pos_emb(inv_freq, grid, 2))
    idx, cu = backend.get_window_index(grid, 2, 4, 14, 4)
    w = mmfuse.window_index(grid, 2, 112, 14)
    assert torch.equal(idx, w.window_index) and torch.equal(cu, w.cu_window_seqlens)
    with pytest.raises(ValueError, match="spatial_merge_unit"):
        backend.get_window_index(grid, 2, 4, 14, 3)
