"""The search (planner/search.py): pins are honoured, every plan is valid and re-estimates exactly, the account adds
up, the bounds are sound (checked against exhaustive enumeration on tiny spaces), infeasible inputs are explained
and a time limit returns what it has.

Small models on 8-32 GPUs with small batches keep the whole file fast; hypothesis runs derandomized.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.cli.main import main
from meshplan.costmodels.config import ParallelConfig, StagePolicy, Workload, resolve
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import Estimate, estimate, simulate_config
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model, load_zoo
from meshplan.costmodels.runtime import DEFAULT_RUNTIME, RUNTIMES, get_runtime
from meshplan.costmodels.uncertainty import Ranking, region_of
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.search import SearchResult, search
from meshplan.planner.space import DEFAULT_MAX_MBS, enumerate_space, interleaved_chunks

REL = 1e-9
UNIFORM = ("none", "selective", "full")


@functools.cache
def zoo(name: str) -> ModelSpec:
    return load_zoo(name)


@functools.cache
def cluster(n: int, gpu: str = "h100-sxm") -> Cluster:
    return Cluster(ClusterSpec(gpu=gpu, num_gpus=n))


def shrunk(name: str, layers: int) -> ModelSpec:
    """A zoo model with fewer decoder layers, so that every stage partition can be enumerated."""
    return zoo(name).model_copy(update={"num_layers": layers, "name": f"{name}-{layers}l"})


@functools.cache
def run(model: str, n: int, gbs: int, seq: int, gpu: str = "h100-sxm", top_k: int = 5,
        pins: tuple = (), runtime: str = DEFAULT_RUNTIME) -> SearchResult:
    knobs = dict(pins)
    max_mbs = knobs.pop("max_mbs", DEFAULT_MAX_MBS)
    return search(zoo(model), cluster(n, gpu), Workload(global_batch=gbs, seq_len=seq), ParallelConfig(**knobs),
                  runtime, top_k=top_k, max_mbs=max_mbs)


def runtime_for(pins: dict) -> str:
    """The default runtime (megatron-core), or the reference executor's where a pinned schedule or per-stage
    recomputation needs it (it runs every schedule and recomputes each stage its own way: runtime.RUNTIMES)."""
    executor = pins.get("schedule") in ("gpipe", "zb") or pins.get("recompute") == "per-stage"
    return "meshplan-executor" if executor else DEFAULT_RUNTIME


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def describe(result: SearchResult) -> str:
    a = result.account
    return (f"status={a.status} gap={a.gap} lower_bound={a.lower_bound_s} space={a.space_size} "
            f"evaluated={a.evaluated} pruned={a.pruned} infeasible={a.infeasible}")


# ---- pins are honoured -----------------------------------------------------------------------------------------------

LLAMA = ("llama3.1-8b", 8, 16, 2048)  # 8 x H100, 16 sequences of 2048 tokens
MIXTRAL = ("mixtral-8x7b", 16, 32, 2048)


def _lay(p):
    return p.estimate.layout


PIN_CASES = [
    # (case, pins, what every plan must satisfy)
    (LLAMA, {"tp": 2}, lambda p: _lay(p).tp == 2),
    (LLAMA, {"tp": 8}, lambda p: _lay(p).tp == 8),
    (LLAMA, {"pp": 2}, lambda p: _lay(p).pp == 2),
    (LLAMA, {"pp": 4}, lambda p: _lay(p).pp == 4),
    (LLAMA, {"vpp": 2, "schedule": "interleaved"},
     lambda p: _lay(p).vpp == 2 and _lay(p).schedule == "interleaved" and _lay(p).pp > 1),
    (LLAMA, {"vpp": 4}, lambda p: _lay(p).vpp == 4 and _lay(p).schedule == "interleaved"),
    (LLAMA, {"dp": 4}, lambda p: _lay(p).dp == 4),
    (LLAMA, {"dp": 1}, lambda p: _lay(p).dp == 1),
    (LLAMA, {"cp": 2}, lambda p: _lay(p).cp == 2),
    (LLAMA, {"cp": 2, "cp_comm": "a2a"}, lambda p: _lay(p).cp == 2 and _lay(p).cp_comm == "a2a"),
    (LLAMA, {"cp": 2, "cp_comm": "ring"}, lambda p: _lay(p).cp == 2 and _lay(p).cp_comm == "ring"),
    (LLAMA, {"mbs": 1}, lambda p: _lay(p).mbs == 1),
    (LLAMA, {"mbs": 2}, lambda p: _lay(p).mbs == 2),
    *[(LLAMA, {"zero": z}, lambda p, z=z: _lay(p).zero == z) for z in (0, 1, 2, 3)],
    *[(LLAMA, {"recompute": r}, lambda p, r=r: _lay(p).recompute == r and p.config.recompute == r)
      for r in UNIFORM],
    # per-stage: the partitioner chooses a policy for every stage (pp > 1, no virtual stages)
    (LLAMA, {"recompute": "per-stage", "pp": 2},
     lambda p: p.candidate.recompute == "per-stage" and _lay(p).pp == 2 and _lay(p).vpp == 1
     and p.config.stage_recompute is not None and len(p.config.stage_recompute) == 2),
    (LLAMA, {"recompute": "per-stage"},
     lambda p: p.candidate.recompute == "per-stage" and _lay(p).pp > 1 and _lay(p).vpp == 1
     and p.config.stage_recompute is not None and len(p.config.stage_recompute) == _lay(p).pp),
    (LLAMA, {"tp": 2, "sp": True}, lambda p: _lay(p).tp == 2 and _lay(p).sp is True),
    (LLAMA, {"tp": 2, "sp": False}, lambda p: _lay(p).tp == 2 and _lay(p).sp is False),
    (LLAMA, {"sp": False}, lambda p: _lay(p).sp is False),
    # alone, these knobs exist only where their parallelism does: sp with tp > 1 (resolve() turns it off at tp 1),
    # the CP communication with cp > 1
    (LLAMA, {"sp": True}, lambda p: _lay(p).sp is (_lay(p).tp > 1)),
    (LLAMA, {"cp_comm": "a2a"}, lambda p: _lay(p).cp == 1 or _lay(p).cp_comm == "a2a"),
    # schedules, alone (the whole space) and with a pipeline pinned
    *[(LLAMA, {"schedule": s}, lambda p, s=s: _lay(p).schedule == s)
      for s in ("1f1b", "gpipe", "zb", "interleaved")],
    *[(LLAMA, {"schedule": s, "pp": 2}, lambda p, s=s: _lay(p).schedule == s and _lay(p).pp == 2)
      for s in ("1f1b", "gpipe", "zb")],
    # MoE: expert and expert-tensor parallelism
    (MIXTRAL, {"ep": 4}, lambda p: _lay(p).ep == 4),
    (MIXTRAL, {"ep": 8}, lambda p: _lay(p).ep == 8),
    (MIXTRAL, {"etp": 2}, lambda p: _lay(p).etp == 2),
    (MIXTRAL, {"ep": 2, "etp": 1, "tp": 2}, lambda p: (_lay(p).ep, _lay(p).etp, _lay(p).tp) == (2, 1, 2)),
]


def _pin_id(case) -> str:
    (model, *_), pins, _ = case
    return f"{model}-" + "-".join(f"{k}={v}" for k, v in pins.items())


@pytest.mark.parametrize("case", PIN_CASES, ids=[_pin_id(c) for c in PIN_CASES])
def test_pins_are_honoured(case):
    (model, n, gbs, seq), pins, holds = case
    result = run(model, n, gbs, seq, pins=tuple(sorted({"max_mbs": 2, **pins}.items())), runtime=runtime_for(pins))
    assert result.plans, f"{pins}: no plan ({result.why_nothing_fits}); {describe(result)}"
    for rank, p in enumerate(result.plans, 1):
        lay = p.estimate.layout
        assert holds(p), (f"pins {pins}: plan #{rank} has tp={lay.tp} pp={lay.pp} vpp={lay.vpp} dp={lay.dp} "
                          f"cp={lay.cp} cp_comm={lay.cp_comm} ep={lay.ep} etp={lay.etp} mbs={lay.mbs} "
                          f"zero={lay.zero} recompute={lay.recompute} sp={lay.sp} schedule={lay.schedule}")


def test_pinned_space_is_the_pinned_subset_of_the_free_space():
    """Pinning narrows the space: the pinned space is no larger, and its best plan no faster, than the free one."""
    free = run(*LLAMA, pins=(("max_mbs", 2),))
    for pins in ({"tp": 2}, {"zero": 1}, {"mbs": 1}, {"pp": 2}):
        pinned = run(*LLAMA, pins=tuple(sorted({"max_mbs": 2, **pins}.items())))
        assert pinned.account.space_size < free.account.space_size, pins
        assert pinned.plans[0].step_time_s >= free.plans[0].step_time_s * (1 - REL), (
            f"{pins}: the pinned search found {pinned.plans[0].step_time_s} s, faster than the free search's "
            f"{free.plans[0].step_time_s} s ({describe(free)})")


# ---- every plan is valid, exact and ranked ---------------------------------------------------------------------------

def check_plans(model: ModelSpec, c: Cluster, wl: Workload, result: SearchResult, top_k: int) -> None:
    acc = result.account
    assert len(result.plans) <= top_k
    if not result.plans:
        assert acc.status == "infeasible" and result.why_nothing_fits
        return
    assert result.why_nothing_fits is None
    assert acc.status in ("optimal", "gap"), describe(result)
    assert acc.gap >= 0 and math.isfinite(acc.gap)
    if acc.status == "optimal":
        assert acc.gap <= 1e-6
    times = [p.step_time_s for p in result.plans]
    assert times == sorted(times), times
    assert acc.lower_bound_s <= times[0] * (1 + REL), describe(result)
    for p in result.plans:
        lay = resolve(model, c.num_gpus, wl, p.config)  # raises InputError if a divisibility rule fails
        assert lay == p.estimate.layout
        assert p.estimate.fits and p.estimate.peak_memory_gib <= c.gpu.hbm_gib.value
        again = simulate_config(model, c, wl, p.config, p.estimate.runtime)
        fresh = again.estimate
        assert fresh.fits
        assert close(fresh.step_time_s, p.step_time_s), (p.config, fresh.step_time_s, p.step_time_s)
        assert close(fresh.peak_memory_gib, p.estimate.peak_memory_gib, 1e-9)
        # the kept timeline (what the plan's trace draws) is the one a fresh simulation makes
        kept = p.simulated.timeline.events
        assert len(kept) == len(again.timeline.events)
        assert all(a[:2] == b[:2] and close(a[2], b[2]) and close(a[3], b[3])
                   for a, b in zip(kept, again.timeline.events, strict=True))
        # the per-candidate bound never exceeds the plan's own simulated time
        assert p.bound_s <= p.step_time_s * (1 + 1e-6), (p.config, p.bound_s, p.step_time_s)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(["llama3.1-8b", "mcore-gpt-1.7b", "mixtral-8x7b", "nemotron-4-15b"]),
       gpus=st.sampled_from([8, 16, 32]), gbs=st.sampled_from([8, 16, 32, 64]),
       seq=st.sampled_from([1024, 2048, 4096]), gpu=st.sampled_from(["h100-sxm", "a100-40gb"]))
def test_every_plan_resolves_fits_and_reestimates_exactly(model, gpus, gbs, seq, gpu):
    spec, c, wl = zoo(model), cluster(gpus, gpu), Workload(global_batch=gbs, seq_len=seq)
    result = search(spec, c, wl, top_k=3, max_mbs=2)
    check_plans(spec, c, wl, result, 3)


ACCOUNT_CASES = [
    ("llama3.1-8b", 8, 16, 2048, "h100-sxm", ()),
    ("llama3.1-8b", 8, 16, 2048, "h100-sxm", (("pp", 2), ("recompute", "per-stage"))),
    ("llama3.1-8b", 8, 16, 2048, "h100-sxm", (("pp", 4), ("schedule", "1f1b"))),
    ("llama3.1-8b", 32, 64, 4096, "a100-40gb", ()),
    ("mixtral-8x7b", 16, 32, 2048, "h100-sxm", ()),
    ("llama3.1-405b", 8, 16, 2048, "a100-40gb", ()),
]


@pytest.mark.parametrize("model,n,gbs,seq,gpu,pins", ACCOUNT_CASES)
def test_account_adds_up(model, n, gbs, seq, gpu, pins):
    """Every candidate of the space is counted exactly once: simulated, pruned (by the bound that pruned it) or
    infeasible (by rule or memory) -- planner/space.py: space size = evaluated + pruned + infeasible."""
    runtime = runtime_for(dict(pins))
    result = run(model, n, gbs, seq, gpu, 3, (("max_mbs", 2), *pins), runtime)
    acc = result.account
    spec = zoo(model)
    enum = enumerate_space(spec, n, cluster(n, gpu).gpus_per_node, Workload(global_batch=gbs, seq_len=seq),
                           ParallelConfig(**dict(pins)), get_runtime(runtime), max_mbs=2)
    assert acc.space_size == enum.space_size
    assert enum.space_size == sum(g.size() for g in enum.groups) + sum(enum.infeasible.values())
    assert all(g.size() == g.candidate_count() for g in enum.groups)  # the enumeration's count is each group's
    assert all(v > 0 for v in acc.pruned.values()) and all(v > 0 for v in acc.infeasible.values())
    for rule, count in enum.infeasible.items():  # the launcher rules' rejections are carried into the account
        assert acc.infeasible.get(rule, 0) >= count, rule
    counted = acc.evaluated + sum(acc.pruned.values()) + sum(acc.infeasible.values())
    assert counted == acc.space_size, (
        f"evaluated {acc.evaluated} + pruned {sum(acc.pruned.values())} + infeasible "
        f"{sum(acc.infeasible.values())} = {counted} != space {acc.space_size}; {describe(result)}")


# ---- the bounds are sound: exhaustive enumeration of tiny spaces -----------------------------------------------------

def compositions(total: int, parts: int):
    """Every way to cut `total` layers into `parts` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def exhaustive_minimum(model: ModelSpec, c: Cluster, wl: Workload, pins: ParallelConfig, max_mbs: int,
                       runtime: str = DEFAULT_RUNTIME, key: Callable[[Estimate], float] | None = None,
                       memory_share: float = 1.0, efficiency: Efficiency | None = None,
                       ) -> tuple[float, ParallelConfig | None, int]:
    """The fastest fitting configuration of the search space with uniform recomputation (or the one least by
    `key`; fitting in `memory_share` of the HBM): every candidate of enumerate_space, every stage partition when
    vpp == 1 (with virtual stages every split of space.interleaved_chunks), each estimated."""
    enum = enumerate_space(model, c.num_gpus, c.gpus_per_node, wl, pins, get_runtime(runtime), max_mbs)
    best, arg, count = math.inf, None, 0
    for g in enum.groups:
        m = g.mesh
        for sp, cp_comm, schedule, vpp in g.variants:
            partitions = [None] if m.pp == 1 else list(compositions(model.num_layers, m.pp)) if vpp == 1 else [
                ("chunks", c) for c in interleaved_chunks(model.num_layers, m.pp, vpp)]
            for zero in g.zeros:
                for rec in g.recomputes_for(vpp):
                    if rec == "per-stage":
                        continue
                    for part in partitions:
                        chunks = part[1] if part is not None and part[0] == "chunks" else None
                        stage_layers = None if chunks is not None else part
                        cfg = ParallelConfig(tp=m.tp, pp=m.pp, vpp=vpp, dp=m.dp, cp=m.cp, cp_comm=cp_comm, ep=m.ep,
                                             etp=m.etp, mbs=g.mbs, zero=zero, recompute=rec, sp=sp,
                                             schedule=schedule, stage_layers=stage_layers, chunk_layers=chunks,
                                             rank_order=m.order)
                        est = estimate(model, c, wl, cfg, runtime, efficiency)
                        count += 1
                        value = est.step_time_s if key is None else key(est)
                        if est.peak_memory_gib <= est.hbm_gib * memory_share and value < best:
                            best, arg = value, cfg
    return best, arg, count


