"""Sharding specs, per-primitive strategies and resharding costs (autopar_lab.sharding)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from autopar_lab.cluster import Efficiency
from autopar_lab.graph.capture import trace
from autopar_lab.graph.opgraph import OpNode
from autopar_lab.sharding import (
    ShardingSpec,
    candidate_specs,
    plan_reshard,
    register_rule,
    reshard_cost,
    strategies_for,
    unregister_rule,
    unsupported_ops,
)
from autopar_lab.sharding.rules import reshape_groups
from autopar_lab.sharding.strategies import follow_strategies

F32 = jnp.float32
SDS = jax.ShapeDtypeStruct


# --- a stand-in logical mesh: alpha-beta with known a, b (the real LogicalMesh has the same methods) -------------
@dataclass(frozen=True)
class FakeDevice:
    """A datasheet device: every rate at its peak (no efficiency below it), no fused attention."""

    flops: float = 1e12
    memory_bandwidth: float = 1e11
    efficiency: Efficiency = Efficiency()

    def peak(self, dtype="float32") -> float:
        return self.flops

    vector_rate = attention_rate = peak

    def matmul_rate(self, dtype, m, n, k, batch=1) -> float:
        return self.flops

    @property
    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth


@dataclass(frozen=True)
class FakeCluster:
    device: FakeDevice = field(default_factory=FakeDevice)


@dataclass(frozen=True)
class FakeMesh:
    shape: tuple
    a: float = 1e-5
    b: float = 1e-9
    cluster: FakeCluster = field(default_factory=FakeCluster)

    def axis_size(self, axis) -> int:
        return self.shape[0] * self.shape[1] if isinstance(axis, tuple) else self.shape[axis]

    def _c(self, nbytes, axis, f):
        n = self.axis_size(axis)
        return 0.0 if n == 1 else self.a + self.b * f(n) * nbytes

    def all_gather(self, nbytes, axis):
        return self._c(nbytes, axis, lambda n: (n - 1) / n)

    def reduce_scatter(self, nbytes, axis):
        return self._c(nbytes, axis, lambda n: (n - 1) / n)

    def all_reduce(self, nbytes, axis):
        return self._c(nbytes, axis, lambda n: 2 * (n - 1) / n)

    def all_to_all(self, nbytes, axis):
        return self._c(nbytes, axis, lambda n: (n - 1) / n**2)


M18, M24 = FakeMesh((1, 8)), FakeMesh((2, 4))


def real_mesh(shape=(1, 8)):
    from autopar_lab.cluster import Cluster

    return Cluster.preset("p3.16xlarge", hosts=1).logical_mesh((1, 8), shape)


def ops(g, primitive):
    return [o for o in g if o.primitive == primitive]


def by_specs(strats, out=None, ins=None):
    """Strategies whose output / input specs match the given strings."""
    res = []
    for s in strats:
        if out is not None and tuple(map(str, s.out_specs)) != tuple(out):
            continue
        if ins is not None and tuple(map(str, s.in_specs)) != tuple(ins):
            continue
        res.append(s)
    return res


def check_all_valid(op, strats, mesh_shape):
    assert strats, "every operator has at least one strategy"
    assert len({s.key for s in strats}) == len(strats), "duplicates are removed"
    for s in strats:
        assert len(s.out_specs) == len(op.out_shapes) and len(s.in_specs) == len(op.in_shapes)
        for spec, shape in list(zip(s.out_specs, op.out_shapes)) + list(zip(s.in_specs, op.in_shapes)):
            assert spec.is_valid(shape, mesh_shape), (op.describe(), s.name)
        assert s.cost == pytest.approx(s.compute_s + s.comm_s)
        assert s.comm_s >= 0 and s.compute_s >= 0


# --- specs ----------------------------------------------------------------------------------------------------
@st.composite
def specs(draw, max_rank=4):
    rank = draw(st.integers(0, max_rank))
    dims = [()] * rank
    if rank:
        choice = draw(st.sampled_from(["none", "0", "1", "01", "0|1"]))
        d0, d1 = draw(st.integers(0, rank - 1)), draw(st.integers(0, rank - 1))
        if choice == "0":
            dims[d0] = (0,)
        elif choice == "1":
            dims[d0] = (1,)
        elif choice == "01":
            dims[d0] = (0, 1)
        elif choice == "0|1" and d0 != d1:
            dims[d0], dims[d1] = (0,), (1,)
    return ShardingSpec(tuple(dims))


@settings(max_examples=60, deadline=None)
@given(specs())
def test_spec_string_and_partition_spec_round_trip(spec):
    assert ShardingSpec.parse(str(spec), rank=spec.rank) == spec
    if spec.rank:
        assert ShardingSpec.parse(str(spec)) == spec
    pspec = spec.to_partition_spec()
    assert isinstance(pspec, P) and len(pspec) == spec.rank
    assert ShardingSpec.from_partition_spec(pspec, rank=spec.rank) == spec
    assert ShardingSpec.from_partition_spec(spec.to_partition_spec(("dp", "tp")), axis_names=("dp", "tp")) == spec


def test_spec_forms():
    assert ShardingSpec.parse("S0R").dims == ((0,), ())
    assert ShardingSpec.parse("RS01").to_partition_spec() == P(None, ("x", "y"))
    assert ShardingSpec.parse("S1S0").to_partition_spec() == P("y", "x")
    assert str(ShardingSpec.from_partition_spec(P("x"), rank=3)) == "S0RR"
    assert str(ShardingSpec.replicated(0)) == "" and ShardingSpec.parse("", rank=0).rank == 0
    assert ShardingSpec.parse("R", rank=0).rank == 0 and ShardingSpec.parse("R").rank == 1
    with pytest.raises(ValueError, match="S0, S1 or S01"):
        ShardingSpec.parse("S2R")
    with pytest.raises(ValueError, match="twice"):
        ShardingSpec.parse("S0S0")
    with pytest.raises(ValueError, match="3 dimensions"):
        ShardingSpec.parse("RRR", rank=2)


def test_divisibility_shapes_and_bytes():
    s = ShardingSpec.parse("S01R")
    assert s.is_valid((16, 3), (2, 4)) and not s.is_valid((12, 3), (2, 4))
    assert ShardingSpec.parse("S0R").is_valid((12, 3), (2, 4)) and ShardingSpec.parse("S1R").is_valid((12, 3), (2, 4))
    assert s.shard_shape((16, 3), (2, 4)) == (2, 3)
    assert ShardingSpec.parse("S0S1").bytes_per_device((8, 16), "float32", (2, 4)) == 4 * 4 * 4
    assert ShardingSpec.parse("S0R").is_valid((3, 3), (1, 8))  # a size-1 axis splits nothing
    with pytest.raises(ValueError, match="does not evenly shard"):
        s.shard_shape((12, 3), (2, 4))
    # Size-1 axes are never used by candidates: on (1, 8), S0 / S01 would duplicate R / S1.
    assert [str(c) for c in candidate_specs((16, 16), (1, 8))] == ["RR", "S1R", "RS1"]
    assert len(candidate_specs((16, 16), (2, 4))) == 9
    assert "S01R" not in [str(c) for c in candidate_specs((12, 16), (2, 4))]


# --- dot_general ----------------------------------------------------------------------------------------------
B, H = 64, 256


@pytest.fixture(scope="module")
def mlp_grad_graph():
    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    return trace(jax.grad(loss, argnums=(0, 1)), SDS((H, 4 * H), F32), SDS((4 * H, H), F32), SDS((B, H), F32),
                 batch_argnums=(2,))


def test_megatron_column_and_row_split_on_1x8():
    g = trace(lambda x, w1, w2: (x @ w1) @ w2, SDS((B, H), F32), SDS((H, 4 * H), F32), SDS((4 * H, H), F32))
    first, second = ops(g, "dot_general")
    col = by_specs(strategies_for(first, M18), out=["RS1"], ins=["RR", "RS1"])
    assert len(col) == 1 and col[0].collectives == () and col[0].comm_s == 0
    row = by_specs(strategies_for(second, M18), out=["RR"], ins=["RS1", "S1R"])
    assert len(row) == 1
    assert row[0].collectives == (("all_reduce", 1, B * H * 4),)
    assert row[0].comm_s == pytest.approx(M18.all_reduce(B * H * 4, 1))
    # with the real cluster model: the same collective, priced by LogicalMesh
    mesh = real_mesh((1, 8))
    (real,) = by_specs(strategies_for(second, mesh), out=["RR"], ins=["RS1", "S1R"])
    assert real.comm_s == pytest.approx(mesh.all_reduce(B * H * 4, 1))
    # 1D mesh: replicated, i, j, k + all-reduce, k + reduce-scatter
    assert len(strategies_for(first, M18)) == 5


def test_dot_general_2d_patterns_and_costs():
    g = trace(lambda x, w: x @ w, SDS((B, H), F32), SDS((H, 4 * H), F32))
    (dot,) = ops(g, "dot_general")
    strats = strategies_for(dot, M24)
    check_all_valid(dot, strats, (2, 4))
    names = {s.name for s in strats}
    for expected in [
        "S0S1 = S0R x RS1",  # i and j over different axes: no communication
        "S1S0 = S1R x RS0",
        "S0R = S0S1 x S1R [all_reduce@1]",  # i and k
        "RS1 = RS0 x S0S1 [all_reduce@0]",  # j and k
        "S01R = S01R x RR",  # 1D, both axes flattened
        "RS01 = RR x RS01",
        "RR = RS01 x S01R [all_reduce@01]",
        "S0R = S0R x RR",  # 1D, one axis
        "RR = RS1 x S1R [all_reduce@1]",
        "RR = RR x RR",
    ]:
        assert expected in names, expected
    (ik,) = [s for s in strats if s.name == "S0R = S0S1 x S1R [all_reduce@1]"]
    assert ik.collectives == (("all_reduce", 1, B // 2 * H * 4 * 4),)  # the output shard, S0R
    (ij,) = [s for s in strats if s.name == "S0S1 = S0R x RS1"]
    rr = by_specs(strats, out=["RR"], ins=["RR", "RR"])[0]
    # the work is divided over all 8 devices: compute is the roofline of one shard
    dev = M24.cluster.device
    shard_bytes = 4 * (B // 2 * H + H * 4 * H // 4 + B // 2 * 4 * H // 4)
    assert ij.compute_s == pytest.approx(max(dot.flops / 8 / dev.peak(), shard_bytes / dev.memory_bandwidth))
    assert ij.cost < rr.cost
    assert ij.mem_bytes == B * 4 * H * 4 / 8
    assert len(strats) <= 24


def test_batched_dot_and_moe_expert_split():
    # attention scores: batch dims b and h split like i (data parallel on b, heads on the other axis)
    g = trace(lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), SDS((8, 4, 16, 32), F32), SDS((8, 4, 16, 32), F32))
    (dot,) = ops(g, "dot_general")
    names = {s.name for s in strategies_for(dot, M24)}
    assert "S0S1RR = S0S1RR x S0S1RR" in names
    # GShard dispatch "gsec,gsm->egcm": group split and expert split both exist; between them is an all-to-all
    # (g=4, s=32, e=8, c=2, m=16): distinct sizes so the dims can be told apart
    g = trace(lambda d, x: jnp.einsum("gsec,gsm->egcm", d, x), SDS((4, 32, 8, 2), F32), SDS((4, 32, 16), F32))
    (dot,) = ops(g, "dot_general")
    strats = strategies_for(dot, M24)
    check_all_valid(dot, strats, (2, 4))
    out = dot.out_shapes[0]
    outs = {str(s.out_specs[0]) for s in strats if not s.collectives}
    group_split = "".join("S0" if out[d] == 4 else "R" for d in range(len(out)))
    assert group_split in outs
    expert_split = "".join("S0" if out[d] == 8 else "R" for d in range(len(out)))
    assert expert_split in outs
    secs, cols = reshard_cost(ShardingSpec.parse(group_split), ShardingSpec.parse(expert_split), out, "float32", M24)
    assert [c[0] for c in cols] == ["all_to_all"] and cols[0][1] == 0
    assert secs == pytest.approx(M24.all_to_all(math.prod(out) * 4, 0))


def test_weight_gradient_reduce_scatter(mlp_grad_graph):
    g = mlp_grad_graph
    wgrads = [o for o in ops(g, "dot_general") if o.role == "backward" and o.out_shapes[0] == (H, 4 * H)]
    assert wgrads, "dW1 = x^T dY contracts over the batch"
    (dw,) = wgrads
    (lc, _rc), _ = dw.params["dimension_numbers"]
    strats = strategies_for(dw, M18)
    rs = [s for s in strats if s.collectives and s.collectives[0][0] == "reduce_scatter"]
    ar = [s for s in strats if s.collectives and s.collectives[0][0] == "all_reduce"]
    assert rs and ar
    (rs1,) = rs
    # the batch (contracted) dim is split over axis 1, the gradient comes out sharded over that same axis
    assert rs1.in_specs[0].dims[lc[0]] == (1,)
    assert rs1.out_specs[0].axes == {1}
    assert rs1.collectives == (("reduce_scatter", 1, H * 4 * H * 4),)
    assert rs1.comm_s < ar[0].comm_s and rs1.mem_bytes == ar[0].mem_bytes / 8
    for op in g:
        check_all_valid(op, strategies_for(op, M24), (2, 4))
    assert unsupported_ops(g) == []


def test_divisibility_drops_strategies():
    g = trace(lambda x, w: x @ w, SDS((6, 256), F32), SDS((256, 1024), F32))
    (dot,) = ops(g, "dot_general")
    strats = strategies_for(dot, M18)
    assert all(s.out_specs[0].dims[0] == () for s in strats), "6 rows do not split 8 ways"
    strats = strategies_for(dot, M24)
    assert not [s for s in strats if s.out_specs[0].dims[0] in ((1,), (0, 1))]
    assert [s for s in strats if s.out_specs[0].dims[0] == (0,)]


# --- conv -----------------------------------------------------------------------------------------------------
def _conv(x, w, groups=1):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=groups)


def test_conv_strategies():
    g = trace(_conv, SDS((8, 16, 16, 32), F32), SDS((3, 3, 32, 64), F32))
    (conv,) = ops(g, "conv_general_dilated")
    strats = strategies_for(conv, M18)
    check_all_valid(conv, strats, (1, 8))
    assert by_specs(strats, out=["S1RRR"], ins=["S1RRR", "RRRR"])[0].collectives == ()  # batch
    assert by_specs(strats, out=["RRRS1"], ins=["RRRR", "RRRS1"])[0].collectives == ()  # output feature
    (cin,) = by_specs(strats, out=["RRRR"], ins=["RRRS1", "RRS1R"])  # input feature: contracted
    assert cin.collectives == (("all_reduce", 1, 8 * 16 * 16 * 64 * 4),)
    # the weight gradient is a convolution too; it contracts over the batch and can reduce-scatter
    g = trace(jax.grad(lambda w, x: _conv(x, w).sum()), SDS((3, 3, 32, 64), F32), SDS((8, 16, 16, 32), F32))
    wgrad = [o for o in ops(g, "conv_general_dilated") if o.out_shapes[0] == (3, 3, 32, 64)]
    assert wgrad and any(s.collectives and s.collectives[0][0] == "reduce_scatter"
                         for s in strategies_for(wgrad[0], M18))
    # grouped convolution: only the batch splits
    g = trace(lambda x, w: _conv(x, w, groups=2), SDS((8, 16, 16, 32), F32), SDS((3, 3, 16, 64), F32))
    (conv,) = ops(g, "conv_general_dilated")
    assert {str(s.out_specs[0]) for s in strategies_for(conv, M18)} == {"RRRR", "S1RRR"}


# --- data movement --------------------------------------------------------------------------------------------
def test_reshape_split_and_merge():
    assert reshape_groups((4, 6, 8), (24, 2, 4)) == [([0, 1], [0]), ([2], [1, 2])]
    assert reshape_groups((1, 8, 1), (8,)) == [([1], [0])]
    g = trace(lambda x: x.reshape(8, 4, 64).transpose(1, 0, 2).reshape(4, 512), SDS((32, 64), F32))
    split, tr, merge = [o for o in g if o.primitive in ("reshape", "transpose")]
    m = {str(s.in_specs[0]): str(s.out_specs[0]) for s in strategies_for(split, M18)}
    assert m == {"RR": "RRR", "S1R": "S1RR", "RS1": "RRS1"}  # a split dim maps to the first dim it becomes
    m = {str(s.in_specs[0]): str(s.out_specs[0]) for s in strategies_for(tr, M18)}
    assert m["S1RR"] == "RS1R"
    m = {str(s.in_specs[0]): str(s.out_specs[0]) for s in strategies_for(merge, M18)}
    assert m == {"RRR": "RR", "RS1R": "RS1"}  # merged dims keep the split on the outermost one only
    # 32 -> (2, 16): the first resulting dim (2) cannot carry an 8-way split: that strategy is dropped
    g = trace(lambda x: x.reshape(2, 16, 64), SDS((32, 64), F32))
    (r,) = ops(g, "reshape")
    assert {str(s.in_specs[0]) for s in strategies_for(r, M18)} == {"RR", "RS1"}


def test_elementwise_with_broadcasting():
    g = trace(lambda x, b: jnp.tanh(x * 2.0 + b), SDS((64, 128), F32), SDS((128,), F32))
    mul = ops(g, "mul")[0]
    strats = strategies_for(mul, M24)
    check_all_valid(mul, strats, (2, 4))
    assert len(strats) == 9  # RR, 3 x S?R, 3 x RS?, S0S1, S1S0: at most two dims split
    assert all(s.in_specs[1].rank == 0 for s in strats)  # the scalar is replicated
    assert all(s.in_specs[0] == s.out_specs[0] for s in strats)
    # [64, 128] + [1, 128]: the size-1 (broadcast) dim of the bias stays replicated whatever the output does
    (add,) = ops(g, "add")
    m = {str(s.out_specs[0]): tuple(map(str, s.in_specs)) for s in strategies_for(add, M24)}
    assert m["S0R"] == ("S0R", "RR") and m["S0S1"] == ("S0S1", "RS1") and m["RS01"] == ("RS01", "RS01")
    (tanh,) = ops(g, "tanh")
    g = trace(lambda b: jax.lax.broadcast_in_dim(b, (64, 128), (1,)), SDS((128,), F32))
    (bc,) = ops(g, "broadcast_in_dim")
    m = {str(s.out_specs[0]): str(s.in_specs[0]) for s in strategies_for(bc, M24)}
    assert m["S0R"] == "R" and m["RS1"] == "S1" and m["S0S1"] == "S1"  # a new (broadcast) dim needs nothing
    # splitting over all 8 devices is the cheapest way to run an elementwise op
    assert {s.cost for s in strategies_for(tanh, M24) if s.out_specs[0].axes == {0, 1}} == {
        min(s.cost for s in strategies_for(tanh, M24))
    }


def test_reductions_and_fixed_dims():
    g = trace(lambda x: (x.sum(axis=1), jnp.cumsum(x, axis=0), jnp.sort(x, axis=1), x[:, 2:6],
                         jnp.concatenate([x, x], 0), jnp.argmax(x, axis=0)), SDS((16, 32), F32))
    (red,) = ops(g, "reduce_sum")
    strats = strategies_for(red, M18)
    (split_reduced,) = by_specs(strats, ins=["RS1"])
    assert split_reduced.collectives == (("all_reduce", 1, 16 * 4),) and str(split_reduced.out_specs[0]) == "R"
    assert by_specs(strats, ins=["S1R"])[0].collectives == ()
    (arg,) = ops(g, "argmax")
    assert by_specs(strategies_for(arg, M18), ins=["S1R"])[0].collectives[0][0] == "all_reduce"
    assert {str(s.out_specs[0]) for s in strategies_for(ops(g, "cumsum")[0], M18)} == {"RR", "RS1"}
    assert {str(s.out_specs[0]) for s in strategies_for(ops(g, "sort")[0], M18)} == {"RR", "S1R"}
    assert {str(s.out_specs[0]) for s in strategies_for(ops(g, "slice")[0], M18)} == {"RR", "S1R"}
    assert {str(s.out_specs[0]) for s in strategies_for(ops(g, "concatenate")[0], M18)} == {"RR", "RS1"}


def test_gather_and_scatter_embeddings():
    V, D = 1024, 64
    g = trace(lambda t, i: jnp.take(t, i, axis=0), SDS((V, D), F32), SDS((8, 16), jnp.int32))
    (gather,) = ops(g, "gather")
    strats = strategies_for(gather, M18)
    check_all_valid(gather, strats, (1, 8))
    out_bytes = 8 * 16 * D * 4
    (vocab,) = by_specs(strats, ins=["S1R", "RRR"])  # vocabulary-parallel table: partial lookups, all-reduce
    assert vocab.collectives == (("all_reduce", 1, out_bytes),) and str(vocab.out_specs[0]) == "RRR"
    assert by_specs(strats, out=["S1RR"], ins=["RR", "S1RR"])[0].collectives == ()  # batch (indices) split
    assert by_specs(strats, out=["RRS1"], ins=["RS1", "RRR"])[0].collectives == ()  # embedding-dim split
    # the embedding gradient: scatter-add of row updates
    g = trace(lambda t, i: jax.grad(lambda t: jnp.take(t, i, axis=0).sum())(t), SDS((V, D), F32),
              SDS((8, 16), jnp.int32))
    (sc,) = ops(g, "scatter-add")
    strats = strategies_for(sc, M18)
    check_all_valid(sc, strats, (1, 8))
    assert by_specs(strats, out=["S1R"], ins=["S1R", "RRR", "RRR"])[0].collectives == ()  # rows where they live
    batch = [s for s in strats if str(s.in_specs[2]) == "S1RR"]
    kinds = {s.collectives[0][0] for s in batch}
    assert kinds == {"all_reduce", "reduce_scatter"}
    assert all(s.collectives[0][2] == V * D * 4 for s in batch)


def test_scan_slice_stack_parameter_output():
    def f(ws, x):
        def body(h, w):
            h = jnp.tanh(h @ w)
            return h, h

        return jax.lax.scan(body, x, ws)

    g = trace(f, SDS((3, 64, 64), F32), SDS((16, 64), F32), max_unroll=8)
    sl = ops(g, "scan_slice")[0]
    strats = strategies_for(sl, M18)
    assert {(str(s.in_specs[0]), str(s.out_specs[0])) for s in strats} == {("RRR", "RR"), ("RS1R", "S1R"),
                                                                            ("RRS1", "RS1")}
    (stack,) = ops(g, "scan_stack")
    for s in strategies_for(stack, M18):
        assert s.out_specs[0].dims[0] == ()
        assert all(i.dims == s.out_specs[0].dims[1:] for i in s.in_specs)
    param = ops(g, "parameter")[0]
    ps = strategies_for(param, M18)
    assert {str(s.out_specs[0]) for s in ps} == {"RRR", "RS1R", "RRS1"}
    assert all(s.cost == 0 for s in ps)
    assert {s.mem_bytes for s in ps} == {3 * 64 * 64 * 4, 3 * 64 * 64 * 4 / 8}
    out = ops(g, "output")[0]
    for s in strategies_for(out, M18):
        assert s.out_specs == () and s.name == str(s.in_specs[0]) and s.cost == 0


# --- registry -------------------------------------------------------------------------------------------------
def _cond_graph():
    return trace(lambda p, x: jax.lax.cond(p, lambda x: x + 1, lambda x: x * 2, x), SDS((), jnp.bool_),
                 SDS((16, 32), F32))


def test_unknown_primitive_is_replicated_with_warning():
    g = _cond_graph()
    (cond,) = ops(g, "cond")
    strats = strategies_for(cond, M24)
    assert len(strats) == 1
    assert all(spec.axes == frozenset() for spec in strats[0].out_specs + strats[0].in_specs)
    assert "no rule for 'cond'" in strats[0].name
    (warning,) = unsupported_ops(g)
    assert "cond" in warning and f"#{cond.id}" in warning and "register_rule" in warning


def test_custom_rule_registration():
    g = _cond_graph()
    (cond,) = ops(g, "cond")

    @register_rule("cond")
    def cond_rule(op, mesh):  # the branches are elementwise here: the data operand follows the output
        return follow_strategies(op, mesh)

    try:
        strats = strategies_for(cond, M24)
        assert len(strats) == 9 and unsupported_ops(g) == []
        assert all(s.in_specs[0].rank == 0 and s.in_specs[1] == s.out_specs[0] for s in strats)
    finally:
        unregister_rule("cond")
    assert len(strategies_for(cond, M24)) == 1

    # a hand-built operator with a rule that returns an invalid strategy: it is dropped, the valid one kept
    node = OpNode(id=0, primitive="my_op", name="my_op_0", inputs=(0,), outputs=(1,), in_shapes=((6, 8),),
                  in_dtypes=("float32",), out_shapes=((6, 8),), out_dtypes=("float32",), input_kinds=("activation",),
                  flops=48.0, bytes_read=192.0, bytes_written=192.0, role="forward")
    from autopar_lab.sharding import Strategy

    register_rule("my_op", lambda op, mesh: [
        Strategy("bad", (ShardingSpec.parse("S1R"),), (ShardingSpec.parse("S1R"),)),
        Strategy("good", (ShardingSpec.parse("RS1"),), (ShardingSpec.parse("RS1"),)),
    ])
    try:
        (s,) = strategies_for(node, M18)
        assert s.name == "good" and s.compute_s > 0
    finally:
        unregister_rule("my_op")


# --- resharding -----------------------------------------------------------------------------------------------
def test_reshard_hand_cases():
    shape, nbytes = (8, 16), 8 * 16 * 4
    S = ShardingSpec.parse
    m = M24
    assert reshard_cost(S("S0R"), S("S0R"), shape, "float32", m) == (0.0, ())
    assert reshard_cost(S("RR"), S("S0R"), shape, "float32", m) == (0.0, ())  # dst splits more: local slice
    assert reshard_cost(S("S0R"), S("S0S1"), shape, "float32", m) == (0.0, ())
    secs, cols = reshard_cost(S("S0R"), S("RR"), shape, "float32", m)
    assert cols == (("all_gather", 0, nbytes),) and secs == pytest.approx(m.a + m.b * 0.5 * nbytes)
    # gathering axis 0 of an S0S1 tensor: the buffer is the tensor as sharded by axis 1
    secs, cols = reshard_cost(S("S0S1"), S("RS1"), shape, "float32", m)
    assert cols == (("all_gather", 0, nbytes // 4),) and secs == pytest.approx(m.a + m.b * 0.5 * nbytes / 4)
    secs, cols = reshard_cost(S("S0R"), S("RS0"), shape, "float32", m)  # axis 0 moves dims: all-to-all
    assert cols == (("all_to_all", 0, nbytes),) and secs == pytest.approx(m.a + m.b * (1 / 4) * nbytes)
    secs, cols = reshard_cost(S("S01R"), S("RR"), shape, "float32", m)  # both axes at once
    assert cols == (("all_gather", (0, 1), nbytes),) and secs == pytest.approx(m.a + m.b * 7 / 8 * nbytes)
    # all-to-all on axis 1 and all-gather on axis 0, combined
    cols = plan_reshard(S("S0S1"), S("S1R"), shape, "float32", (2, 4))
    assert sorted(c[0] for c in cols) == ["all_gather", "all_to_all"]
    # slicing first makes the gather cheaper: S0R -> RS1 gathers the (already S1-sliced) tensor
    assert plan_reshard(S("S0R"), S("RS1"), shape, "float32", (2, 4)) == (("all_gather", 0, nbytes // 4),)
    # size-1 axes cost nothing
    assert reshard_cost(S("S0R"), S("RR"), shape, "float32", M18) == (0.0, ())
    with pytest.raises(ValueError, match="does not evenly shard"):
        reshard_cost(S("S01R"), S("RR"), (4, 16), "float32", m)


def test_reshard_with_real_mesh():
    mesh = real_mesh((2, 4))
    S = ShardingSpec.parse
    secs, cols = reshard_cost(S("S1R"), S("RR"), (64, 64), "float32", mesh)
    assert cols == (("all_gather", 1, 64 * 64 * 4),)
    assert secs == pytest.approx(mesh.all_gather(64 * 64 * 4, 1))
