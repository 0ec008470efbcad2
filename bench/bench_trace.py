"""Benchmark: capturing a zoo model's training step from abstract shapes (issue: foundation).

Each measurement runs in a fresh Python process, so its peak memory (max RSS) is its own. Prints one table:
model, operators, make_jaxpr alone (s), full capture into an OpGraph (s), the ratio, peak RSS (GiB).

    .venv/bin/python bench/bench_trace.py [gpt-39b moe-70b ...]

The defaults include today's largest shapes at full size (llama3-405b: 126 layers; deepseek-v3: 61 layers, 256
experts), which must trace in under 30 s and 4 GiB each (issue 30).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Cold in each process: JAX caches traces, so make_jaxpr and the capture (which calls it) are timed apart.
CHILD = r"""
import json, resource, sys, time
import jax
import autopar_lab as al
spec = al.models.get(sys.argv[1])
t0 = time.perf_counter()
if sys.argv[2] == "jaxpr":
    jax.make_jaxpr(spec.step_fn)(*spec.abstract_args); extra = {}
else:
    g = spec.trace(); extra = {"num_ops": len(g), "params": g.param_count}
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model": spec.name, "seconds": seconds, "peak_rss_gib": rss / 2**30, **extra}))
"""


def _child(name: str, what: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD, name, what], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(name: str) -> dict:
    jaxpr, full = _child(name, "jaxpr"), _child(name, "trace")
    return {**full, "jaxpr_s": jaxpr["seconds"], "trace_s": full["seconds"]}


def main(names: list[str]) -> None:
    print(f"{'model':<14}{'ops':>8}{'params':>10}{'make_jaxpr s':>14}{'capture s':>11}{'ratio':>7}{'peak GiB':>10}")
    for name in names:
        r = measure(name)
        print(f"{r['model']:<14}{r['num_ops']:>8}{r['params'] / 1e9:>9.1f}B{r['jaxpr_s']:>14.2f}{r['trace_s']:>11.2f}"
              f"{r['trace_s'] / r['jaxpr_s']:>7.2f}{r['peak_rss_gib']:>10.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt-1.3b", "gpt-39b", "moe-70b", "wresnet-13b", "llama3-405b", "deepseek-v3"])