TINY = [
    # (model, layers or None for the real model, gpu, gpus, gbs, seq, pins)
    # llama3.1-8b itself, two pipeline stages (31 partitions each): interleaved vs uneven 1F1B/GPipe stages
    ("llama3.1-8b", None, "h100-sxm", 8, 16, 2048, {"max_mbs": 2, "pp": 2, "zero": 1}),
    # 8 layers: every pp (1, 2, 4, 8) with every partition, every ZeRO stage
    ("llama3.1-8b", 8, "h100-sxm", 8, 16, 2048, {"max_mbs": 2, "tp": 1}),
    # memory binds (40 GiB): ZeRO, recomputation and pipelining decide what fits
    ("llama3.1-8b", 8, "a100-40gb", 8, 16, 4096, {"max_mbs": 2, "cp": 1}),
    ("llama3.1-70b", 8, "a100-40gb", 8, 16, 2048, {"max_mbs": 1, "pp": 4, "cp": 2}),
    # zero-bubble, pinned
    ("llama3.1-70b", 8, "a100-40gb", 8, 16, 2048, {"max_mbs": 1, "pp": 4, "schedule": "zb"}),
    # MoE: ep x etp folding
    ("mixtral-8x7b", 4, "a100-40gb", 8, 16, 2048, {"max_mbs": 1, "cp": 1, "zero": 1}),
    # four nodes: both rank orders (pp inside dp moves the P2P and DP groups onto other links)
    ("mcore-gpt-1.7b", 8, "h100-sxm", 32, 32, 4096, {"max_mbs": 2, "tp": 1, "pp": 4, "cp": 1, "zero": 1,
                                                     "schedule": "1f1b"}),
]


