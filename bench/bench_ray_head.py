"""How long the embedded Ray head takes to start (``start_local_ray``, as ``al.launch`` without an address does it),
and whether it starts at all, at the machine's current load.

    python bench/bench_ray_head.py --repeat 5            # at idle
    python bench/bench_ray_head.py --repeat 5 --busy 8   # with 8 busy-looping processes beside it

Each start is timed from the call to a connected driver, then the head is stopped; a start that fails is reported
with its reason. The load average (``os.getloadavg``) is printed beside each start: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import time


def _spin() -> None:
    while True:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes to run beside the starts")
    ap.add_argument("--attempts", type=int, default=1, help="start attempts per head (the library's default is 3)")
    args = ap.parse_args(argv)
    from autopar_lab.runtime.launch import shutdown_local_ray, start_local_ray

    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    if spinners:
        time.sleep(20)  # let the load average rise
    rows = []
    try:
        for i in range(args.repeat):
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            try:
                ray = start_local_ray(num_cpus=1, attempts=args.attempts)
                ok, why = True, ""
                ray.get(ray.put(1))
            except RuntimeError as e:
                ok, why = False, str(e)[:200]
            dt = time.perf_counter() - t0
            shutdown_local_ray()
            rows.append({"i": i, "ok": ok, "start_s": round(dt, 1), "load1": round(load, 1), "error": why})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for p in spinners:
            p.terminate()
    ok = [r["start_s"] for r in rows if r["ok"]]
    print(json.dumps({"busy": args.busy, "started": len(ok), "of": len(rows),
                      "median_s": sorted(ok)[len(ok) // 2] if ok else None, "max_s": max(ok) if ok else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
