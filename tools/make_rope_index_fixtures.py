#!/usr/bin/env python3
"""Golden fixtures for ``rope_index`` modes ``qwen`` and ``hf4`` (issue 3), produced by the transformers
release that defines each mode, run on the CPU:

    pip install --target /tmp/tf449 transformers==4.49.0    # mode qwen (4.49-4.51)
    pip install --target /tmp/tf457 transformers==4.57.1    # mode hf4  (4.52-4.57)
    PYTHONPATH=/tmp/tf449 python tools/make_rope_index_fixtures.py --mode qwen
    PYTHONPATH=/tmp/tf457 python tools/make_rope_index_fixtures.py --mode hf4

Writes ``tests/fixtures/rope_index_<mode>.pt``: the transformers and torch versions that ran, the
token ids and config, and per case the inputs (input_ids, attention_mask, grids, second_per_grid_ts)
and transformers' outputs (position_ids, deltas). The cases are drawn from a fixed seed and cover
left and right padding, images and videos, several videos a row, second_per_grid_ts in
{0.083, 0.5, 1, 1.5, 2} and absent, merged widths 41, 47, 55, 61 and 121, and rows without vision.
(All-padding rows are not included: the releases' own code fails on them; they are hand-worked cases
in the tests.) The mode ``hf5`` needs no fixture: its oracle is the installed transformers.
"""

import argparse
import os
import random
import types

import torch

MODE_RELEASES = {"qwen": ("4.49", "4.50", "4.51"), "hf4": ("4.52", "4.53", "4.54", "4.55", "4.56", "4.57")}
IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
MERGE = 2
TOKENS_PER_SECOND = 2
SECONDS = [0.083, 0.5, 1.0, 1.5, 2.0]
ODD_WIDTHS = [41, 47, 55, 61, 121]


def _grid(rng: random.Random, video: bool) -> list:
    """[t, h, w] in patches; merged dims h/m, w/m. Now and then a merged width from ODD_WIDTHS."""
    hm = rng.randint(1, 6)
    wm = rng.choice(ODD_WIDTHS) if rng.random() < 0.25 else rng.randint(1, 9)
    if wm > 9:
        hm = 1
    t = rng.randint(1, 4) if video else 1
    return [t, hm * MERGE, wm * MERGE]


def _case(rng: random.Random) -> dict:
    B = rng.randint(1, 3)
    rows, images, videos = [], [], []
    for _ in range(B):
        toks = []
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            toks += [rng.randrange(10, 1000) for _ in range(rng.randint(0, 24))]
            video = rng.random() < 0.45
            g = _grid(rng, video)
            (videos if video else images).append(g)
            n = g[0] * (g[1] // MERGE) * (g[2] // MERGE)
            toks += [IDS["vision_start_token_id"]] + [IDS["video_token_id" if video else "image_token_id"]] * n
            toks += [IDS["vision_end_token_id"]]
        toks += [rng.randrange(10, 1000) for _ in range(rng.randint(1, 24))]
        rows.append(toks)
    L = max(len(r) for r in rows) + rng.randint(0, 6)
    left = rng.random() < 0.5
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        s = L - len(r) if left else 0
        ids[b, s:s + len(r)] = torch.tensor(r)
        mask[b, s:s + len(r)] = 1
    sec = None
    if videos and rng.random() < 0.7:
        sec = torch.tensor([rng.choice(SECONDS) for _ in videos], dtype=torch.float32)
    return dict(
        input_ids=ids, attention_mask=mask,
        image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
        video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
        second_per_grid_ts=sec, left_padding=left)


def _hf_get_rope_index():
    """The release's own get_rope_index, called with a minimal config in place of the model."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    owner = getattr(m, "Qwen2_5_VLModel", None)
    if owner is None or not hasattr(owner, "get_rope_index"):
        owner = m.Qwen2_5_VLForConditionalGeneration
    cfg = types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=TOKENS_PER_SECOND),
        image_token_id=IDS["image_token_id"], video_token_id=IDS["video_token_id"],
        vision_start_token_id=IDS["vision_start_token_id"])
    fake = types.SimpleNamespace(config=cfg)
    return lambda **kw: owner.get_rope_index(fake, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODE_RELEASES), required=True)
    ap.add_argument("--cases", type=int, default=48)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import transformers
    version = transformers.__version__
    if not version.startswith(MODE_RELEASES[args.mode]):
        raise SystemExit(f"mode {args.mode} is defined by transformers {MODE_RELEASES[args.mode]}, "
                         f"but {version} is installed")
    get_rope_index = _hf_get_rope_index()
    rng = random.Random(args.seed)
    cases = []
    while len(cases) < args.cases:
        c = _case(rng)
        pos, delta = get_rope_index(input_ids=c["input_ids"], image_grid_thw=c["image_grid_thw"],
                                    video_grid_thw=c["video_grid_thw"],
                                    second_per_grid_ts=c["second_per_grid_ts"], attention_mask=c["attention_mask"])
        c["position_ids"] = pos.to(torch.int32)  # values are small; the op returns int64
        c["deltas"] = delta.reshape(-1, 1).to(torch.int64)
        cases.append(c)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                   f"rope_index_{args.mode}.pt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    torch.save(dict(mode=args.mode, transformers=version, torch=torch.__version__, seed=args.seed,
                    spatial_merge_size=MERGE, tokens_per_second=TOKENS_PER_SECOND, ids=IDS, cases=cases), out)
    n_vid = sum(0 if c["video_grid_thw"] is None else len(c["video_grid_thw"]) for c in cases)
    n_img = sum(0 if c["image_grid_thw"] is None else len(c["image_grid_thw"]) for c in cases)
    print(f"{out}: {len(cases)} cases ({n_img} images, {n_vid} videos) from transformers {version}, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