@pytest.mark.parametrize("name,layers,gpu,n,gbs,seq,pins", TINY,
                         ids=[f"{t[0]}-{t[1] or 'full'}l-{t[2]}-{'-'.join(f'{k}={v}' for k, v in t[6].items())}"
                              for t in TINY])
def test_search_matches_exhaustive_enumeration(name, layers, gpu, n, gbs, seq, pins):
    model = zoo(name) if layers is None else shrunk(name, layers)
    knobs = dict(pins)
    max_mbs = knobs.pop("max_mbs")
    c, wl, p = cluster(n, gpu), Workload(global_batch=gbs, seq_len=seq), ParallelConfig(**knobs)
    result = search(model, c, wl, p, runtime_for(pins), top_k=3, max_mbs=max_mbs)
    truth, arg, count = exhaustive_minimum(model, c, wl, p, max_mbs, runtime_for(pins))
    acc = result.account
    assert count > 0
    if not math.isfinite(truth):
        assert not result.plans, f"exhaustive: nothing fits, but the search returned {result.plans[0].config}"
        return
    assert result.plans, f"the search found nothing; exhaustive best {truth} s at {arg}; {describe(result)}"
    best = result.plans[0]
    check_plans(model, c, wl, result, 3)
    # Soundness: no configuration of the space beats the account's lower bound, nor the best plan when optimal.
    assert acc.lower_bound_s <= truth * (1 + REL), (
        f"lower bound {acc.lower_bound_s} s but {arg} runs {truth} s; {describe(result)}")
    if acc.status == "optimal":
        assert best.step_time_s <= truth * (1 + REL), (
            f"'optimal' {best.step_time_s} s ({best.config}) but {arg} runs {truth} s; {describe(result)}")
    if best.estimate.layout.recompute in UNIFORM:
        # the best plan is itself one of the enumerated configurations
        assert best.step_time_s >= truth * (1 - REL)
        if acc.status == "optimal":
            assert close(best.step_time_s, truth), (best.step_time_s, truth, arg)


