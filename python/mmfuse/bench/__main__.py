"""mmfuse-bench: the benchmark CLI (the main job). On a GPU it measures the copy ceiling and each op
against the best alternative in the same run; on the CPU it runs small sizes against the CPU references.

    mmfuse-bench [rope] [positions] [moe] [gemm] [fp8] [--quick] [--json FILE]
"""

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mmfuse-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="op families: rope, positions, moe, gemm, fp8 (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    known = ["rope", "positions", "moe", "gemm", "fp8"]
    args.families = args.families or known
    for fam in args.families:
        if fam not in known:
            parser.error(f"unknown family {fam!r}; expected one of {known}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from . import fp8, gemm, moe, positions, rope

    header = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(f"mmfuse-bench on {header['device']} (torch {header['torch']}, CUDA {header['cuda']})")
    results = {"header": header}
    ok = True
    for fam in args.families:
        res = {"rope": rope.run, "positions": positions.run, "moe": moe.run, "gemm": gemm.run, "fp8": fp8.run}[fam](device, quick=args.quick)
        results[fam] = res
        ok = ok and res.get("all_verified", True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    if not ok:
        print("\nFAILED: some outputs did not match their reference", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
