"""Benchmark: intra-op plans against what XLA compiles (issue: "predicted collective bytes within +-10% of what XLA
compiled, numerics equal").

For each zoo model (at the small float32 sizes of ``autopar_lab.validate.SMALL_OVERRIDES``) and each logical view of
one host of 8 CPU devices, solve the intra-op ILP on the ``cpu`` preset, apply the plan to the real step, compile it,
run one step sharded and one on a single device, and print one table: predicted and compiled collective bytes
(per-device buffers, see ``autopar_lab.validate.predicted_collectives``), their ratio, the ratio with a value
resharded alike for several consumers counted once ("dedup", as XLA computes it once), the ratio with the
conversions XLA's partitioner moves across their reader taken as XLA moves them ("XLA moves",
``autopar_lab.validate.xlamoves``) and the seconds the plan's price charges for those ("moved us"), counts per kind
(predicted/compiled; AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all) and the numerics error.

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu .venv/bin/python bench/bench_validate.py [--json] [mlp gpt-1.3b ...]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

MODELS = ("mlp", "gpt-1.3b", "moe-tiny", "wresnet-tiny")
MESHES = ((8, 1), (2, 4))
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
         "collective_permute": "CP"}


def _mb(x: float) -> str:
    return f"{x / 2**20:.3f}"


def _counts(rep: dict) -> str:
    parts = []
    for kind, short in SHORT.items():
        p, c = rep["predicted"][kind]["count"], rep["compiled"][kind]["count"]
        if p or c:
            parts.append(f"{short} {p}/{c}")
    return " ".join(parts) or "-"


def _batch(name: str) -> int:
    from autopar_lab.validate import SMALL_OVERRIDES

    family = next(f for f in SMALL_OVERRIDES if name.startswith(f))
    return SMALL_OVERRIDES[family]["batch_size"]


def main(argv: list[str]) -> None:
    from autopar_lab.validate import validate_plan

    as_json = "--json" in argv
    names = [a for a in argv if not a.startswith("--")] or list(MODELS)
    rows = []
    for name in names:
        for shape in MESHES:
            if _batch(name) % shape[0]:
                continue  # the batch does not divide along mesh axis 0
            rep = validate_plan(name, devices=8, mesh_shape=shape)
            rows.append(rep)
            if not as_json:
                print(f"  done {name} {shape[0]}x{shape[1]} (compile {rep['compile_s']:.1f} s)", file=sys.stderr)
    if as_json:
        print(json.dumps(rows))
        return
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The markdown table of validate_plan reports."""
    from autopar_lab.validate import total_bytes

    lines = []
    head = (f"| model | mesh | predicted MiB | compiled MiB | ratio | ratio dedup | ratio XLA moves | moved us | "
            f"counts pred/compiled | max abs err | pred step ms | solve s | compile s |")
    lines.append(head)
    lines.append("|" + "|".join("---" for _ in range(13)) + "|")
    for r in rows:
        ratio = "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}"
        dedup = "-" if r["bytes_ratio_dedup"] is None else f"{r['bytes_ratio_dedup']:.3f}"
        moved = "-" if r["bytes_ratio_xla"] is None else f"{r['bytes_ratio_xla']:.3f}"
        err = "-" if r["numerics_max_abs_err"] is None else f"{r['numerics_max_abs_err']:.1e}"
        lines.append(f"| {r['model']} | {r['logical_mesh'][0]}x{r['logical_mesh'][1]} | {_mb(total_bytes(r['predicted']))} | "
              f"{_mb(total_bytes(r['compiled']))} | {ratio} | {dedup} | {moved} | {1e6 * r['xla_moves_s']:.1f} | "
              f"{_counts(r)} | {err} | "
              f"{1e3 * r['predicted_step_s']:.1f} | {r['solve_s']:.1f} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