def test_bf16_gradients_keep_the_memory_floors_sound():
    """Under "bf16-grads" the gradient buffer is half as large; the search's state floors read the same element size,
    so on a memory-bound space (40 GiB) it still finds the exhaustive optimum; the same plan with fp32 gradients
    needs more memory."""
    model, c = shrunk("llama3.1-8b", 8), cluster(8, "a100-40gb")
    wl, pins = Workload(global_batch=16, seq_len=4096), ParallelConfig(cp=1, zero=1)
    runtime = "megatron-core+bf16-grads"
    result = search(model, c, wl, pins, runtime, top_k=3, max_mbs=2)
    truth, arg, count = exhaustive_minimum(model, c, wl, pins, 2, runtime)
    assert result.account.status == "optimal" and result.plans, describe(result)
    assert close(result.plans[0].step_time_s, truth), (result.plans[0].config, arg)
    fp32 = estimate(model, c, wl, result.plans[0].config, "megatron-core")
    assert fp32.peak_memory_gib > result.plans[0].estimate.peak_memory_gib


def test_conservative_ranking_matches_exhaustive_enumeration_of_the_slow_end():
    """--rank conservative minimises the slow end of each plan's interval, and proves it: on a tiny space, with a
    residual table in which the expected winner's region errs upward by 50-72 % and every other region by 0-22 %, the
    search's best equals the exhaustive minimum of step x exp(hi), leaves that region, is no faster than the
    expected winner and its slow end is no later than the expected winner's."""
    model, c, wl = shrunk("llama3.1-8b", 8), cluster(8), Workload(global_batch=16, seq_len=2048)
    pins = ParallelConfig(zero=1)
    expected = search(model, c, wl, pins, top_k=3, max_mbs=1)

    def region(est: Estimate):
        return region_of(model, est.layout, wl, "h100-sxm", c.gpus_per_node, DEFAULT_RUNTIME)

    home = region(expected.plans[0].estimate)
    table = []
    for ep, cp, wide in itertools.product((False, True), repeat=3):
        other = dataclasses.replace(home, ep_across_nodes=ep, context_parallel=cp, wide_tp=wide)
        table += [(other, (0.5 if other == home else 0.0) + 0.02 * k) for k in range(12)]
    ranking = Ranking("conservative", residuals=tuple(table))

    def slow_end(est: Estimate) -> float:
        return est.step_time_s * ranking.factor(region(est))

    result = search(model, c, wl, pins, top_k=3, max_mbs=1, ranking=ranking)
    truth, arg, count = exhaustive_minimum(model, c, wl, pins, 1, key=slow_end)
    best, acc = result.plans[0], result.account
    assert count > 100 and acc.ranking == "conservative" and acc.status == "optimal", describe(result)
    assert best.ranked_s == pytest.approx(slow_end(best.estimate), rel=1e-12)
    assert [p.ranked_s for p in result.plans] == sorted(p.ranked_s for p in result.plans)
    assert acc.lower_bound_s <= truth * (1 + REL)
    assert close(best.ranked_s, truth), (best.config, arg)
    assert region(best.estimate) != home
    assert best.step_time_s >= expected.plans[0].step_time_s * (1 - REL)
    assert best.ranked_s <= slow_end(expected.plans[0].estimate) * (1 + REL)


