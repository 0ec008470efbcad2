"""Benchmark: sharding propagation from a few annotations against the ILP's plan, run (notebook 06's question 3).

One training step of the small float32 MLP (``autopar_lab.validate.SMALL_OVERRIDES``) compiled four ways on a 2 x 4
mesh of 8 CPU devices by ``autopar_lab.validate.propagation_programs`` (three from input annotations, propagated by
XLA's partitioner; the ILP's plan applied operator by operator), then timed ``--repeats`` times by
``autopar_lab.validate.time_programs`` (``--rounds`` interleaved rounds each, medians). One markdown table: each
program's collective bytes (per device buffer, as XLA compiled them), the median of its repeats' medians, and each
repeat's median as a ratio to the ILP plan's in the same repeat (ratios within a repeat compare; wall times across
loads do not).

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu .venv/bin/python bench/bench_propagation.py [--rounds 15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds a repeat (its median)")
    ap.add_argument("--repeats", type=int, default=3, help="how many times the four programs are timed")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        print("--rounds and --repeats must be at least 1.", file=sys.stderr)
        return 2

    import jax

    import autopar_lab as al

    if len(jax.devices()) < 8:
        print(f"needs 8 devices, JAX sees {len(jax.devices())}: set JAX_NUM_CPU_DEVICES=8.", file=sys.stderr)
        return 2
    spec = al.models.get("mlp", dtype="float32", **al.validate.SMALL_OVERRIDES["mlp"])
    built = al.validate.propagation_programs(spec, (2, 4))
    init = spec.init(0)
    repeats = [al.validate.time_programs(built.programs, init, rounds=args.rounds) for _ in range(args.repeats)]
    ilp = al.validate.PROPAGATION_NAMES[-1]
    print("| program | collective MiB | ms | / ILP, each repeat |")
    print("|---|---|---|---|")
    for name, exe in built.programs.items():
        mib = al.validate.total_bytes(al.validate.collectives_in_hlo(exe.as_text())) / 2**20
        ms = statistics.median(r[name] for r in repeats) * 1e3
        ratios = " ".join(f"{r[name] / r[ilp]:.2f}" for r in repeats)
        print(f"| {name.removeprefix('propagated: ')} | {mib:.2f} | {ms:.1f} | {ratios} |")
    print("jax.jit partitioned with", "Shardy" if jax.config.jax_use_shardy_partitioner else "GSPMD", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
