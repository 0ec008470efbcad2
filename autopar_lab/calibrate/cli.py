"""``python -m autopar_lab.calibrate``: the command line of the calibration (see :mod:`autopar_lab.calibrate`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..cluster import CPU_PROFILE_PATH
from .modes import update_chain_reads, update_collectives, update_kernel_overhead, update_task_overhead, write_profile

__all__ = ["main", "DESCRIPTION"]

DESCRIPTION = "Measure this machine's JAX CPU devices and write the profile the ``cpu`` cluster preset reads."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar_lab.calibrate", description=DESCRIPTION)
    parser.add_argument("--out", default=str(CPU_PROFILE_PATH), help="where to write the JSON profile")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (seconds, noisier)")
    parser.add_argument("--devices", type=int, default=None, help="use the first N CPU devices (default: all)")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    parser.add_argument("--task-overhead-only", action="store_true",
                        help="measure only the per-task overhead and add it to the existing profile at --out")
    parser.add_argument("--collectives-only", action="store_true",
                        help="measure only the collectives (each after a layer-like compute, as a step meets them) "
                             "and refit the links of the existing profile at --out")
    parser.add_argument("--back-to-back", action="store_true",
                        help="with --collectives-only: time chains of bare back-to-back collectives instead")
    parser.add_argument("--kernel-overhead-only", action="store_true",
                        help="measure only the per-kernel and per-state-array overheads and add them to the existing "
                             "profile at --out")
    parser.add_argument("--chain-reads-only", action="store_true",
                        help="measure only the gradient chain's re-reads (deep steps against the profile's kernel "
                             "fit) and add them to the existing profile at --out")
    args = parser.parse_args(argv)
    # Calibrate CPU devices; give the usual 8 unless the caller chose (only works before jax is imported).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    if "jax" in sys.modules:  # imported with the package: its config read the environment already
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
        except (RuntimeError, ValueError):
            pass  # the backend is up already: the devices are what they are (step_point says if too few)
    try:
        if args.task_overhead_only:
            profile = update_task_overhead(args.out, quick=args.quick)
        elif args.collectives_only:
            profile = update_collectives(args.out, quick=args.quick, back_to_back=args.back_to_back)
        elif args.kernel_overhead_only:
            profile = update_kernel_overhead(args.out, quick=args.quick)
        elif args.chain_reads_only:
            profile = update_chain_reads(args.out, quick=args.quick)
        else:
            profile = write_profile(args.out, num_devices=args.devices, quick=args.quick)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(profile))
    else:
        d, link = profile["device"], profile["intra_host"]
        print(
            f"wrote {args.out}: {profile['num_devices']} devices, "
            f"{d['peak_flops']['float32'] / 1e9:.1f} GFLOP/s and {d['memory_bandwidth'] / 1e9:.1f} GB/s per device "
            f"(concurrent), collective link (all-reduce + all-gather fit) {link['bandwidth'] / 1e9:.2f} GB/s + "
            f"{link['latency'] * 1e6:.1f} us, "
            f"{d['task_overhead_s'] * 1e3:.2f} ms per pipeline task, "
            f"{d.get('efficiency', {}).get('kernel_launch_s', 0.0) * 1e6:.1f} us per kernel, "
            f"{d.get('efficiency', {}).get('buffer_s', 0.0) * 1e6:.1f} us per state array, "
            f"{d.get('efficiency', {}).get('chain_reads', 0.0):.3g} gradient-chain reads per later layer"
        )
    return 0
