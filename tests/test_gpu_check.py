"""bench/gpu_check.py (issue 31 item 5): its dry run on the CPU devices runs every check the GPU run does and prints
every row beside the preset's prediction, which is the cost model's formula."""

import sys
from pathlib import Path

import jax
import pytest

import autopar_lab as al

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402 - the benchmark is a script beside the package


@pytest.mark.skipif(jax.device_count() < 2, reason="the collectives need several devices (JAX_NUM_CPU_DEVICES=8)")
def test_the_dry_run_prints_every_row_beside_the_presets_prediction(capsys):
    out = gpu_check.main(["--dry-run"])
    printed = capsys.readouterr().out
    n = jax.device_count()
    sizes = gpu_check.DRY_SIZES
    assert out["dry_run"] and out["preset"] == "dgx-h100" and out["devices"] == n
    # every check, in the printed table: the GEMM sweep, attention forward and backward, four collectives, the step
    want = ([("gemm", f"{m}x{k2}x{k} bf16") for m, k2, k in sizes.gemms]
            + [("attention", "forward,"), ("attention", "forward + backward,")]
            + [("collective", f"{kind}, ") for kind in gpu_check.COLLECTIVES] + [("llama step", "llama3-8b x1")])
    assert [r["check"] for r in out["rows"]] == [c for c, _ in want]
    lines = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(lines) == len(want)
    for line, (check, shape) in zip(lines, want):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == check and cells[1].startswith(shape), line
        assert cells[2].endswith(" ms") and cells[3].endswith(" ms") and float(cells[4]) > 0, line
    # the predictions are the preset's formulas, worked out here
    h100 = al.Cluster.preset("dgx-h100")
    dev, link = h100.device, h100.intra_host
    m, k2, k = sizes.gemms[0]
    gemm = 2 * m * k2 * k / dev.matmul_rate("bfloat16", m, k2, k) + dev.efficiency.kernel_launch_s
    assert out["rows"][0]["predicted_s"] == pytest.approx(gemm, rel=1e-12)
    B, S, H, D = sizes.attention
    assert out["rows"][len(sizes.gemms)]["predicted_s"] == pytest.approx(
        2 * B * S * S * H * D / (989.4e12 * dev.efficiency.attention), rel=1e-12)
    ar = next(r for r in out["rows"] if r["shape"].startswith("all_reduce"))
    nbytes = sizes.collective_bytes // 4 // (n * n) * (n * n) * 4
    # inside a host: a tree's log2(n) levels up and down, 2 (n-1)/n B at the link's bandwidth
    levels = (n - 1).bit_length()
    assert ar["predicted_s"] == pytest.approx(2 * levels * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth,
                                              rel=1e-12)
    assert all(r["measured_over_predicted"] == pytest.approx(r["measured_s"] / r["predicted_s"]) for r in out["rows"])


def test_the_preset_follows_the_device_name():
    assert gpu_check.preset_for("NVIDIA H200") == "dgx-h200"
    assert gpu_check.preset_for("NVIDIA H100 80GB HBM3") == "dgx-h100"
