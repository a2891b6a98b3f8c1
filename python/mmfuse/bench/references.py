"""Reference formulas, written here in torch: HF's text mRoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) and
vision RoPE, and realistic multimodal positions. Shared by the tests and the benchmarks."""

import torch

def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def select_sections(t, section, interleaved):
    """[3, B, L, D] -> [B, L, D] by the section rule (HF's split of ``mrope_section * 2``)."""
    if section is None:
        return t[0]
    if not interleaved:
        return torch.cat([m[i % 3] for i, m in enumerate(t.split(list(section) * 2, dim=-1))], dim=-1)
    h = t.shape[-1] // 2
    j = torch.arange(h, device=t.device)
    axis = torch.zeros(h, dtype=torch.long, device=t.device)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    axis = torch.cat([axis, axis])
    return torch.gather(t, 0, axis.view(1, 1, 1, -1).expand(1, *t.shape[1:]))[0]


def hf_tables(positions, inv_freq, dtype):
    """Qwen2_5_VLRotaryEmbedding: cos/sin [3, B, L, D] from positions [3, B, L]."""
    freqs = positions.float()[..., None] * inv_freq  # the K=1 matmul of HF: one fp32 multiply
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hf_apply(q, cos, sin, section, interleaved, numerics, backward=False):
    """q [B, H, L, D]; cos/sin [3, B, L, D] (HF's apply_multimodal_rotary_pos_emb)."""
    c = select_sections(cos, section, interleaved).unsqueeze(1)
    s = select_sections(sin, section, interleaved).unsqueeze(1)
    dtype = q.dtype
    if numerics == "fp32":
        q, c, s = q.float(), c.float(), s.float()
    else:
        c, s = c.to(q.dtype), s.to(q.dtype)
    if not backward:
        out = q * c + rotate_half(q) * s
    else:  # what autograd computes for the line above: grad*c + rotate_half^T(grad*s)
        gs = q * s
        h = q.shape[-1] // 2
        out = q * c + torch.cat((gs[..., h:], -gs[..., :h]), dim=-1)
    return out.to(dtype)


