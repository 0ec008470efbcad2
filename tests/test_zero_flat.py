"""ZeRO's flat buffer (issue 31): a parameter whose dimensions the data-parallel group does not divide is still
split 1 / d by ZeRO (Megatron-LM's distributed optimizer shards one padded flat buffer), so a layout's memory counts
it that way. Before, such a parameter's master weights and Adam moments were counted whole on every replica:
Megatron-LM's 70B on H100 (hidden 8,192 over 48 replicas) read 37.6 GiB of them where ZeRO-1 keeps 1.0."""

import pytest

import autopar_lab as al
from autopar_lab import Cluster
from autopar_lab.pricing.zero import replicas
from autopar_lab.sharding.spec import ShardingSpec

H, D = 36, 8  # 36 and 3 x 36 do not divide over 8 replicas; 4 x 36 does


@pytest.fixture(scope="module")
def table():
    m = al.models.get("gpt-tiny", seq_len=8, hidden_size=H, num_heads=4, num_layers=2, batch_size=8, vocab_size=100,
                      dtype="float16")
    return al.CostTable.build(m, Cluster.preset("dgx-a100"))


def test_replicas_counts_the_devices_holding_one_shard():
    assert replicas(ShardingSpec(((), ())), (48, 8)) == 384
    assert replicas(ShardingSpec(((), (1,))), (48, 8)) == 48
    assert replicas(ShardingSpec(((0,), (1,))), (48, 8)) == 1


@pytest.mark.parametrize("zero", [1, 3])
def test_a_layer_whose_dimensions_the_group_does_not_divide_is_split_16_over_d(table, zero):
    """Rajbhandari et al. (published-measurements.md): mixed-precision Adam keeps 2 + 2 + 12 bytes a parameter; ZeRO-1
    splits the 12 over the d replicas, ZeRO-3 all 16. The zoo's GPT layer has 12 h^2 + 13 h parameters (qkv 3h^2+3h,
    projection h^2+h, MLP 4h^2+4h and 4h^2+h, two layer norms 4h), h = 36: every one of them counted 1 / 8."""
    plan = al.megatron_plan(table=table, dp=D, tp=1, pp=1, zero=zero)
    lc = plan.stages[0].layer_costs[plan.layer_names.index("layer_1")]
    P = 12 * H * H + 13 * H
    assert lc.master_bytes == pytest.approx(4 * P / D)
    assert lc.opt_bytes == pytest.approx(8 * P / D)
    assert lc.grad_bytes == pytest.approx(2 * P / (D if zero >= 2 else 1))
    assert lc.param_bytes == pytest.approx(2 * P / (D if zero >= 3 else 1))