def test_a_memory_share_is_the_exhaustive_optimum_within_that_share():
    """With part of the HBM kept free (--memory sure's share), the search's best is the exhaustive optimum among the
    configurations whose predicted peak fits in that share, proven; it is slower than with the whole HBM on a
    memory-bound space, and every ranked plan keeps within the share."""
    model, c, wl = shrunk("llama3.1-8b", 8), cluster(8, "a100-40gb"), Workload(global_batch=16, seq_len=4096)
    pins = ParallelConfig(cp=1)
    whole = search(model, c, wl, pins, top_k=3, max_mbs=2)
    share = 0.5
    result = search(model, c, wl, pins, top_k=3, max_mbs=2, memory_share=share)
    truth, arg, count = exhaustive_minimum(model, c, wl, pins, 2, memory_share=share)
    acc = result.account
    assert count > 100 and acc.status == "optimal" and acc.memory_share == share, describe(result)
    assert close(result.plans[0].step_time_s, truth), (result.plans[0].config, arg)
    assert all(p.estimate.peak_memory_gib <= 40 * share for p in result.plans)
    assert whole.plans[0].estimate.peak_memory_gib > 40 * share  # the share binds here
    assert result.plans[0].step_time_s > whole.plans[0].step_time_s
    def over(account) -> int:
        return sum(n for reason, n in account.infeasible.items() if reason.startswith("memory"))

    assert over(acc) > over(whole.account), (acc.infeasible, whole.account.infeasible)
    with pytest.raises(InputError, match="positive"):
        search(model, c, wl, pins, memory_share=0.0)
    nothing = search(model, c, wl, pins, max_mbs=2, memory_share=0.01)
    assert not nothing.plans and "--memory sure" in (nothing.why_nothing_fits or "")


def test_a_calibrated_activation_factor_keeps_the_memory_bounds_sound():
    """Under a calibration's activation factor (fit.fit_memory) the search's memory floors read the same scaled
    activations as the estimate: on a memory-bound space it finds the exhaustive optimum, which needs more memory
    relief than at factor 1."""
    import dataclasses

    model, c, wl = shrunk("llama3.1-8b", 8), cluster(8, "a100-40gb"), Workload(global_batch=16, seq_len=4096)
    pins = ParallelConfig(cp=1)
    eff = dataclasses.replace(Efficiency.from_gpu(c.gpu), activation_factor=1.6)
    result = search(model, c, wl, pins, efficiency=eff, top_k=3, max_mbs=2)
    truth, arg, count = exhaustive_minimum(model, c, wl, pins, 2, efficiency=eff)
    assert count > 100 and result.account.status == "optimal", describe(result)
    assert close(result.plans[0].step_time_s, truth), (result.plans[0].config, arg)
    assert result.plans[0].step_time_s >= search(model, c, wl, pins, top_k=1, max_mbs=2).plans[0].step_time_s


def per_stage_menu(layers: int) -> list[StagePolicy]:
    return [StagePolicy(), StagePolicy(granularity="selective"), StagePolicy(granularity="full", full_layers=1),
            StagePolicy(granularity="full", full_layers=layers)]


def test_per_stage_pin_lower_bound_is_sound():
    """--recompute per-stage: each stage none, selective or full on its first k layers. Enumerate, for every
    candidate of the pinned space (tp = cp = 1, pp = 2), every partition and a menu of policies per stage (none,
    selective, full on 1 layer, full on all): none of these plans may beat the account's lower bound, nor the best
    plan if it is reported optimal."""
    model, c, wl = zoo("llama3.1-8b"), cluster(8), Workload(global_batch=16, seq_len=2048)
    pins = ParallelConfig(pp=2, tp=1, cp=1, recompute="per-stage")
    runtime = "meshplan-executor"  # the preset that recomputes each stage its own way
    result = search(model, c, wl, pins, runtime, top_k=3, max_mbs=2)
    acc = result.account
    enum = enumerate_space(model, c.num_gpus, c.gpus_per_node, wl, pins, get_runtime(runtime), max_mbs=2)
    best, arg = math.inf, None
    for g in enum.groups:
        m = g.mesh
        for sp, cp_comm, schedule, vpp in g.variants:
            if "per-stage" not in g.recomputes_for(vpp):  # virtual stages: no per-stage candidates
                continue
            for zero in g.zeros:
                for stage_layers in compositions(model.num_layers, m.pp):
                    menus = [per_stage_menu(n) for n in stage_layers]
                    for policies in itertools.product(*menus):
                        cfg = ParallelConfig(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, cp_comm=cp_comm, ep=m.ep, etp=m.etp,
                                             mbs=g.mbs, zero=zero, sp=sp, schedule=schedule,
                                             stage_layers=stage_layers, stage_recompute=policies,
                                             rank_order=m.order)
                        est = estimate(model, c, wl, cfg, runtime)
                        if est.fits and est.step_time_s < best:
                            best, arg = est.step_time_s, cfg
    assert math.isfinite(best) and result.plans
    check_plans(model, c, wl, result, 3)
    assert acc.lower_bound_s <= best * (1 + REL), (
        f"lower bound {acc.lower_bound_s} s, best plan {result.plans[0].step_time_s} s "
        f"({result.plans[0].config}), but {arg} runs {best} s; {describe(result)}")
    if acc.status == "optimal":
        assert result.plans[0].step_time_s <= best * (1 + REL)


