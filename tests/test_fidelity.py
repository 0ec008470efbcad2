"""The cost model against published training runs (bench/bench_fidelity.py): Megatron-LM's weak-scaling rows priced in
their published layout, and the tensor-parallel sharding that layout pins."""

import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.pricing.memory import PARTS, memory_breakdown

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_fidelity as fidelity  # noqa: E402 - the benchmark is a script beside the package


def test_the_published_layout_pins_megatron_lms_tensor_parallelism():
    """The layout the bench prices (``al.megatron_plan(..., zero=0)``, the library's pins since issue 31)."""
    model = al.models.get("gpt-tiny", seq_len=64, hidden_size=256, num_heads=8, num_layers=2, batch_size=8,
                          vocab_size=512, dtype="float16")
    plan = al.megatron_plan(model, al.Cluster.preset("dgx-a100"), dp=2, tp=4, pp=1, zero=0)
    g, strategies = plan.op_graph, plan.stages[0].intra.strategies

    def spec(suffix):
        (s,) = [strategies[o] for o in g.ops if g.op(o).primitive == "parameter" and
                g.tensor(g.op(o).outputs[0]).kind == "param" and g.tensor(g.op(o).outputs[0]).path.endswith(suffix)]
        return str(s.out_specs[0])

    # column split of qkv and the first MLP matmul, row split of the projection and the second; the norms whole
    assert [spec(f"['layers'][1]['{w}']['w']") for w in ("qkv", "fc1", "proj", "fc2")] == ["RS1", "RS1", "S1R", "S1R"]
    assert spec("['layers'][1]['ln1']['scale']") == "R" and spec("['wte']") == "S1R"
    fwd = [(o, strategies[o]) for o in g.ops_in_layer("layer_1")
           if g.op(o).primitive == "dot_general" and g.op(o).role == "forward"]
    # two row-parallel matmuls all-reduce over the tensor-parallel axis; the rest (column-parallel, attention over
    # heads) communicate nothing
    reduces = [s for _, s in fwd if s.collectives]
    assert len(fwd) == 6 and len(reduces) == 2
    assert all(c[0] == "all_reduce" and c[1] == 1 for s in reduces for c in s.collectives)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1.7B", "7.5B", "39B"])
def test_published_rows_are_predicted_within_20_percent_and_fit(name):
    r = fidelity.row(name)
    assert abs(r["ratio"] - 1) <= 0.2, r
    assert r["fits"] and r["peak_mem_gib"] < 80
    assert sum(r["peak_parts_gib"].values()) == pytest.approx(r["peak_mem_gib"], rel=1e-9)


@pytest.mark.slow
def test_the_published_layout_is_priced_as_published():
    plan, model, gpus, pub, F = fidelity.published_plan("7.5B")
    # 36 transformer layers on one stage of 32 x 4 GPUs (4 hosts of 8: tensor parallelism inside a host), 16
    # microbatches of one sequence, full recomputation, attention through memory (no flash attention in 2021)
    (st,) = plan.stages
    assert (st.submesh, st.logical_mesh, st.remat, plan.microbatches) == ((16, 8), (32, 4), True, 16)
    assert not plan.cost.flash_attention and plan.cost.kernels > 0
    rows = memory_breakdown(plan)
    psi_per_gpu = (model.param_count - 51200 * 4096) / 4 + 51200 * 4096 / 4  # everything split 4 ways but norms
    assert rows[0]["master_bytes"] == pytest.approx(4 * psi_per_gpu, rel=0.01)
    assert sum(rows[0][p] for p in PARTS) == pytest.approx(st.peak_mem_bytes, rel=1e-12)
    assert F == pytest.approx(fidelity.published_flops(512, 2048, 36, 4096, 51200))


def test_interleaving_factor_divides_the_layers_per_stage():
    assert [fidelity.virtual_stages(n) for n in (24, 10, 3, 7)] == [2, 2, 3, 7]
