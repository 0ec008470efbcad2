"""Issue 30's command lines as a user types them, from another directory: Llama 3 70B on 64 H100s at sequence 8,192
in bf16 (by zoo name and by config.json), and on a TPU v5p slice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from test_from_config import LLAMA3_70B

LLAMA_70B_RUN = ["--seq-len", "8192", "--batch", "512", "--precision", "bf16"]


def _cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def _fits_with_breakdown(out) -> dict:
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "number format: bf16" in out.stdout
    stages = [ln for ln in lines if ln.strip().startswith("stage ") and "peak" in ln]
    assert stages and all(p in ln for ln in stages for p in ("params", "grads", "master", "optimizer"))
    return {"text": out.stdout}


@pytest.mark.slow
def test_llama3_70b_on_64_h100s_by_name_and_by_config_json(tmp_path):
    """By zoo name (--json) and by config.json (the text a user reads): one model, one plan. Two runs, not three:
    the text run is the config.json one, so its plan is checked against the JSON's stage by stage."""
    by_name = _cli("plan", "llama3-70b", "--cluster", "dgx-h100:8", *LLAMA_70B_RUN, "--json", cwd=tmp_path)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    plan = json.loads(by_name.stdout)
    assert plan["precision"] == "bf16" and plan["hosts"] == 8
    assert max(plan["peak_mem_bytes"]) <= plan["mem_limit_bytes"]          # a plan that fits 80 GB
    folder = tmp_path / "Meta-Llama-3-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_70B))
    by_file = _cli("plan", str(folder / "config.json"), "--cluster", "dgx-h100:8", *LLAMA_70B_RUN, cwd=tmp_path)
    text = _fits_with_breakdown(by_file)["text"]
    assert "does not fit" not in text
    head = text.strip().splitlines()[0]
    assert head.startswith("meta-llama-3-70b on dgx-h100:8")               # the model the file names
    step = float(re.search(r"step ([0-9.e+-]+) s", head).group(1))
    assert step == pytest.approx(plan["step_time_s"], rel=1e-3)            # the same plan as by name
    stages = re.findall(r"stage (\d+): layers (\d+)-(\d+) .* on submesh (\d+)x(\d+) as (\d+)x(\d+)", text)
    assert [tuple(map(int, st)) for st in stages] == [
        (k, *st["layers"], *st["submesh"], *st["logical_mesh"]) for k, st in enumerate(plan["stages"])]


@pytest.mark.slow
def test_llama3_70b_plans_on_a_tpu_v5p_slice(tmp_path):
    out = _cli("plan", "llama3-70b", "--cluster", "tpu-v5p:128", *LLAMA_70B_RUN, "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    assert plan["cluster"].startswith("tpu-v5p")
    assert sum(s["submesh"][0] * s["submesh"][1] for s in plan["stages"]) == 128
    assert max(plan["peak_mem_bytes"]) <= plan["mem_limit_bytes"]


def test_a_model_flag_the_model_does_not_have_is_one_sentence(tmp_path):
    out = _cli("graph", "gpt-tiny", "--kv-heads", "2", cwd=tmp_path)
    assert out.returncode == 2 and "--kv-heads" in out.stderr and "Traceback" not in out.stderr
    out = _cli("graph", "llama3-tiny", "--kv-heads", "3", cwd=tmp_path)
    assert out.returncode == 2 and "num_kv_heads" in out.stderr and "Traceback" not in out.stderr


MEGATRON_8B = ["--batch", "16", "--seq-len", "2048", "--precision", "bf16", "--method", "megatron", "--dp", "2",
               "--tp", "4", "--pp", "1"]


@pytest.mark.slow
def test_megatron_layout_flags_price_what_megatron_plan_prices(tmp_path):
    """Llama 3 8B (32 layers, planned on its copy) on one DGX H100 as an engineer writes Megatron-LM's layout on the
    command line: ZeRO-1, sequence parallelism, one sequence a microbatch. The CLI prices what al.megatron_plan
    prices, and each flag moves the plan as it should (ZeRO-1 stores less optimizer state than ZeRO-0; with no
    microbatch flag the micro-batch size is searched)."""
    import autopar_lab as al

    flags = [*MEGATRON_8B, "--zero", "1", "--sequence-parallel", "--micro-batch-size", "1", "--json"]
    out = _cli("plan", "llama3-8b", "--cluster", "dgx-h100:1", *flags, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    model = al.models.get("llama3-8b", batch_size=16, seq_len=2048)
    direct = al.megatron_plan(model, al.Cluster.parse("dgx-h100:1"), dp=2, tp=4, pp=1, zero=1,
                              sequence_parallel=True, micro_batch_size=1, precision="bf16")
    assert got["method"].startswith("megatron(dp=2,tp=4,pp=1,sp,zero=1")
    assert got["microbatches"] == 8                                   # 16 sequences over dp 2 x 1 a microbatch
    assert got["step_time_s"] == direct.cost.step_time_s
    assert got["peak_mem_bytes"] == list(direct.cost.peak_mem_bytes)
    # no microbatch count nor size: the micro-batch sizes 1, 2, 4 and 8 priced, the fastest that fits kept
    zero0 = json.loads(_cli("plan", "llama3-8b", "--cluster", "dgx-h100:1", *MEGATRON_8B, "--zero", "0",
                            "--sequence-parallel", "--json", cwd=tmp_path).stdout)
    auto = [n for n in zero0["notes"] if n.startswith("microbatches auto:")]
    assert zero0["microbatches"] in (8, 4, 2, 1) and auto and "of 1, 2, 4, 8 priced" in auto[0] and zero0["fits"]
    optimizer = [s["optimizer_bytes"] for s in got["memory"]], [s["optimizer_bytes"] for s in zero0["memory"]]
    assert all(b / a == pytest.approx(2, rel=1e-6) for a, b in zip(*optimizer))  # split over 2 data-parallel ranks


@pytest.mark.parametrize(("flags", "says"), [
    (["--method", "auto", "--sequence-parallel"], "--sequence-parallel"),
    (["--method", "data", "--ep", "2"], "--ep"),
    (["--method", "megatron", "--dp", "8", "--tp", "1", "--pp", "1", "--micro-batch-size", "1", "--microbatches", "2"],
     "--micro-batch-size and --microbatches"),
    (["--method", "megatron", "--dp", "8", "--tp", "1", "--pp", "1", "--zero", "4"], "--zero"),
    (["--from-config", "megatron.sh", "--zero", "1"], "--zero conflicts with --from-config"),
])
def test_a_megatron_layout_flag_out_of_place_is_one_sentence(capsys, flags, says):
    """In process (the subprocess path is the slow test above): exit 2, the flag named, no traceback."""
    from autopar_lab import cli

    try:
        code = cli.main(["plan", "gpt-tiny", "--cluster", "dgx-h100:1", *flags])
    except SystemExit as e:  # argparse's own check of --zero's choices
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
