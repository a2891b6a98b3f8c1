"""The training benchmark's reference: a VLA mixture-of-transformers decoder stack in plain PyTorch,
written the way transformers writes Qwen2.5-VL's text decoder (RMSNorm in fp32 then cast, q/k/v
projections with bias and o without, mRoPE by HF's formula from cos/sin tables, SDPA attention), with
one SwiGLU expert a token type (vision-language or action) and a well-written routing: the token
indices of each type computed once a batch, ``index_select`` in, ``index_copy_`` out. A fair baseline,
not a strawman: the same attention kernel (SDPA) as the mmfuse model.

Also the configuration presets and the synthetic batch both models train on."""

from dataclasses import dataclass, replace
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .references import make_positions


@dataclass(frozen=True)
class VLAConfig:
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    inter_vl: int = 11008
    inter_action: int = 2048
    layers: int = 4
    mrope_section: Tuple[int, int, int] = (16, 24, 24)
    rope_theta: float = 1e6
    eps: float = 1e-6


PRESETS: Dict[str, VLAConfig] = {
    # Qwen2.5-VL-3B text shapes, an action expert of the hidden width
    "3b": VLAConfig(),
    # Qwen2.5-VL-7B text shapes
    "7b": VLAConfig(hidden=3584, heads=28, kv_heads=4, inter_vl=18944, inter_action=3584),
    # for the CPU: the same structure at toy sizes
    "tiny": VLAConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, inter_vl=96, inter_action=48, layers=2,
                      mrope_section=(2, 3, 3)),
}


def preset(name: str, **overrides) -> VLAConfig:
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


# ---- the batch ---------------------------------------------------------------------------------------

@dataclass
class Batch:
    embeds: Tensor        # [B, L, hidden]: the inputs (a VLA's embedded text, image, video and action tokens)
    positions: Tensor     # [3, B, L] int64: Qwen2.5-VL's 3-D positions (text, image grids, a video, actions)
    target: Tensor        # [B, L, hidden] fp32: the regression target
    action: int           # action tokens a sample: the last `action` of each

    @property
    def shape(self):
        return tuple(self.embeds.shape[:2])


def make_batch(cfg: VLAConfig, batch: int, seq: int, action: int, device, dtype, seed: int = 0) -> Batch:
    """Random embeddings and target, and realistic positions: the vision-language part of each sample
    (text runs, an image grid, a video) from ``make_positions``, then `action` action tokens that
    continue as text."""
    if not 0 <= action < seq:
        raise ValueError(f"make_batch: action: expected in [0, seq = {seq}), got {action}")
    g = torch.Generator().manual_seed(seed)
    pos = torch.empty(3, batch, seq, dtype=torch.long)
    pos[:, :, : seq - action] = make_positions(batch, seq - action, "cpu", seed=seed)
    start = pos[:, :, : seq - action].amax(dim=(0, 2)) + 1  # [B]
    pos[:, :, seq - action:] = (start[:, None] + torch.arange(action))[None]
    embeds = torch.randn(batch, seq, cfg.hidden, generator=g)
    target = torch.randn(batch, seq, cfg.hidden, generator=g)
    return Batch(embeds.to(device, dtype), pos.to(device), target.to(device), action)


def type_indices(batch: Batch) -> Tuple[Tensor, Tensor]:
    """Flat token indices of the vision-language and the action tokens (computed once a batch)."""
    B, L = batch.shape
    t = torch.arange(B * L, device=batch.embeds.device)
    is_action = (t % L) >= L - batch.action
    return t[~is_action], t[is_action]


# ---- the model ---------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section):
    section = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(section, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(section, dim=-1))], dim=-1).unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class RotaryEmbedding(nn.Module):
    """Qwen2_5_VLRotaryEmbedding: cos/sin [3, B, L, D] of the 3-D positions."""

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor):
        inv = self.inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
        pos = position_ids[:, :, None, :].float()
        freqs = (inv.float() @ pos.float()).transpose(2, 3)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=True)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, L, _ = h.shape
        d = self.cfg.head_dim
        q = self.q_proj(h).view(B, L, -1, d).transpose(1, 2)
        k = self.k_proj(h).view(B, L, -1, d).transpose(1, 2)
        v = self.v_proj(h).view(B, L, -1, d).transpose(1, 2)
        q, k = apply_multimodal_rotary_pos_emb(q, k, cos, sin, self.cfg.mrope_section)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(a.transpose(1, 2).reshape(B, L, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoTMLP(nn.Module):
    """One SwiGLU expert a token type: index_select the tokens of each type, run the expert,
    index_copy_ the results back."""

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.vl = SwiGLU(cfg.hidden, cfg.inter_vl)
        self.action = SwiGLU(cfg.hidden, cfg.inter_action)

    def forward(self, h: Tensor, idx_vl: Tensor, idx_action: Tensor) -> Tensor:
        flat = h.reshape(-1, h.shape[-1])
        out = torch.empty_like(flat)
        out.index_copy_(0, idx_vl, self.vl(flat.index_select(0, idx_vl)))
        out.index_copy_(0, idx_action, self.action(flat.index_select(0, idx_action)))
        return out.view_as(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MoTMLP(cfg)

    def forward(self, h, cos, sin, idx_vl, idx_action):
        residual = h
        h = self.self_attn(self.input_layernorm(h), cos, sin)
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h), idx_vl, idx_action)
        return residual + h


class VLAReference(nn.Module):
    """The decoder stack: layers, then the final RMSNorm; forward(batch) -> [B, L, hidden]."""

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        self.rotary_emb = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)

    def forward(self, embeds: Tensor, positions: Tensor, idx_vl: Tensor, idx_action: Tensor) -> Tensor:
        cos, sin = self.rotary_emb(embeds, positions)
        h = embeds
        for layer in self.layers:
            h = layer(h, cos, sin, idx_vl, idx_action)
        return self.norm(h)


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Deterministic weights: linear layers as nn.Linear initialises them, norms near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                bound = p.shape[1] ** -0.5
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
