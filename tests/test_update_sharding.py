"""The pipeline runtime's update gives each stage its state back where the step found it.

Found on issue 14's benchmark: the update program left a weight in the layout its update strategy made (sharded
over a 2 x 2 mesh where the plan stores it replicated), so from the second step on every task program received
other input shardings: it was compiled again, and XLA gathered the weight in every task, every microbatch (dp2 tp2
pp2: 0-6 all-gathers a task in the first step, 7-15 from the second). The update now pins its new state to the
plan's input shardings, as a one-program (SPMD) step does with its outputs.
"""

from __future__ import annotations

import jax
import pytest

import autopar_lab as al
from autopar_lab.runtime.local import synthetic_batch

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")


_COMPILES: list[str] = []
_LISTENING: list[bool] = []


def _count_compiles(event: str, duration_s: float, **_kw) -> None:
    if event.endswith("backend_compile_duration"):
        _COMPILES.append(event)


def _count_cache_hits(event: str, **_kw) -> None:
    # A program the persistent compilation cache holds (tests/conftest.py) loads without a backend compile: a
    # compile all the same.
    if event == "/jax/compilation_cache/cache_hits":
        _COMPILES.append(event)


def _listen() -> None:
    if not _LISTENING:  # once per process: jax keeps its listeners
        jax.monitoring.register_event_duration_secs_listener(_count_compiles)
        jax.monitoring.register_event_listener(_count_cache_hits)
        _LISTENING.append(True)


# The deep case is tests/test_runtime_buffers.py::test_deep_model_four_stages' model, plan and compiler options: the
# same stage programs, so whichever test runs second loads them from the persistent compilation cache
# (tests/conftest.py) instead of compiling 24 layers again.
FAST = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize("layers,dp,tp,pp,mb", [(4, 2, 2, 2, 2), (24, 2, 1, 4, 4)])
def test_state_keeps_its_sharding_and_no_task_compiles_again(layers, dp, tp, pp, mb):
    model = al.models.get("gpt-tiny", batch_size=8, num_layers=layers, hidden_size=32)
    cluster = al.Cluster.preset("cpu", hosts=1)
    plan = al.megatron_plan(model, cluster, dp=dp, tp=tp, pp=pp, microbatches=mb)
    runner = al.execute(plan, model, timing=False, compiler_options=FAST)
    assert runner.mode == "pipeline"
    _listen()
    before = [{name: x.sharding for name, x in st.items()} for st in runner.stage_params]
    runner.step(synthetic_batch(model, 0))
    batches = [synthetic_batch(model, i) for i in (1, 2)]
    jax.block_until_ready(batches)
    del _COMPILES[:]
    for b in batches:
        runner.step(b)
    assert not _COMPILES, f"{len(_COMPILES)} programs compiled after the first step"
    after = [{name: x.sharding for name, x in st.items()} for st in runner.stage_params]
    for k, (b, a) in enumerate(zip(before, after)):
        assert b.keys() == a.keys()
        ndim = {n: len(x.shape) for n, x in runner.stage_params[k].items()}
        moved = [n for n in b if not b[n].is_equivalent_to(a[n], ndim[n])]
        assert not moved, f"stage {k}: {moved[:5]} came back in another layout"
    assert all(abs(loss) < 1e3 for loss in runner.losses)