def test_exhaustive_check_covers_an_optimal_pipelined_case():
    """The exhaustive cases above are not all trivially pp=1: at least one proven-optimal search is compared
    against every partition of a pipeline (so the partition and pipeline bounds pruned real competitors)."""
    model, c = zoo("llama3.1-8b"), cluster(8)
    wl, p = Workload(global_batch=16, seq_len=2048), ParallelConfig(pp=2, zero=1)
    result = search(model, c, wl, p, top_k=3, max_mbs=2)
    assert result.account.status == "optimal", describe(result)
    assert result.plans[0].estimate.layout.pp == 2


# ---- infeasible inputs ---------------------------------------------------------------------------------------------

def test_nothing_fits_is_explained():
    result = run("llama3.1-405b", 8, 16, 2048, "a100-40gb", 3)
    assert result.plans == ()
    assert result.account.status == "infeasible"
    why = result.why_nothing_fits
    assert why and "GiB" in why and "8 GPUs" in why, why
    assert any(ch.isdigit() for ch in why.split(">=")[-1]), why  # says how many GPUs would do


def test_no_configuration_passes_the_rules():
    """tp = pp = cp = 1 pinned on 8 GPUs leaves dp = 8, which does not divide the global batch of 4: every candidate
    breaks a divisibility rule, and the explanation says which."""
    result = search(zoo("llama3.1-8b"), cluster(8), Workload(global_batch=4, seq_len=2048),
                    ParallelConfig(tp=1, pp=1, cp=1), max_mbs=2)
    assert result.plans == () and result.account.status == "infeasible"
    why = result.why_nothing_fits
    assert why and "divisib" in why and "global batch" in why, why