def make_positions(B, L, device, seed=0):
    """Realistic multimodal positions: text runs, an image grid and a video, then text."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.empty(3, B, L, dtype=torch.long)
    for b in range(B):
        st, i = 0, 0
        while i < L:
            n_text = int(torch.randint(1, 40, (1,), generator=g))
            n = min(n_text, L - i)
            pos[:, b, i:i + n] = st + torch.arange(n)
            st += n
            i += n
            if i >= L:
                break
            t, hh, ww = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g)), \
                int(torch.randint(2, 9, (1,), generator=g))
            tt, yy, xx = torch.meshgrid(torch.arange(t) * 2, torch.arange(hh), torch.arange(ww), indexing="ij")
            span = torch.stack([tt.flatten(), yy.flatten(), xx.flatten()]) + st
            n = min(span.shape[1], L - i)
            pos[:, b, i:i + n] = span[:, :n]
            st = int(span.max()) + 1
            i += n
    return pos.to(device)


def inv_freq_of(D, device, theta=1000000.0):
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))


def section_of(D, interleaved):
    h = D // 2
    if interleaved:
        s = h * 5 // 16
        return [h - 2 * s, s, s]
    return [h // 4, (h - h // 4) // 2, h - h // 4 - (h - h // 4) // 2]


def hf_vision(q, k, freqs):
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(-2).float(), emb.sin().unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    return (qf * cos + rotate_half(qf) * sin).to(q.dtype), (kf * cos + rotate_half(kf) * sin).to(k.dtype)


def vision_freqs(N, D, device):
    inv = 1.0 / (10000 ** (torch.arange(0, D // 2, 2, dtype=torch.float32, device=device) / (D // 2)))
    rows = torch.randint(0, 64, (N,), device=device).float()
    cols = torch.randint(0, 64, (N,), device=device).float()
    return torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)


# ---- rope_index (SEMANTICS.md section 3), modes "qwen" and "hf4": a direct reading of the contract ----

def rope_index_reference(mode, input_ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts,
                         spatial_merge_size, image_token_id, video_token_id, vision_start_token_id,
                         tokens_per_second):
    """Positions [3, B, L] int64 and deltas [B, 1] int64 of ``rope_index`` in mode ``qwen`` or ``hf4``,
    written from the contract (host loops; an oracle, not an implementation)."""
    assert mode in ("qwen", "hf4")
    B, L = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    pos = torch.ones(3, B, L, dtype=torch.long)
    deltas = torch.zeros(B, 1, dtype=torch.long)
    n_img = n_vid = 0
    m = spatial_merge_size
    for b in range(B):
        keep = mask[b] == 1
        toks = input_ids[b][keep].tolist()
        # spans: a vision start followed by an image / video token, in order of that token
        spans = [(i + 1, toks[i + 1]) for i in range(len(toks) - 1)
                 if toks[i] == vision_start_token_id and toks[i + 1] in (image_token_id, video_token_id)]
        out = [[], [], []]
        nxt = 0  # one past the maximum position so far
        st = 0
        for first, kind in spans:
            if first < st:
                continue
            if kind == image_token_id:
                t, h, w = (int(v) for v in image_grid_thw[n_img])
                sec = None
                n_img += 1
            else:
                t, h, w = (int(v) for v in video_grid_thw[n_vid])
                sec = 1.0 if second_per_grid_ts is None else float(second_per_grid_ts[n_vid])
                n_vid += 1
            hm, wm = h // m, w // m
            n = first - st
            for a in range(3):
                out[a] += [nxt + i for i in range(n)]
            base = nxt + n
            frames = torch.arange(t, dtype=torch.float32)
            if sec is None:
                tt = [0] * t
            elif mode == "qwen":
                tt = ((frames * torch.tensor(sec, dtype=torch.float32)) * tokens_per_second).long().tolist()
            else:
                tt = [i * int(sec) * tokens_per_second for i in range(t)]
            for fi in range(t):
                for r in range(hm):
                    for c in range(wm):
                        out[0].append(base + tt[fi])
                        out[1].append(base + r)
                        out[2].append(base + c)
            nxt = max(max(o) for o in out) + 1
            st = first + t * hm * wm
        n = len(toks) - st
        for a in range(3):
            out[a] += [nxt + i for i in range(n)]
        if toks:
            row = torch.tensor(out, dtype=torch.long)
            pos[:, b, keep] = row
            deltas[b, 0] = int(row.max()) + 1 - L
    return pos, deltas


# ---- rope_index inputs at model sizes, and transformers' own functions as oracles ----

QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
_VISION_END = 151653


def multimodal_batch(B, L, n_images, n_videos, device="cpu", seed=0, merge=2):
    """A Qwen2.5-VL-style batch: ``B`` rows of length ``L`` holding ``n_images`` images and ``n_videos``
    videos spread over the rows (grids of mixed sizes, each in ``<vs> tokens <ve>``), text between them,
    every other row left-padded. Returns a dict of the rope_index inputs plus ``mm_token_type_ids``."""
    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    rows = [[] for _ in range(B)]
    row_images, row_videos, row_secs = ([[] for _ in range(B)] for _ in range(3))  # grids in row order
    items = [False] * n_images + [True] * n_videos
    items = [items[i] for i in torch.randperm(len(items), generator=g).tolist()]
    for i, video in enumerate(items):
        b = i % B
        row = rows[b]
        t = rand(2, 8) if video else 1
        hm, wm = rand(4, 20), rand(4, 24)
        n = t * hm * wm
        if len(row) + n + 2 + 16 > L - 8:  # no room: smaller
            t, hm, wm = 1, 2, 3
            n = 6
            if len(row) + n + 2 + 16 > L - 8:
                continue
        row += [rand(10, 150000) for _ in range(rand(1, 16))]
        row += [QWEN_IDS["vision_start_token_id"]] + [QWEN_IDS["video_token_id" if video else "image_token_id"]] * n
        row += [_VISION_END]
        (row_videos if video else row_images)[b].append([t, hm * merge, wm * merge])
        if video:
            row_secs[b].append([0.083, 0.5, 1.0, 1.5, 2.0][rand(0, 4)])
    images, videos, secs = (sum(x, []) for x in (row_images, row_videos, row_secs))
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, row in enumerate(rows):
        keep = L - rand(0, 8) if b % 2 else L
        row += [rand(10, 150000) for _ in range(max(0, keep - len(row)))]
        row = row[:keep]
        s = L - len(row) if b % 2 else 0
        ids[b, s:s + len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, s:s + len(row)] = 1
    types = (ids == QWEN_IDS["image_token_id"]).long() + 2 * (ids == QWEN_IDS["video_token_id"]).long()
    types *= mask
    to = dict(device=device)
    return dict(input_ids=ids.to(**to), attention_mask=mask.to(**to), mm_token_type_ids=types.to(**to),
                image_grid_thw=torch.tensor(images, dtype=torch.long).reshape(-1, 3).to(**to) if images else None,
                video_grid_thw=torch.tensor(videos, dtype=torch.long).reshape(-1, 3).to(**to) if videos else None,
                second_per_grid_ts=torch.tensor(secs, dtype=torch.float32).to(**to) if videos else None)


def mixed_vision_grids(n, seed=0, merge=2):
    """``n`` image grids ``[1, h, w]`` of mixed sizes (merged sides 4..40, some odd widths), int64, host."""
    g = torch.Generator().manual_seed(seed)
    odd = [41, 47, 55, 61, 121]
    out = []
    for i in range(n):
        hm = int(torch.randint(4, 41, (1,), generator=g))
        wm = odd[i % 5] if i % 9 == 0 else int(torch.randint(4, 41, (1,), generator=g))
        out.append([1, hm * merge, wm * merge])
    return torch.tensor(out, dtype=torch.long)


def hf5_get_rope_index(spatial_merge_size=2, tokens_per_second=2):
    """transformers 5.x's own ``Qwen2_5_VLModel.get_rope_index`` with a minimal config in place of the
    model (None when transformers 5.x is not installed)."""
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    except ImportError:
        return None
    import inspect
    owner = m.Qwen2_5_VLModel
    if "mm_token_type_ids" not in inspect.signature(owner.get_rope_index).parameters:
        return None
    import types
    cfg = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=spatial_merge_size,
                                                                    tokens_per_second=tokens_per_second))
    fake = types.SimpleNamespace(config=cfg)
    fake.get_vision_position_ids = lambda *a, **k: owner.get_vision_position_ids(fake, *a, **k)
    return lambda **kw: owner.get_rope_index(fake, **kw)


def hf5_vision_utils():
    """transformers 5.x's ``vision_utils`` module (None when not installed)."""
    try:
        from transformers import vision_utils
    except ImportError:
        return None
    return vision_utils if hasattr(vision_utils, "get_vision_window_index") else None
