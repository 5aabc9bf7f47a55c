"""``python -m fedfew.bench``: the command line of both bench programs (flags: ``--help``); it parses
the arguments and dispatches: the CPU benchmark (:func:`fedfew.bench.cpu.drive`), the GPU check
(:func:`fedfew.bench.gpu_driver.gpu_check`), and the subprocesses they start (a case, the GPU check's
runner and data process)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import fedfew.bench
from fedfew.bench.gpu_sizes import CHECK_SIZES


def main(argv: list[str] | None = None) -> int:
    from fedfew.core.run_folders import python_command

    parser = argparse.ArgumentParser(prog=python_command("fedfew.bench"), description=fedfew.bench.__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the paper's sizes (default on a GPU)")
    parser.add_argument("--small", action="store_true", help="the small default sizes even on a GPU")
    parser.add_argument("--out", default="outputs/bench", help="folder for bench.json and bench.md")
    parser.add_argument("--data-dir", default=os.environ.get("FEDFEW_DATA_DIR"),
                        help="data directory holding ag_news_csv/ (default $FEDFEW_DATA_DIR)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", help="Fabric precision of the runs (32-true | bf16-mixed)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the local step (compile=true)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="sections to run: throughput reference scaling devices flower (default: all); with "
                             "--gpu-check: correctness speed memory precision paper")
    flower = parser.add_argument_group("Flower's simulation engine beside the simulator (the flower section of make bench)")
    flower.add_argument("--flower-clients", type=int, nargs="+", default=[20, 200], metavar="M",
                        help="numbers of clients of the digits job (default: 20 200)")
    flower.add_argument("--flower-rounds", type=int, default=5, help="rounds of each run (default 5)")
    flower.add_argument("--flower-algorithms", nargs="+", default=["fedavg", "fedfew"], metavar="ALGORITHM",
                        help="methods (default: fedavg fedfew)")
    flower.add_argument("--no-flower", action="store_true", help="leave the flower section out")
    gpu = parser.add_argument_group("GPU readiness check (make gpu-check, scripts/gpu_check.sh, docs/speed.md)")
    gpu.add_argument("--gpu-check", action="store_true",
                     help="measure every CUDA path in a few minutes (on a machine without a GPU: the CPU smoke mode)")
    gpu.add_argument("--cifar-dir", default=None,
                     help="folder with cifar10_{train,test}_jpg.tar.gz (or train/ + test/) for the accuracy lines; "
                          "synthetic tensors without it")
    gpu.add_argument("--budget", type=float, default=None,
                     help=f"seconds for the whole check (default {CHECK_SIZES['cuda'].budget_s:.0f} on a GPU, "
                          f"{CHECK_SIZES['cpu'].budget_s:.0f} on the CPU)")
    gpu.add_argument("--started-at", type=float, default=None,
                     help="the check's start (Unix seconds; the script passes its own, so installing counts)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-check-run", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-check-data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        from fedfew.bench.cases import CASES
        from fedfew.bench.flower_speed import case_federation

        spec = json.loads(args.case)
        result = {**CASES, "federation": case_federation}[spec.get("kind", "round")](spec)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return 0
    if args.gpu_check_run:
        from fedfew.bench.gpu_runner import gpu_check_run

        code = gpu_check_run(json.loads(args.gpu_check_run))
        sys.stdout.flush()
        os._exit(code)  # every result is out: skip the interpreter's teardown (seconds with torch loaded)
    if args.gpu_check_data:
        from fedfew.bench.gpu_data import gpu_check_data

        return gpu_check_data(json.loads(args.gpu_check_data))
    if args.gpu_check:
        from fedfew.bench.gpu_driver import gpu_check

        try:
            return gpu_check(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    from fedfew.bench.cpu import drive

    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
