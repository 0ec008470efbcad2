"""Run every benchmark, one after the other, each in its own process (`make bench`).

By default each runs a quick configuration (about 4 minutes in all on 2 cores) that shows it works and gives
figures comparable between runs of this script; ``--full`` runs the configurations recorded in bench/RESULTS.md
(hours on 2 cores). ``--only plan plan_time`` picks benchmarks by name.

    .venv/bin/python bench/run_all.py [--full] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (quick arguments, full arguments as in RESULTS.md)
BENCHMARKS = {
    "trace": (["gpt-1.3b"], ["gpt-1.3b", "gpt-39b", "moe-70b", "wresnet-13b"]),
    "intra": (["--layers", "2", "8", "--variants", "reuse", "whole"], []),
    "plan": (["gpt-350m:1", "moe-380m:1", "wresnet-250m:1"],
             [f"{m}:{g}" for fam in (("gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.6b", "gpt-6.7b", "gpt-15b", "gpt-39b"),
                                     ("moe-380m", "moe-690m", "moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b", "moe-70b"),
                                     ("wresnet-250m", "wresnet-500m", "wresnet-1b", "wresnet-2b", "wresnet-4b",
                                      "wresnet-6.8b", "wresnet-13b"))
              for m, g in zip(fam, (1, 2, 4, 8, 16, 32, 64))]),
    "plan_time": (["48:64"], ["48:16", "48:32", "48:64", "96:64", "128:64", "128:128", "128:256"]),
    "slow_network": (["gpt-1.3b:2"], ["gpt-1.3b:2"]),
    "optimum": (["--quick"], []),
    "overrides": (["--repeats", "3"], []),
    "ui": (["gpt-tiny", "--repeat", "3"], []),
    "validate": (["mlp"], []),
    "propagation": (["--rounds", "5", "--repeats", "1"], ["--rounds", "15", "--repeats", "5"]),
    "execute": (["--steps", "5"], []),
    "notebooks": (["-k", "02"], []),
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the configurations recorded in bench/RESULTS.md")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    args = ap.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "JAX_NUM_CPU_DEVICES": os.environ.get("JAX_NUM_CPU_DEVICES", "8")}
    failed = []
    for name in args.only or BENCHMARKS:
        quick, full = BENCHMARKS[name]
        cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *(full if args.full else quick)]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        print(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
