"""mmfuse-bench: the benchmark CLI (the main job).

    mmfuse-bench [rope] [positions] [moe] [gemm] [fp8] [rms_norm] [swiglu] [linear_cross_entropy] [seed]
                 [train] [model] [--quick] [--json FILE]
                 [train and model options]
    mmfuse-bench report [--results DIR] [--out FILE] [--readme FILE]

`seed` times the seed-compatible functions against the native API (seed.py); `train` is the training step of a VLA decoder stack, PyTorch against mmfuse (train.py); `model` that of
a whole transformers Qwen2.5-VL, unpatched against patch_qwen2_5_vl (model.py). On a GPU
each op family measures the copy (or GEMM) ceiling and each op against the best alternative in
the same run, prints its tables and, with --json, writes the results (GPU, driver, versions, commit
and date in a header) for `report`. On the CPU it checks agreement with the references only, at small
sizes: CPU timings say nothing about the GPU kernels, so none are printed. `report` turns the
committed results (docs/results/*.json) into docs/benchmarks.md and its plots.
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import subprocess
import sys
import time

_FAMILIES = ["rope", "positions", "moe", "gemm", "fp8", "rms_norm", "swiglu", "linear_cross_entropy", "seed", "train",
             "model"]


def _commit() -> str:
    """The source revision: MMFUSE_COMMIT if set (a copy without .git), else git's, else unknown."""
    if os.environ.get("MMFUSE_COMMIT"):
        return os.environ["MMFUSE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _header(device: str) -> dict:
    import torch
    h = {"device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "commit": _commit(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}
    try:
        import transformers
        h["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda":
        h["device"] = torch.cuda.get_device_name()
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            h["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            h["driver"] = None
    return h


def _agreement(fam: str, res: dict) -> list:
    """(case, verdict) of every row that was checked against a reference."""
    out = []
    for r in res.get("rows", []):
        v = r.get("verified")
        if v in (None, "", "-"):
            continue
        name = r.get("name") or r.get("case") or r.get("shape") or r.get("variant", "")
        if "gemm" in r:
            name = f"{name} {r['gemm']}"
        if "pass_" in r:
            name = f"{name} {r['pass_']}"
        out.append((name, v if isinstance(v, str) else ("exact" if v else "FAIL")))
    return out


def _run(args) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from . import fp8, gemm, linear_cross_entropy, moe, positions, rms_norm, rope, seed, swiglu, train

    def run_model(dev, quick):
        from . import model
        return model.run(dev, layers=args.model_layers, vision_depth=args.vision_depth, batch=args.model_batch,
                         seq=args.model_seq, steps=min(args.steps, 20), fp8=args.fp8, compile=not args.no_compile,
                         quick=quick)

    def run_train(dev, quick):
        if args.nproc > 1 or "WORLD_SIZE" in os.environ:
            from . import train_dist
            return train_dist.run(dev, args.nproc, preset_name=args.preset, layers=args.layers, batch=args.batch,
                                  seq=args.seq, action=args.action)
        return train.run(dev, preset_name=args.preset, layers=args.layers, batch=args.batch, seq=args.seq,
                         action=args.action, steps=args.steps, lr=args.lr, fp8=args.fp8,
                         compile=not args.no_compile, quick=quick, fp8_grad=args.fp8_grad,
                         fp8_scaling=args.fp8_scaling)

    runners = {"rope": rope.run, "positions": positions.run, "moe": moe.run, "gemm": gemm.run, "fp8": fp8.run,
               "rms_norm": rms_norm.run, "swiglu": swiglu.run, "linear_cross_entropy": linear_cross_entropy.run,
               "seed": seed.run, "train": run_train, "model": run_model}
    header = _header(device)
    print(f"mmfuse-bench on {header['device']} (torch {header['torch']}, CUDA {header['cuda']}, "
          f"commit {header['commit']})", flush=True)
    if device != "cuda":
        print("no GPU: checking agreement with the references at small sizes only; CPU timings say nothing "
              "about the GPU kernels, so none are printed", flush=True)
    results = {"header": header}
    ok, t_all = True, time.perf_counter()
    for fam in args.families:
        t0 = time.perf_counter()
        print(f"\n== {fam} ...", flush=True)
        if device == "cuda":
            res = runners[fam](device, quick=args.quick)
        else:
            with contextlib.redirect_stdout(io.StringIO()):  # the tables' timings: not meaningful here
                res = runners[fam](device, quick=True)
            for name, verdict in _agreement(fam, res):
                print(f"  {verdict:<8} {name}")
        fam_ok = res.get("all_verified", True)
        ok = ok and fam_ok
        results[fam] = res
        print(f"== {fam}: {'all outputs agree' if fam_ok else 'OUTPUTS DISAGREE'} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"\nresults written to {args.json}")
    verdict = "PASS" if ok else "FAIL"
    what = "agreement" if device != "cuda" else "benchmark"
    print(f"\nmmfuse-bench {what}: {verdict} ({', '.join(args.families)}; {time.perf_counter() - t_all:.0f} s)")
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        parser = argparse.ArgumentParser(prog="mmfuse-bench report",
                                         description="docs/benchmarks.md and its plots from docs/results/*.json")
        parser.add_argument("--results", default="docs/results", help="folder of result JSON files")
        parser.add_argument("--out", default="docs/benchmarks.md", help="the Markdown page to write")
        parser.add_argument("--readme", default="README.md", help="the README whose results section to update")
        args = parser.parse_args(argv[1:])
        from .report import render, update_readme
        for path in render(args.results, args.out):
            print(f"wrote {path}")
        if update_readme(args.readme, args.results):
            print(f"updated the results section of {args.readme}")
        return 0
    parser = argparse.ArgumentParser(prog="mmfuse-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"op families: {', '.join(_FAMILIES)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this file")
    from .train import add_arguments
    add_arguments(parser.add_argument_group("train"))
    from .model import add_arguments as add_model_arguments
    add_model_arguments(parser.add_argument_group("model (also --steps, at most 20, --fp8, --no-compile)"))
    args = parser.parse_args(argv)
    args.families = args.families or list(_FAMILIES)
    for fam in args.families:
        if fam not in _FAMILIES:
            parser.error(f"unknown family {fam!r}; expected one of {_FAMILIES} (or: report)")
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
