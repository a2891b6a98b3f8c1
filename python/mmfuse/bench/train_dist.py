"""``mmfuse-bench train --nproc N``: the mmfuse VLA model trained data-parallel under FSDP2
(``fully_shard`` on every layer and the root) with activation checkpointing of every layer, each rank
a slice of the batch. Checks the sharded gradients against the same model's single-process gradients
on the whole batch; on the GPU also times the step.

Ranks come from ``torchrun`` (``torchrun --nproc-per-node N -m mmfuse.bench train --nproc N``: NCCL on
the GPU) or, without it, from ``torch.multiprocessing`` (gloo on the CPU: what CI runs)."""

import datetime
import os
import socket
import tempfile
import time

import torch

from ..nn.vla import VLADecoder
from .vla_reference import VLAReference, init_weights, make_batch, preset


def _loss(out, target):
    return (out.float() - target).pow(2).mean()


def _model(cfg, device, dtype):
    ref = VLAReference(cfg)
    init_weights(ref, seed=0)
    m = VLADecoder(cfg, device=device, dtype=dtype)
    m.load_reference({k: v.to(device, dtype) for k, v in ref.state_dict().items()})
    return m


def _shard(model, mesh):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(model.layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank: int, world: int, opts: dict, out_dir: str) -> None:
    """One rank: the single-process gradients on the whole batch, then the sharded step on this
    rank's slice; writes `ok<rank>` (with the figures) to out_dir when they agree."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    on_gpu = opts["device"] == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        mesh = init_device_mesh(device.type, (world,))
        cfg = preset(opts["preset"], layers=opts.get("layers"))
        dtype = torch.bfloat16 if on_gpu else torch.float32
        B = opts["batch"]
        if B % world:
            raise ValueError(f"train --nproc: the batch of {B} must split evenly over {world} ranks")
        data = make_batch(cfg, B, opts["seq"], opts["action"], device, dtype, seed=0)
        # the single-process gradients of the whole batch
        full = _model(cfg, device, dtype)
        _loss(full(data.embeds, data.positions, data.action), data.target).backward()
        want = {n: p.grad.detach().clone() for n, p in full.named_parameters()}
        del full
        # the sharded model on this rank's samples: the mean of the ranks' gradients is the whole batch's
        per = B // world
        sl = slice(rank * per, (rank + 1) * per)
        model = _shard(_model(cfg, device, dtype), mesh)
        local = (data.embeds[sl], data.positions[:, sl], data.target[sl])
        step = lambda: _loss(model(local[0], local[1], data.action), local[2]).backward()  # noqa: E731
        step()
        worst = 0.0
        for name, p in model.named_parameters():
            g = p.grad.full_tensor()
            w = want[name.replace("_checkpoint_wrapped_module.", "")]
            err = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
            worst = max(worst, err)
        tol = 2e-2 if on_gpu else 1e-5
        ms, peak = None, None
        if on_gpu:
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            n = opts.get("timed_steps", 10)
            for _ in range(n):
                model.zero_grad(set_to_none=True)
                step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / n * 1e3
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
        dist.barrier()
        if worst <= tol:
            with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
                f.write(f"{worst} {ms} {peak}\n")
        else:
            raise AssertionError(f"rank {rank}: gradient error {worst:.2e} against one process (tolerance {tol})")
    except BaseException:
        dist.destroy_process_group()
        raise
    if opts.get("exit_hard", False):
        # leave without tearing gloo down (its teardown has aborted after both ranks had checked)
        os._exit(0)
    dist.destroy_process_group()


def run(device: str, nproc: int, *, preset_name: str = "3b", layers=None, batch: int = 4, seq: int = 4096,
        action: int = 256) -> dict:
    """Spawns (or, under torchrun, is) the ranks; returns the worst gradient error and, on the GPU, the
    step's time and peak memory per rank."""
    if device != "cuda":
        preset_name, batch, seq, action = "tiny", 2 * nproc, 48, 12
    opts = dict(device=device, preset=preset_name, layers=layers, batch=batch, seq=seq, action=action)
    print(f"\n## train --nproc {nproc}: FSDP2 with activation checkpointing, {'NCCL' if device == 'cuda' else 'gloo'}, "
          f"preset {preset_name}, batch {batch} x {seq}", flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        t0 = time.perf_counter()
        if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), opts, out_dir)
            ranks = [int(os.environ["RANK"])]
        else:
            import torch.multiprocessing as mp

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
            mp.spawn(worker, args=(nproc, dict(opts, exit_hard=True), out_dir), nprocs=nproc, join=True)
            ranks = list(range(nproc))
        figures = []
        for r in ranks:
            with open(os.path.join(out_dir, f"ok{r}")) as f:
                err, ms, peak = f.read().split()
            figures.append((float(err), None if ms == "None" else float(ms), None if peak == "None" else float(peak)))
    worst = max(f[0] for f in figures)
    row = dict(variant=f"mmfuse FSDP2 x{nproc}", grad_err=worst, verified="close", seconds=time.perf_counter() - t0)
    if figures[0][1] is not None:
        row.update(ms=figures[0][1], tokens_per_s_per_gpu=batch // nproc * seq / (figures[0][1] * 1e-3),
                   peak_gib=figures[0][2])
    print(f"  gradients of {nproc} ranks against one process: worst relative error {worst:.1e}"
          + (f"; {row['ms']:.1f} ms a step, peak {row['peak_gib']:.2f} GiB a rank" if "ms" in row else ""))
    return dict(config=opts, rows=[row], all_verified=True)
