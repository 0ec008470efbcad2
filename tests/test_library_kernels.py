"""What a fused-kernel library keeps for the backward (issue 31: Megatron-LM's layouts priced as they run).

JAX's autodiff keeps every value its backward reads; Megatron-LM's Transformer Engine and fused bias-GeLU / SwiGLU /
norm kernels keep each kernel's inputs and recompute what they compute inside. Counted by hand per token and hidden
unit (bytes, bf16/fp16, flash attention, no dropout) for one transformer layer:

- GPT: the norms' inputs, the residual sums (2 + 2: Transformer Engine's norm keeps its input for its backward),
  norm outputs read by the QKV and first MLP matmuls (2 + 2), Q, K, V (6), attention's output (2), the first MLP
  matmul's output (8, GeLU's input), GeLU's output (8, the second matmul's input): 32, Korthikanti et al.'s 34
  less the two dropout masks the zoo's GPT does not have. Autodiff also keeps GeLU's tanh (8) and the norms'
  normalised copies: 44.
- Llama (GQA with a quarter of the heads for K and V, SwiGLU of 3.5 h): the norms' inputs (2 + 2), their outputs
  (2 + 2), Q (2), K and V (0.5 + 0.5), attention's output (2); gate and up (7 + 7), their product (7): 34.
  Autodiff also keeps the sigmoid and SiLU (7 + 7) and the normalised copies: 59.

A layer's second residual sum is the next layer's first norm input: the last layer of a pipeline stage (or chunk)
sends it and does not keep it, the next stage keeps it as received. So a stage of ``k`` layers keeps ``k`` layers'
worth plus its received input less its sent output: exactly ``k`` layers' (a chunk of one layer too), where keeping
the projections' outputs to recompute the sums from held one residual more per chunk.
"""

from __future__ import annotations

import math

import pytest

import autopar_lab as al
from autopar_lab.graph.fusion import kernel_view
from autopar_lab.pricing.memory import memory_breakdown

SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def per_token_hidden(name: str, **kw) -> tuple[float, float]:
    """(autodiff's, a fused-kernel library's) bytes kept for layer_1's backward, per token and hidden unit."""
    model = al.models.get(name, num_layers=2, seq_len=1024, batch_size=2, **kw)
    g = model.trace()
    v = kernel_view(g, True)
    unit = 1024 * 2 * model.config.hidden_size

    def total(kept) -> float:
        n = 0
        for t in kept:
            info = g.tensor(t)
            if info.producer is not None and g.op(info.producer).layer == "layer_1" and t not in v.weight_derived:
                n += math.prod(info.shape) * SIZE.get(info.dtype, 1)
        return n / unit

    return total(v.kept()), total(v.kept(library_kernels=True))


@pytest.mark.parametrize("name, autodiff, library", [("gpt-1.3b", 44, 32), ("llama3-8b", 59, 34)])
def test_a_layer_keeps_what_the_hand_count_says(name, autodiff, library):
    plain, fused = per_token_hidden(name)
    # the norms' statistics (a float32 per token) are the only other values kept: well under 0.1 of a unit
    assert plain == pytest.approx(autodiff, abs=0.1)
    assert fused == pytest.approx(library, abs=0.1)


@pytest.mark.slow
def test_megatron_plan_with_library_kernels_keeps_less_and_runs_as_fast():
    """A 24-layer GPT (planned on its shallow copy) in Megatron-LM's layout on two DGX H100 hosts: with
    ``library_kernels`` each microbatch's activations shrink to 32/44 of autodiff's (the embedding and head keep
    the same), the static state and the GPU's step time do not move (with CUDA graphs: without, Megatron-LM's eager
    host through Transformer Engine is priced too, backends.eager), and a table built without it is refused in one
    sentence."""
    model = al.models.get("gpt-tiny", num_layers=24, hidden_size=1024, num_heads=16, seq_len=2048, batch_size=64,
                          vocab_size=32768, dtype="bfloat16")
    cluster = al.Cluster.preset("dgx-h100", 2)
    kw = dict(dp=4, tp=4, pp=1, micro_batch_size=2, sequence_parallel=True, precision="bf16")
    plain = al.megatron_plan(model, cluster, **kw)
    fused = al.megatron_plan(model, cluster, library_kernels=True, cuda_graphs=True, **kw)
    assert fused.cluster.device.efficiency.library_kernels and not plain.cluster.device.efficiency.library_kernels
    a, b = memory_breakdown(plain)[0], memory_breakdown(fused)[0]
    ratio = b["act_per_microbatch_bytes"] / a["act_per_microbatch_bytes"]
    assert 30 / 44 < ratio < 34 / 44
    for part in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes"):
        assert b[part] == a[part]
    assert fused.cost.step_time_s == plain.cost.step_time_s
    eager = al.megatron_plan(table=fused.table, library_kernels=True, **kw)
    assert eager.cost.host_launch_s > 0 == plain.cost.host_launch_s == fused.cost.host_launch_s
    assert eager.cost.step_time_s >= fused.cost.step_time_s
    with pytest.raises(ValueError) as e:
        al.megatron_plan(model, table=plain.table, library_kernels=True, **kw)
    assert "library_kernels" in str(e.value) and "\n" not in str(e.value)


def test_a_pipeline_chunk_keeps_its_layers_and_not_its_sent_output():
    """Llama 3 405B's row shape on its shallow copy (tp 8 with sequence parallelism, pp 4, interleaved v = 2):
    with Transformer Engine's kernels a middle stage holds, per microbatch, its layers' kept tensors and nothing
    else (the received input is its first norm's input, the sent output no one's), the hand count per layer and
    token over the tensor group: norms' inputs and outputs 8, Q 2, K and V 2 x 2 / 16, attention's output 2,
    gate, up and their product 3 x 2 x 3.25 = 19.5 (bf16), besides attention's and the norms' float32 statistics."""
    model = al.models.get("llama3-405b", seq_len=2048, batch_size=64, num_layers=14)
    plan = al.megatron_plan(model, al.Cluster.preset("dgx-h100", 8), dp=2, tp=8, pp=4, micro_batch_size=1,
                            sequence_parallel=True, precision="bf16", schedule="interleaved", virtual_stages=2,
                            library_kernels=True)
    c = model.config
    unit = c.seq_len * c.hidden_size / 8  # one token x hidden unit over the tensor group, a byte each
    hand = 8 + 2 + 2 * 2 * c.num_kv_heads / c.num_heads + 2 + 3 * 2 * c.ffn_hidden / c.hidden_size
    stats = 4 * c.num_heads / c.hidden_size + 2 * 4 / c.hidden_size  # attention's log-sum-exp, the norms' sums
    assert hand == pytest.approx(31.75)
    st = plan.stages[1]
    layers = st.layers[1] - st.layers[0] + 1
    assert layers == 4 and len(st.chunks) == 2
    assert st.act_bytes / unit / layers == pytest.approx(hand + stats, rel=1e-6)