def test_nothing_fits_via_the_cli(capsys):
    code = main(["plan", "--model", "llama3.1-405b", "--gpu", "a100-40gb", "--gpus", "8", "--gbs", "16",
                 "--seq", "2048"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "Traceback" not in out
    assert "GiB" in lines[0] and "8 GPUs" in lines[0]


# ---- time limit ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("limit", [1e-6, 1e-3])
def test_tiny_time_limit_still_returns_a_plan(limit):
    """Anytime search: whatever the limit, a space where something fits gives a plan (the quick first plan; the
    limit applies once one is kept), the status says the limit stopped it, and the gap is finite and bounds it."""
    model, c, wl = zoo("llama3.1-8b"), cluster(8), Workload(global_batch=16, seq_len=2048)
    result = search(model, c, wl, top_k=3, time_limit_s=limit, max_mbs=2)
    acc = result.account
    assert result.plans, result.why_nothing_fits
    assert acc.status in ("time-limit", "optimal"), describe(result)
    assert math.isfinite(acc.gap) and acc.gap >= 0
    assert acc.lower_bound_s <= result.plans[0].step_time_s * (1 + REL)
    assert not result.why_nothing_fits


def test_time_limit_returns_a_plan_with_a_proven_gap():
    """DeepSeek-V3 on 2,048 H800: a search of several seconds (benchmarks/search_speed.py) stopped at 0.5 s still
    returns plans, each the estimate of its configuration, above the bound the account states."""
    model, c, wl = zoo("deepseek-v3"), cluster(2048, "h800"), Workload(global_batch=15360, seq_len=4096)
    result = search(model, c, wl, top_k=3, time_limit_s=0.5, max_mbs=2)
    acc = result.account
    assert acc.status == "time-limit", describe(result)
    assert result.plans and math.isfinite(acc.gap) and acc.gap > 0
    assert acc.lower_bound_s <= result.plans[0].step_time_s * (1 + REL)
    assert acc.pruned.get("not reached before the time limit", 0) > 0
    for p in result.plans:
        assert close(estimate(model, c, wl, p.config).step_time_s, p.step_time_s)


def test_a_thousand_layers_under_a_time_limit_give_a_plan_and_stop_inside_long_steps():
    """1,024 layers (the most a model may have) on 256 GPUs: each exact partition DP takes about a second and the
    cheapest-fitting ones once needed tens of GB (the search ran out of memory). Under --time-limit 0.5 the quick
    first plan (an even split, simulated at once) comes first, the DPs and simulations stop midway once the limit
    has passed, and what they left counts toward the stated gap. The wall-clock check is loose (the search took
    160 s before); the counts are the point."""
    model = shrunk("llama3.1-8b", 1024)
    result = search(model, cluster(256), Workload(global_batch=1024, seq_len=4096), top_k=3, time_limit_s=0.5)
    acc = result.account
    assert result.plans and acc.status == "time-limit", describe(result)
    assert math.isfinite(acc.gap) and 0 < acc.gap < 1
    assert acc.lower_bound_s <= result.plans[0].step_time_s * (1 + REL)
    assert acc.pruned.get("not reached before the time limit", 0) > 0
    assert acc.seconds < 60, describe(result)


def test_a_pipeline_too_long_to_simulate_is_refused_with_its_maximum():
    """131,072 micro-batches on 64 stages are 16.8M passes (minutes and GBs to simulate): estimate refuses them
    naming the maximum and the fix; the search counts them under that rule and keeps the rest of the space."""
    from meshplan.costmodels.pipeline import MAX_PIPELINE_PASSES
    model, c = zoo("llama3.1-70b"), cluster(64)
    wl = Workload(global_batch=131072, seq_len=256)
    with pytest.raises(InputError, match=f"at most {MAX_PIPELINE_PASSES:,}.*raise --mbs"):
        estimate(model, c, wl, ParallelConfig(tp=1, pp=64, mbs=1))
    pinned = search(model, c, wl, ParallelConfig(pp=64, mbs=1), top_k=1)
    assert not pinned.plans and "pipeline passes per step" in pinned.why_nothing_fits
    enum = enumerate_space(model, 64, 8, wl, ParallelConfig(mbs=1))
    assert any("pipeline passes per step" in rule for rule in enum.infeasible)
    assert enum.groups


@pytest.mark.parametrize("name,gpus,gpu,dtype", [("llama3.1-8b", 8, "h100-sxm", "bf16"),
                                                 ("mixtral-8x7b", 16, "h100-sxm", "fp8"),
                                                 ("gpt3-175b", 64, "a100-80gb", "bf16")])
def test_the_compute_floor_is_below_every_searched_plan(name, gpus, gpu, dtype):
    """The bound a time limit gives groups it never scored (_Search._compute_floor: the model's FLOPs over every
    GPU at the dtype's peak times the highest kernel ceiling, tests/test_kernels.py holds op_time to it) is below
    the plans the full search finds: it is a bound, not a guess."""
    from meshplan.planner.search import Efficiency, _Search
    model, c = zoo(name), cluster(gpus, gpu)
    wl = Workload(global_batch=64, seq_len=2048, dtype=dtype)
    result = search(model, c, wl, top_k=3)
    assert result.plans
    s = _Search(model, c, wl, "megatron-core", Efficiency.from_gpu(c.gpu),
                enumerate_space(model, gpus, c.gpus_per_node, wl, ParallelConfig()), 3)
    floor = s._compute_floor()
    assert 0 < floor < min(p.step_time_s for p in result.plans)


def test_generous_time_limit_changes_nothing():
    free = run(*LLAMA, pins=(("max_mbs", 2),), top_k=3)
    limited = search(zoo("llama3.1-8b"), cluster(8), Workload(global_batch=16, seq_len=2048), top_k=3,
                     time_limit_s=600, max_mbs=2)
    assert limited.account.status == free.account.status
    assert [p.step_time_s for p in limited.plans] == [p.step_time_s for p in free.plans]


def test_a_gap_is_closed_by_simulating_every_partition_below_the_best():
    """DeepSeek-V3 on 2,048 H800 pinned to one mesh: the DP's partition simulates slower than its J (a DP sync
    waits on rank 0's path), so the candidate's bound is open ("bound gap"); the search then simulates every
    partition whose bound is below the best and proves the result optimal: no other split it could have chosen
    (the DP's, the even 4 x 15 + 1) is faster."""
    model, c, wl = zoo("deepseek-v3"), cluster(2048, "h800"), Workload(global_batch=15360, seq_len=4096)
    pins = ParallelConfig(tp=2, cp=1, pp=16, dp=64, ep=8, etp=1, mbs=1, zero=1, recompute="none", sp=True,
                          schedule="1f1b")
    result = search(model, c, wl, pins, top_k=1)
    best = result.plans[0]
    assert best.partition_status == "bound gap" and best.bound_s < best.step_time_s
    assert result.account.status == "optimal" and result.account.gap == 0.0 and result.account.bounded > 0
    for split in ((5, 3) + (4,) * 13 + (1,), (4,) * 15 + (1,)):
        other = estimate(model, c, wl, ParallelConfig(tp=2, pp=16, dp=64, ep=8, etp=1, mbs=1, zero=1, sp=True,
                                                      schedule="1f1b", stage_layers=split))
        assert not other.fits or best.step_time_s <= other.step_time_s * (1 + 1e-9), split


# ---- the runtime's capabilities (issue 16) --------------------------------------------------------------------------

@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_the_search_picks_only_what_the_runtime_runs(runtime):
    """Megatron-Core has no GPipe or zero-bubble schedule, torchtitan no ZeRO-1 and no all-to-all CP, Megatron 2022
    no CP: no plan of a free search uses them (the space holds only what the framework has)."""
    rt = get_runtime(runtime)
    result = run("llama3.1-8b", 16, 32, 8192, top_k=10, pins=(("max_mbs", 2),), runtime=runtime)
    assert result.plans
    for p in result.plans:
        lay = p.estimate.layout
        assert rt.lacks(lay.schedule if lay.pp > 1 else None, lay.cp, lay.cp_comm, lay.zero) is None, (runtime, lay)


def test_a_pinned_knob_the_runtime_lacks_is_refused():
    with pytest.raises(InputError, match="megatron-core has no gpipe schedule"):
        run("llama3.1-8b", 8, 16, 2048, pins=(("schedule", "gpipe"),))
    with pytest.raises(InputError, match="torchtitan has no ZeRO-1"):
        run("llama3.1-8b", 8, 16, 2048, pins=(("zero", 1),), runtime="torchtitan")
    with pytest.raises(InputError, match="megatron-2022 has no context parallelism"):
        run("llama3.1-8b", 8, 16, 2048, pins=(("cp", 2),), runtime="megatron-2022")


def test_a_pinned_vpp_above_the_searched_range_is_honoured():
    """--vpp 16 (above MAX_VPP) is searched as pinned; 126 layers on pp 8 x vpp 16 = 128 virtual stages leave the
    first and the last empty (Megatron's layout 'E|t|...|t|L')."""
    model = zoo("llama3.1-405b")
    result = search(model, cluster(1024), Workload(global_batch=512, seq_len=8192),
                    ParallelConfig(tp=8, pp=8, vpp=16, mbs=1), top_k=1, max_mbs=1)
    assert result.plans, result.why_nothing_fits
    lay = result.plans[0].estimate.layout
    assert lay.vpp == 16 and lay.chunks == (0,) + (1,) * 126 + (0,)


@pytest.mark.parametrize("zero,pp,schedule", [(3, 2, "1f1b"), (2, 2, "gpipe"), (3, 1, "1f1b"), (2, 4, "1f1b")])
def test_sharded_work_bound_is_below_every_partition_and_above_the_plain_one(zero, pp, schedule):
    """ZeRO-2/3 candidates are queued by the work bound over layer times that hold their per-layer DP gathers and
    reduce-scatters: never above the estimate of any stage partition, and above the DP-free work bound (the
    collectives cost something)."""
    import itertools

    from meshplan.costmodels.config import ParallelConfig
    from meshplan.costmodels.estimate import estimate
    from meshplan.planner import search as S
    from meshplan.planner.space import Candidate

    L, gpus = 8, 16
    model = load_model("llama3.1-8b").model_copy(update={"num_layers": L, "name": "llama-8-layers"})
    cluster, wl = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=gpus)), Workload(global_batch=32, seq_len=2048)
    pins = ParallelConfig(tp=1, pp=pp, cp=1, mbs=1, zero=zero, recompute="none", schedule=schedule)
    s = S._Search(model, cluster, wl, "megatron-core", S.Efficiency.from_gpu(cluster.gpu),
                  S.enumerate_space(model, gpus, cluster.gpus_per_node, wl, pins), 1)
    g = s.enum.groups[0]
    c = Candidate(g.mesh, 1, False, "ring", zero, schedule, 1, "none")
    ctx = s._context(c)
    assert ctx.dp_in_layer_times
    row = (s._sharded_key_costs(c, ctx), c.num_microbatches(wl.global_batch), pp, schedule, s._hop(c.mesh, 1))
    bound = float(s._work_bounds([row])[0])
    assert bound > s.work_bound(c) * (1 + 1e-6)
    times = []
    for cuts in itertools.combinations(range(1, L), pp - 1):
        layers = tuple(b - a for a, b in zip((0, *cuts), (*cuts, L), strict=True))
        est = estimate(model, cluster, wl, ParallelConfig(tp=1, pp=pp, dp=gpus // pp, mbs=1, zero=zero,
                                                          recompute="none", schedule=schedule,
                                                          stage_layers=layers if pp > 1 else None))
        times.append(est.step_time_s)
    assert bound <= min(times) * (1 + 1e-9)


