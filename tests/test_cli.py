"""The command line: JSON output contract and one-sentence errors with exit status 2."""

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def assert_one_sentence_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_graph_json_has_the_promised_keys():
    proc = run_cli("graph", "gpt-1.3b", "--layers", "2", "--batch", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("model", "num_ops", "flops_by_primitive", "flops_by_role", "param_bytes", "trace_s"):
        assert key in out
    assert out["model"] == "gpt-1.3b"
    assert set(out["flops_by_role"]) == {"forward", "backward", "update"}
    # Megatron-LM's count for the matmuls: 72 B S L H^2 (1 + S/6H + V/(12 L H)), L=2, B=8.
    B, S, L, H, V = 8, 1024, 2, 2048, 51200
    megatron = 72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * L * H))
    assert abs(out["flops_by_primitive"]["dot_general"] / megatron - 1) < 0.02


def test_graph_human_output():
    proc = run_cli("graph", "mlp")
    assert proc.returncode == 0, proc.stderr
    assert "operators" in proc.stdout and "FLOPs per step" in proc.stdout


@pytest.mark.parametrize(
    "args, needles",
    [
        (("graph", "gpt-9000b", "--json"), ["gpt-9000b", "gpt-1.3b"]),
        (("graph", "gpt-1.3b", "--layers", "many"), ["--layers"]),
        (("graph", "gpt-1.3b", "--layers", "0", "--json"), ["num_layers"]),
        (("frobnicate",), ["frobnicate"]),
        (("plan", "gpt-tiny", "--cluster", "nope:2", "--json"), ["nope:2", "PRESET:HOSTS"]),
        (("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--method", "megatron"), ["--dp"]),
        (("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--method", "megatron", "--dp", "3", "--tp", "1",
          "--pp", "1"), ["dp x tp x pp"]),
        (("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--microbatches", "lots"), ["--microbatches"]),
        (("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--remat"), ["--remat", "--method megatron"]),
        (("validate", "mlp", "--devices", "6", "--json"), ["power of two"]),
        ((), ["COMMAND"]),
    ],
)
def test_bad_input_exits_2_with_one_sentence(args, needles):
    assert_one_sentence_error(run_cli(*args), *needles)


def test_plan_json_and_out_file(tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--method", "megatron", "--dp", "2", "--tp", "2",
                   "--pp", "2", "--microbatches", "2", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    for key in ("model", "cluster", "method", "step_time_s", "samples_per_s", "compute_s", "comm_s", "reshard_s",
                "stage_comm_s", "bubble_s", "peak_mem_bytes", "mem_limit_bytes", "microbatches", "stages", "solve_s"):
        assert key in rep
    assert [s["logical_mesh"] for s in rep["stages"]] == [[2, 2], [2, 2]]
    assert json.loads(out.read_text())["step_time_s"] == rep["step_time_s"]


def test_plan_megatron_with_remat_reports_rematerialised_stages():
    proc = run_cli("plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--method", "megatron", "--dp", "2", "--tp", "2",
                   "--pp", "2", "--microbatches", "2", "--remat", "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert "remat" in rep["method"] and all(st["remat"] for st in rep["stages"])
