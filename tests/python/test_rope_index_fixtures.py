"""The golden fixtures of rope_index (modes qwen and hf4, produced by transformers 4.49 / 4.57 with
tools/make_rope_index_fixtures.py) against the contract's reference in mmfuse.bench.references:
this pins down the contract that the op (issue 3) is tested against."""

import os

import pytest
import torch

from mmfuse.bench.references import rope_index_reference

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


@pytest.mark.parametrize("mode", ["qwen", "hf4"])
def test_op_matches_release_fixtures(mode):
    import mmfuse

    fx = torch.load(os.path.join(FIXTURES, f"rope_index_{mode}.pt"), weights_only=False)
    ids = fx["ids"]
    for i, c in enumerate(fx["cases"]):
        pos, delta = mmfuse.rope_index(c["input_ids"], c["image_grid_thw"], c["video_grid_thw"],
                                       c["second_per_grid_ts"], c["attention_mask"],
                                       spatial_merge_size=fx["spatial_merge_size"],
                                       image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
                                       vision_start_token_id=ids["vision_start_token_id"],
                                       tokens_per_second=fx["tokens_per_second"], mode=mode)
        assert torch.equal(pos, c["position_ids"].long()), f"case {i}: positions"
        assert torch.equal(delta, c["deltas"]), f"case {i}: deltas"


def test_op_opcheck_and_compile():
    import mmfuse

    fx = torch.load(os.path.join(FIXTURES, "rope_index_qwen.pt"), weights_only=False)
    c = next(c for c in fx["cases"] if c["video_grid_thw"] is not None and c["image_grid_thw"] is not None)
    ids = fx["ids"]
    args = (c["input_ids"], c["image_grid_thw"], c["video_grid_thw"], c["second_per_grid_ts"], c["attention_mask"],
            2, ids["image_token_id"], ids["video_token_id"], ids["vision_start_token_id"], 2.0, "qwen")
    torch.library.opcheck(torch.ops.mmfuse.rope_index.default, args)
    f = torch.compile(lambda *a: mmfuse.rope_index(*a[:5], image_token_id=ids["image_token_id"],
                                                   video_token_id=ids["video_token_id"],
                                                   vision_start_token_id=ids["vision_start_token_id"]),
                      fullgraph=True)
    pos, delta = f(*args[:5])
    assert torch.equal(pos, c["position_ids"].long()) and torch.equal(delta, c["deltas"])


def test_op_bad_input_raises_value_error():
    import mmfuse

    ids = torch.tensor([[5, 151652, 151655, 5]])
    with pytest.raises(ValueError, match="more image spans than image_grid_thw rows"):
        mmfuse.rope_index(ids, torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        mmfuse.rope_index(ids, torch.tensor([[1, 3, 2]]))
    with pytest.raises(ValueError, match="mode"):
        mmfuse.rope_index(ids, torch.tensor([[1, 2, 2]]), mode="hf9")


def _hf_window_index():
    try:
        from transformers.vision_utils import get_vision_window_index
    except ImportError:
        return None
    return get_vision_window_index


@pytest.mark.skipif(_hf_window_index() is None, reason="needs transformers 5.x (vision_utils)")
def test_window_index_equals_transformers():
    import mmfuse

    hf = _hf_window_index()
    g = torch.Generator().manual_seed(5)
    # mixed sizes: merged dims 1..13 (multiples of ws=4 included), odd widths, videos; thousands of windows
    grids = [[1, 2 * int(torch.randint(1, 14, (1,), generator=g)), 2 * int(torch.randint(1, 14, (1,), generator=g))]
             for _ in range(300)]
    grids += [[3, 16, 32], [2, 8, 8], [1, 82, 242], [1, 2, 2], [4, 24, 94]]
    grid = torch.tensor(grids)
    idx, cu = mmfuse.window_index(grid, 2, 112, 14)
    ref_idx, ref_cu = hf(grid, 2, 112, 14)
    assert idx.dtype == torch.long and cu.dtype == torch.int32
    assert torch.equal(idx, ref_idx.long()) and torch.equal(cu, ref_cu)
    assert cu.numel() > 1000


def test_window_index_bad_input_and_compile():
    import mmfuse

    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        mmfuse.window_index(torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="expected shape \\[n, 3\\]"):
        mmfuse.window_index(torch.tensor([[1, 4]]))
    grid = torch.tensor([[1, 6, 10], [2, 8, 8]])
    torch.library.opcheck(torch.ops.mmfuse.window_index.default, (grid, 2, 112, 14))
    idx, cu = mmfuse.window_index(grid)
    assert cu.tolist() == [0, 48, 60, 124, 188] and idx.numel() == 47
