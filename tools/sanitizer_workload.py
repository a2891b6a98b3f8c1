"""A small GPU workload of every torch op, run under compute-sanitizer by tools/gpu-check."""
import os

import torch

import mmfuse
from mmfuse.bench.references import hf_tables, inv_freq_of, make_positions, vision_freqs

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for D in (64, 72, 80, 128, 256):
        B, L = 2, 97
        pos = make_positions(B, L, "cuda", seed=D)
        inv = inv_freq_of(D, "cuda")
        sec = [D // 8, (D // 2 - D // 8) // 2, D // 2 - D // 8 - (D // 2 - D // 8) // 2]
        q = torch.randn(B, 5, L, D, dtype=dtype, device="cuda", requires_grad=True)
        k = torch.randn(B, 3, L, D, dtype=dtype, device="cuda", requires_grad=True)
        qo, ko = mmfuse.mrope(q, k, positions=pos, inv_freq=inv, mrope_section=sec)
        (qo.float().sum() + ko.float().sum()).backward()
        cos, sin = hf_tables(pos, inv, dtype)
        mmfuse.mrope(q.detach(), k.detach(), cos, sin, mrope_section=sec, numerics="hf_eager", interleaved=False)
        mmfuse.mrope_(q.detach().clone(), k.detach().clone(), positions=pos[0], inv_freq=inv)
        fr = vision_freqs(L, D, "cuda")
        qv = torch.randn(L, 4, D, dtype=dtype, device="cuda", requires_grad=True)
        a, b = mmfuse.vision_rope(qv, qv, fr)
        (a.float().sum() + b.float().sum()).backward()
from mmfuse.bench.references import mixed_vision_grids, multimodal_batch  # noqa: E402

for mode in ("qwen", "hf4", "hf5"):
    c = {k: (v.cuda() if v is not None else None) for k, v in multimodal_batch(3, 3000, 6, 3, seed=1).items()}
    mmfuse.rope_index(c["input_ids"], c["image_grid_thw"], c["video_grid_thw"], c["second_per_grid_ts"],
                      c["attention_mask"], mode=mode, mm_token_type_ids=c["mm_token_type_ids"])
grid = mixed_vision_grids(40, seed=1)
w = mmfuse.window_index(grid, device="cuda")
mmfuse.vision_positions(grid.cuda())
mmfuse.rot_pos_emb(torch.rand(10, device="cuda"), grid)
for T, K, E, H, drop, dtype in ((3001, 2, 8, 72, 0.8, torch.bfloat16), (700, 8, 64, 13, 1.0, torch.float32),
                                 (999, 1, 2, 256, 1.0, torch.float16), (5000, 4, 300, 8, 0.5, torch.bfloat16)):
    logits = torch.randn(T, E, device="cuda")
    probs, idx = torch.softmax(logits, -1).topk(K, dim=-1)
    x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
    pr = probs.clone().requires_grad_(True)
    p = mmfuse.moe_permute(x, idx, E, int(T * K * drop))
    out = mmfuse.moe_unpermute(p.rows * 2, p.row_id_map, pr)
    out.float().sum().backward()
    mmfuse.moe_permute(x.detach().to(torch.float8_e4m3fn), idx.int(), E)
    torch.ops.mmfuse.moe_unpermute_backward(out.detach(), torch.randn(int(T * K * drop) + 7, H, device="cuda",
                                            dtype=dtype), p.row_id_map, None)
# dual_gemm (cuBLASLt), every layout, with a backward; not under racecheck (only cuBLAS's kernels run
# there, and racecheck misreads their mbarrier synchronisation: see tools/gpu-check)
if os.environ.get("MMFUSE_SANITIZER_TOOL") != "racecheck":
    for ta in (False, True):
        for tb in (False, True):
            a0 = torch.randn((40, 72) if ta else (72, 40), device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w0 = torch.randn((24, 40) if tb else (40, 24), device="cuda", dtype=torch.bfloat16, requires_grad=True)
            a1 = torch.randn((8, 0) if ta else (0, 8), device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w1 = torch.randn((17, 8) if tb else (8, 17), device="cuda", dtype=torch.bfloat16, requires_grad=True)
            o0, o1 = mmfuse.dual_gemm(a0, w0, a1, w1, ta, tb, out_dtype=torch.float32)
            (o0.sum() + o1.sum()).backward()
    mlp = mmfuse.nn.DualExpertMLP((64, 64), (96, 32), device="cuda", dtype=torch.bfloat16)
    xm = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(xm, (torch.arange(33, device="cuda") % 3 == 0).long(), num_tokens0=22).float().sum().backward()
# fp8: the quantize kernels under both tools (one tensor and two in one launch, every source dtype,
# dynamic and delayed); the layer end to end (its GEMMs are cuBLASLt) under memcheck only
from mmfuse import fp8 as f8  # noqa: E402

for r, c, dt in ((300, 136, torch.bfloat16), (7, 45, torch.float32), (1000, 64, torch.float16), (0, 16, torch.bfloat16)):
    xq = torch.randn(r, c, device="cuda", dtype=dt)
    st = f8.new_state(4, "cuda")
    f8.fp8_quantize(xq, st, transposed=True)
    f8.fp8_quantize(xq, st, transposed=True, dynamic=False, dtype=f8.E5M2)
    f8.fp8_quantize(xq, st, rowwise=False, transposed=True)
    f8.fp8_quantize(xq, transposed=True, per_row=True)
    f8.fp8_quantize(xq, rowwise=False, transposed=True, per_row=True)
if os.environ.get("MMFUSE_SANITIZER_TOOL") != "racecheck":
    for k_in, n_out in ((136, 72), (45, 29)):
        lin = mmfuse.nn.Fp8Linear(k_in, n_out, device="cuda", dtype=torch.bfloat16, fallback=False, scaling="delayed")
        for first in (True, False, False):
            xl = torch.randn(3, 37, k_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            lin(xl, is_first_microbatch=first).float().sum().backward()
        xl = torch.randn(50, k_in, device="cuda", dtype=torch.bfloat16)
        f8.fp8_linear_backward(torch.randn(50, n_out, device="cuda", dtype=torch.bfloat16), xl,
                               lin.weight.detach(), (True, True, True))
        row = mmfuse.nn.Fp8Linear(k_in, n_out, device="cuda", dtype=torch.bfloat16, fallback=False, recipe="row")
        row(xl.requires_grad_()).float().sum().backward()
# the layer chain: residual add + RMSNorm (every grouping, odd and model widths, a streamed row) and
# SwiGLU, forward and backward
for T, H, L, S, dt in ((21, 96, 7, 3, torch.bfloat16), (40, 2048, 10, 8, torch.bfloat16), (8, 33, 4, 1, torch.float32),
                       (2, 70000, 2, 1, torch.float16)):
    xr = torch.randn(T, H, device="cuda", dtype=dt, requires_grad=True)
    rr = torch.randn(T, H, device="cuda", dtype=dt, requires_grad=True)
    wr = torch.randn(H, device="cuda", dtype=dt, requires_grad=True)
    for xg, og in ((False, False), (True, False), (False, True), (True, True)):
        o, hh = mmfuse.rms_norm(xr, wr, 1e-6, rr, grouping=(L, S), x_grouped=xg, out_grouped=og)
        (o.float().sum() + hh.float().sum()).backward()
    mmfuse.rms_norm(xr, wr, 1e-6).float().sum().backward()
for T, inter, dt in ((37, 13, torch.bfloat16), (70, 2752, torch.float16), (5, 8, torch.float32)):
    gu = torch.randn(T, 2 * inter, device="cuda", dtype=dt, requires_grad=True)
    mmfuse.swiglu(gu).float().sum().backward()
torch.cuda.synchronize()
print("sanitizer workload done")
