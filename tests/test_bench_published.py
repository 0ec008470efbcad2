"""bench/bench_published.py: the auto plan against a published Megatron-LM layout, priced by the same model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_published as published  # noqa: E402 - the benchmark is a script beside the package


@pytest.mark.slow  # traces GPT-1.7B at 32 GPUs and plans it with four schedules: about a minute
def test_auto_is_at_least_as_fast_as_the_published_layout_on_the_smallest_row():
    r = published.row("1.7B")
    assert r["auto_fits"]
    assert r["auto_step_s"] <= r["published_step_s"] * (1 + 1e-9)
    assert r["speedup"] == pytest.approx(r["published_step_s"] / r["auto_step_s"])
    # the table names what changed, and the published layout is what bench_fidelity prices
    assert r["published"]["stages"] == 1 and r["published"]["microbatches"] == 16
    assert r["published"]["meshes"] == "1 x 32 GPUs as (32, 1)"
    assert r["changed"] != "nothing" or r["speedup"] == pytest.approx(1.0)
    assert r["schedules_tried"].startswith("schedule auto:")


def test_changes_name_every_decision_that_differs():
    pub = {"stages": 2, "meshes": "2 x 256 GPUs as (32, 8)", "microbatches": 48, "schedule": "interleaved v=2",
           "remat": 2, "fsdp_stages": 0, "sp_stages": 0}
    auto = dict(pub, stages=4, meshes="4 x 128 GPUs as (16, 8)", microbatches=64, schedule="zb-h1", remat=1,
                sp_stages=4)
    line = published.changes(pub, auto)
    assert "2 stage(s) of 256 GPUs as (32, 8) -> 4 stage(s): 4 x 128 GPUs as (16, 8)" in line
    assert "48 -> 64 microbatches" in line and "interleaved v=2 -> zb-h1" in line
    assert "remat on 2 -> 1" in line and "sequence parallelism on 0 -> 4" in line and "FSDP" not in line
    assert published.changes(pub, dict(pub)) == "nothing"
