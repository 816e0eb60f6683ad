"""The divisibility rules are one table (costmodels/config.py RULES): resolve() refuses a configuration with the first
broken rule's message, and the search counts the candidates it refuses under the same rule's name. Each case below
breaks one rule; both consumers must name that rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels.config import (BATCH_RULES, CP_RULES, EXPERT_RULES, MESH_RULES, PIN_RULES, PIPELINE_RULES,
                                        RULES, Knobs, ParallelConfig, Workload, broken_rule, resolve)
from meshplan.costmodels.model_io import load_model
from meshplan.hardware_db.errors import InputError
from meshplan.planner.space import check_pins, enumerate_space

LLAMA = load_model("llama3.1-8b")  # 32 heads, 8 KV heads, 32 layers
MIXTRAL = load_model("mixtral-8x7b")  # 8 experts

CASES = [  # (rule, model, GPUs, workload, config; the knobs resolve() reads for it)
    (MESH_RULES[0], LLAMA, 6, Workload(global_batch=12, seq_len=4096), dict(tp=3),
     dict(tp=3, cp=1, pp=1, dp=2)),
    (MESH_RULES[1], LLAMA, 16, Workload(global_batch=16, seq_len=4096), dict(tp=16),
     dict(tp=16, cp=1, pp=1, dp=1)),
    (MESH_RULES[2], LLAMA, 4, Workload(global_batch=8, seq_len=4098), dict(cp=2),
     dict(tp=1, cp=2, pp=1, dp=2)),
    (CP_RULES[0], LLAMA, 64, Workload(global_batch=8, seq_len=4096), dict(tp=8, cp=8, cp_comm="a2a"),
     dict(tp=8, cp=8, pp=1, dp=1, cp_comm="a2a")),
    (BATCH_RULES[0], LLAMA, 4, Workload(global_batch=8, seq_len=4096), dict(mbs=4),
     dict(tp=1, cp=1, pp=1, dp=4, mbs=4)),
    (PIPELINE_RULES[0], LLAMA, 4, Workload(global_batch=6, seq_len=4096), dict(pp=4, vpp=2),
     dict(tp=1, cp=1, pp=4, dp=1, schedule="interleaved", vpp=2)),
    (PIPELINE_RULES[1], LLAMA, 4, Workload(global_batch=70_000, seq_len=4096), dict(pp=4, mbs=1),
     dict(tp=1, cp=1, pp=4, dp=1)),
    (EXPERT_RULES[0], MIXTRAL, 8, Workload(global_batch=8, seq_len=4096), dict(tp=1, ep=8, etp=2),
     dict(tp=1, cp=1, pp=1, dp=8, ep=8, etp=2)),
    (EXPERT_RULES[1], MIXTRAL, 16, Workload(global_batch=8, seq_len=4096),
     dict(tp=2, pp=2, ep=2, rank_order="tp-cp-pp-dp"),
     dict(tp=2, cp=1, pp=2, dp=4, ep=2, etp=2, order="tp-cp-pp-dp")),
]


@pytest.mark.parametrize("rule,model,gpus,wl,config,knobs", CASES, ids=[c[0].name[:40] for c in CASES])
def test_resolve_and_the_search_name_the_same_rule(rule, model, gpus, wl, config, knobs):
    with pytest.raises(InputError) as caught:
        resolve(model, gpus, wl, ParallelConfig(**config))
    assert str(caught.value) == rule.message(Knobs(model, wl, **knobs))
    space = enumerate_space(model, gpus, 8, wl, ParallelConfig(**config))
    assert space.infeasible.get(rule.name, 0) > 0, space.infeasible


def test_every_rule_has_a_case():
    assert sorted(c[0].name for c in CASES) == sorted(r.name for r in RULES)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tp=st.sampled_from([1, 2, 4, 8]), cp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 3]),
       mbs=st.sampled_from([1, 2, 4]), gbs=st.integers(1, 24), seq=st.sampled_from([1024, 1026, 4096]),
       cp_comm=st.sampled_from(["ring", "a2a"]))
def test_a_configuration_resolve_accepts_breaks_no_rule(tp, cp, dp, mbs, gbs, seq, cp_comm):
    """resolve() accepts exactly the configurations that break no mesh, CP or batch rule (one stage, no experts:
    the other rules cannot bind)."""
    wl = Workload(global_batch=gbs, seq_len=seq)
    knobs = Knobs(LLAMA, wl, tp, cp, 1, dp, mbs=mbs, cp_comm=cp_comm)
    broken = broken_rule(MESH_RULES + CP_RULES + BATCH_RULES, knobs)
    try:
        resolve(LLAMA, tp * cp * dp, wl, ParallelConfig(tp=tp, cp=cp, dp=dp, mbs=mbs, cp_comm=cp_comm))
    except InputError as exc:
        assert broken is not None and str(exc) == broken.message(knobs)
    else:
        assert broken is None


PIN_CASES = [  # (rule, model, pins that break it; resolve() fills pp, vpp and ep with 1 where unset)
    (PIN_RULES[0], LLAMA, dict(pp=1, vpp=2)),
    (PIN_RULES[0], LLAMA, dict(pp=1, schedule="interleaved")),
    (PIN_RULES[1], LLAMA, dict(pp=2, vpp=2, schedule="1f1b")),
    (PIN_RULES[2], LLAMA, dict(pp=2, vpp=1, schedule="interleaved")),
    (PIN_RULES[3], LLAMA, dict(ep=2)),
]


@pytest.mark.parametrize("rule,model,pins", PIN_CASES, ids=[f"{c[0].name}-{c[2]}" for c in PIN_CASES])
def test_resolve_and_the_search_refuse_the_same_pins(rule, model, pins):
    """The rules among the knobs themselves are written once: estimate (resolve) and plan (check_pins) say the
    same line."""
    config = ParallelConfig(**pins)
    with pytest.raises(InputError) as by_resolve:
        resolve(model, 8, Workload(global_batch=16, seq_len=4096), config)
    with pytest.raises(InputError) as by_search:
        check_pins(model, 8, Workload(global_batch=16, seq_len=4096), config)
    assert str(by_resolve.value) == str(by_search.value) == rule.message(model, config)


def test_every_pin_rule_has_a_case_and_unset_knobs_break_none():
    assert {c[0].name for c in PIN_CASES} == {r.name for r in PIN_RULES}
    assert not any(r.broken(m, ParallelConfig()) for r in PIN_RULES for m in (LLAMA, MIXTRAL))
