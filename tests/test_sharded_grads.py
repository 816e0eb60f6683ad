"""ZeRO-2/3 gradients: reduce-scattered in every micro-batch's backward (Megatron-FSDP, FSDP2 in a gradient-accumulation
loop) or, under torch.distributed.pipelining, held unsharded and reduced once (Runtime.sharded_grad_reduce). By hand
and as invariants: sharding the gradients is never free where a step has several micro-batches."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels import comm
from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.context import CostContext
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.kernels import CONTENTION_SM, overlapped_exposed
from meshplan.costmodels.memory import StageParams, model_state_bytes
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec

MODEL = ModelSpec(name="m", num_layers=8, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336, vocab=128256)
CLUSTER = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=32))  # 4 nodes: DP crosses the NIC
WL = Workload(global_batch=128, seq_len=4096)


def context(cfg: ParallelConfig, runtime: str = "megatron-core") -> CostContext:
    lay = resolve(MODEL, CLUSTER.num_gpus, WL, cfg)
    return CostContext(MODEL, CLUSTER, WL, lay, get_runtime(runtime), Efficiency.from_gpu(CLUSTER.gpu))


def test_zero2_reduce_scatters_each_layer_in_every_backward_by_hand():
    ctx = context(ParallelConfig(tp=1, dp=32, mbs=1, zero=2))
    assert ctx.reduce_in_backward and ctx.lay.num_microbatches == 4
    link = ctx.links["dp_cp"]
    steps, share = comm.ring_shape("reduce_scatter", 32)
    params = ctx.layer_params(3).dense
    scatter = steps * link.latency_s + share * 4 * params / link.bus_bytes_per_s  # fp32 gradients
    base, _ = ctx._layer_base(3)
    idle = base.fwd_compute + base.bwd_input_compute + base.bwd_weight_compute  # no gathers under ZeRO-2
    times = ctx.layer_times(3, "none")
    assert times.bwd_comm["dp"] == pytest.approx(overlapped_exposed(scatter, idle, 0.0, ctx.eff.physics))
    assert times.fwd_comm["dp"] == 0.0
    assert times.bwd_comm["dp"] >= CONTENTION_SM * scatter  # hidden, it still slows the compute


def test_zero1_keeps_its_one_reduce_after_the_step():
    ctx = context(ParallelConfig(tp=1, dp=32, mbs=1, zero=1))
    assert not ctx.reduce_in_backward
    assert "dp" not in ctx.layer_times(3, "none").bwd_comm


def test_zero2_costs_more_than_zero1_with_many_microbatches():
    """The gradient reduce-scatter runs once per micro-batch (16 here) instead of once per step."""
    wl = Workload(global_batch=512, seq_len=4096)
    z1, z2 = (estimate(MODEL, CLUSTER, wl, ParallelConfig(tp=1, dp=32, mbs=1, zero=z)) for z in (1, 2))
    assert z2.step_time_s > z1.step_time_s
    assert z2.breakdown_s["dp_comm"] > 4 * z1.breakdown_s["dp_comm"]


def test_torch_pipelining_defers_the_reduce_and_holds_unsharded_gradients():
    titan = get_runtime("torchtitan")
    assert titan.reduces_each_microbatch(2, 1) and not titan.reduces_each_microbatch(2, 2)
    assert titan.holds_unsharded_grads(3, 2) and not titan.holds_unsharded_grads(3, 1)
    assert not titan.holds_unsharded_grads(0, 4)
    assert not get_runtime("torchtitan+reduce-each-microbatch").holds_unsharded_grads(2, 2)
    mcore = get_runtime("megatron-core")
    assert mcore.reduces_each_microbatch(2, 4) and not mcore.holds_unsharded_grads(2, 4)
    cfg = ParallelConfig(tp=1, pp=2, dp=16, mbs=1, zero=2)
    ctx = context(cfg, "torchtitan")
    assert not ctx.reduce_in_backward and "dp" not in ctx.layer_times(3, "none").bwd_comm
    lay = ctx.lay
    one = StageParams(1.0, 0.0)
    assert model_state_bytes(one, lay, True)[1] == 4.0  # fp32 accumulated whole (FSDPParam.to_accumulated_grad...)
    assert model_state_bytes(one, lay, False)[1] == pytest.approx(4.0 / 16)
    titan_est = estimate(MODEL, CLUSTER, WL, cfg, runtime="torchtitan")
    mcore_est = estimate(MODEL, CLUSTER, WL, cfg, runtime="megatron-core")
    assert titan_est.stages[0].memory.gradients == pytest.approx(16 * mcore_est.stages[0].memory.gradients)


def test_full_recompute_gathers_the_weights_once_in_the_backward():
    """ZeRO-3 with full recomputation: the recomputed forward runs on the weights the backward gathered; its time is
    the forward's compute and TP communication, not a second gather."""
    ctx = context(ParallelConfig(tp=1, dp=32, mbs=1, zero=3, recompute="full"))
    base, _ = ctx._layer_base(3)
    full = ctx.layer_times(3, "full")
    assert full.recompute == pytest.approx(base.forward)
    assert full.fwd_comm["dp"] > 0 and full.recompute < base.forward + full.fwd_comm["dp"]