@pytest.mark.parametrize("name,gpus,gbs,seq", [("llama3.1-70b", 16, 32, 8192), ("mixtral-8x7b", 16, 32, 4096)])
def test_a_groups_memory_score_bounds_every_candidate_that_may_fit(name, gpus, gbs, seq):
    """A group at the head of the queue is scored again with the recomputation its memory floor allows
    (_Search._fit_group): that score must stay below the work bound of every candidate of the group whose own
    memory floor fits (what expanding it would queue), and a group scored inf must have no such candidate. Both
    cases are memory-tight: most 70B groups need recomputation or fit nothing at all."""
    from meshplan.planner import search as S
    from meshplan.planner.space import Candidate

    model, c, wl = zoo(name), cluster(gpus), Workload(global_batch=gbs, seq_len=seq)
    enum = S.enumerate_space(model, gpus, c.gpus_per_node, wl, ParallelConfig())
    s = S._Search(model, c, wl, "megatron-core", S.Efficiency.from_gpu(c.gpu), enum, 1)
    groups = enum.groups[::3]
    plain, fitted = s._group_scores(groups), s._group_scores(groups, memory=True)
    assert sum(f > p * (1 + 1e-6) for p, f in zip(plain, fitted, strict=True)) >= 10  # the lift is exercised
    for g, low, score in zip(groups, plain, fitted, strict=True):
        assert score >= low * (1 - REL)
        cands = [Candidate(g.mesh, g.mbs, sp, cc, zero, sched, vpp, rec, s.modules)
                 for sp, cc, sched, vpp in g.variants for zero in g.zeros for rec in g.recomputes_for(vpp)]
        fits = [cand for cand, floor in zip(cands, s._memory_floors(cands).tolist(), strict=True) if floor <= s.cap]
        if math.isinf(score):
            assert not fits, f"{g.mesh} mbs={g.mbs} scored inf but {fits[0]} may fit"
        else:
            assert fits and min(s.work_bounds_of(fits).tolist()) >= score * (1 - REL), (g.mesh, g.mbs, score)
