"""Benchmark: each notebook's run time as `make test` runs it (issue 34: every notebook in under a minute).

Runs tests/test_notebooks.py's test_notebook_runs (each notebook executed headless in a fresh kernel, as `make test`
does) with AUTOPAR_NOTEBOOK_TIMES set, so the test appends each notebook's wall seconds, its kernel's CPU seconds and
the load average before and after as a JSON line; then prints bench/RESULTS.md's notebook-times table. The wall time
is the load's as much as the notebook's on a shared machine: the CPU seconds compare across loads.

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu .venv/bin/python bench/bench_notebooks.py [-k 05]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def table(rows: list[dict]) -> str:
    """The markdown table: a column per notebook (its two-digit number), wall and kernel CPU seconds."""
    rows = sorted(rows, key=lambda r: r["notebook"])
    head = "| notebook | " + " | ".join(r["notebook"][:2] for r in rows) + " |"
    rule = "|---" * (len(rows) + 1) + "|"
    wall = "| wall s (kernel CPU s) | " + " | ".join(f"{r['wall_s']:.0f} ({r['kernel_cpu_s']:.0f})" for r in rows) + " |"
    loads = [x for r in rows for x in r["load"]]
    return "\n".join([head, rule, wall]) + f"\n\nload {min(loads):.1f}-{max(loads):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only the notebooks whose test id matches (pytest's -k)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "times.jsonl"
        env = dict(os.environ, AUTOPAR_NOTEBOOK_TIMES=str(out))
        select = "test_notebook_runs" + (f" and {args.k}" if args.k else "")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_notebooks.py", "-k", select], cwd=ROOT, env=env)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if rows:
        print(table(rows))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