@settings(max_examples=25, deadline=None)
@given(mb=st.sampled_from([1, 2, 4]), accumulation=st.integers(1, 8), zero=st.sampled_from([2, 3]),
       runtime=st.sampled_from(["megatron-core", "torchtitan"]))
def test_more_microbatches_never_cost_less_dp_time_per_microbatch(mb, accumulation, zero, runtime):
    """Each micro-batch pays its own reduce-scatters: the step's DP time grows at least in proportion to the
    micro-batch count beyond the one whose reduce the step end carries."""
    def dp_time(m):
        wl = Workload(global_batch=32 * mb * m, seq_len=2048)
        return estimate(MODEL, CLUSTER, wl, ParallelConfig(tp=1, dp=32, mbs=mb, zero=zero),
                        runtime=runtime).breakdown_s["dp_comm"]
    one, many = dp_time(1), dp_time(accumulation)
    assert many >= one * (1 - 1e-9)
    per_layer_share = many - one
    assert per_layer_share >= (accumulation - 1) * (dp_time(2) - one) * (1 - 1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bf16_gradients_halve_the_gradient_buffer_and_the_dp_reduce(zero):
    """The "bf16-grads" option (Megatron-Bridge's grad_reduce_in_fp32 = False): the gradient buffer holds 2 bytes a
    parameter instead of 4, the DP reduce (all-reduce, or reduce-scatter under ZeRO) moves half the bytes, and the
    weights, optimizer and activations stay as they are; the search's memory floors agree with the estimate."""
    cfg = ParallelConfig(tp=2, dp=16, mbs=1, zero=zero)
    fp32, bf16 = context(cfg), context(cfg, "megatron-core+bf16-grads")
    params = StageParams(1.0e9, 0.0)
    w32, g32, o32 = model_state_bytes(params, fp32.lay, False, fp32.rt.grad_bytes)
    w16, g16, o16 = model_state_bytes(params, bf16.lay, False, bf16.rt.grad_bytes)
    assert (w16, o16) == (w32, o32) and g16 == pytest.approx(g32 / 2)
    assert bf16.sync.reduce_beta_dense == pytest.approx(fp32.sync.reduce_beta_dense / 2)
    assert bf16.sync.gather_beta_dense == fp32.sync.gather_beta_dense
    a = estimate(MODEL, CLUSTER, WL, cfg, "megatron-core")
    b = estimate(MODEL, CLUSTER, WL, cfg, "megatron-core+bf16-grads")
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert sb.memory.gradients == pytest.approx(sa.memory.gradients / 2)
        assert (sb.memory.weights, sb.memory.optimizer, sb.memory.activations) == (
            sa.memory.weights, sa.memory.optimizer, sa.memory.activations)
    assert b.step_time_s <= a.step_time_s
