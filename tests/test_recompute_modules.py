"""Megatron-Core's selective recompute modules (--recompute-modules) and DeepEP-style dispatch: what each module
frees and re-runs against hand-derived numbers, their invariants, the CLI's one-line errors, and the Megatron
export round trip."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels import comm
from meshplan.costmodels.config import RECOMPUTE_MODULES, ParallelConfig, Workload, resolve
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.memory import layer_activation_bytes
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.ops import ACT_BYTES, EP_FP8_DISPATCH_BYTES, mlp_half
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers import export_plan
from meshplan.planner.launchers.megatron import megatron_args, parse_megatron_args
from tests.cli_helpers import assert_input_error, run
from tests.launcher_helpers import DEEPSEEK_V3_STAGES, deepseek_v3, make_plan

DSV3 = load_model("deepseek-v3")
LLAMA = load_model("llama3.1-8b")
WL = Workload(global_batch=64, seq_len=4096, dtype="bf16")
RT = get_runtime("megatron-core")


def _layout(model, modules, **knobs):
    cfg = ParallelConfig(**({"tp": 1, "pp": 1, "mbs": 1, "recompute": "selective", "recompute_modules": modules}
                            | knobs))
    return resolve(model, 64, WL, cfg)


def _acts(model, index, modules, **knobs):
    return layer_activation_bytes(model, index, _layout(model, modules, **knobs), WL, RT, "selective")


def test_each_module_frees_what_it_recomputes_by_hand():
    s, h = 4096, DSV3.hidden  # mbs 1, tp 1, bf16: 2-byte tensors
    a, moe = DSV3.mla, DSV3.moe
    base = _acts(DSV3, 10, ("core_attn",))
    # layernorm: the two norm outputs (the QKV and first-MLP linears' inputs), 2 x 2 s h bytes
    assert base - _acts(DSV3, 10, ("core_attn", "layernorm")) == pytest.approx(2 * 2 * s * h)
    # mla_up_proj: Q, K, V of the core, 2 s (n qk + 2 n (qk + v) / 2) bytes
    qkv = 2 * s * (DSV3.num_heads * a.qk_head_dim + DSV3.num_heads * (a.qk_head_dim + a.v_head_dim))
    assert base - _acts(DSV3, 10, ("core_attn", "mla_up_proj")) == pytest.approx(qkv)
    # moe_act: the experts' activation output (the down projection's input), 2 ffn bytes per routed copy
    assignments = s * moe.top_k * WL.moe_imbalance
    assert base - _acts(DSV3, 10, ("core_attn", "moe_act")) == pytest.approx(2 * moe.expert_ffn_hidden * assignments)
    # mlp frees a dense layer's MLP (3 s f + s f bytes for SwiGLU at 2 bytes) and nothing of a MoE layer
    dense = _acts(DSV3, 0, ("core_attn",)) - _acts(DSV3, 0, ("core_attn", "mlp"))
    assert dense == pytest.approx(s * (2 * 2 + 2) * DSV3.ffn_hidden)
    assert _acts(DSV3, 10, ("core_attn", "mlp")) == base


def test_mla_latents_are_kept_for_the_up_projections():
    """The up-projections' inputs (query and KV latents, the RoPE key) stay stored, with or without mla_up_proj."""
    a = DSV3.mla
    none = layer_activation_bytes(DSV3, 10, _layout(DSV3, ("core_attn",)), WL, RT, "none")
    qkv = 2 * 4096 * (DSV3.num_heads * a.qk_head_dim + DSV3.num_heads * (a.qk_head_dim + a.v_head_dim))
    out = 2 * 4096 * DSV3.num_heads * a.v_head_dim
    latents = 2 * 4096 * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim)
    kept = _acts(DSV3, 10, ("mla_up_proj",))
    assert none - kept == pytest.approx(qkv)  # only Q, K, V leave; the latents and the core output stay
    assert kept > latents + out


@settings(max_examples=25, deadline=None)
@given(st.sets(st.sampled_from(RECOMPUTE_MODULES), min_size=1), st.sets(st.sampled_from(RECOMPUTE_MODULES)))
def test_more_modules_never_store_more_nor_recompute_less(base, extra):
    """A superset of modules frees at least as much and re-runs at least as much (memory down, recompute up)."""
    small, big = tuple(base), tuple(base | extra)
    cluster = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=64))
    est = {}
    for mods in (small, big):
        cfg = ParallelConfig(tp=1, pp=4, ep=8, mbs=1, recompute="selective", recompute_modules=mods)
        est[mods] = estimate(DSV3, cluster, Workload(global_batch=64, seq_len=4096), cfg)
    lo, hi = est[small], est[big]
    assert hi.breakdown_s["recompute"] >= lo.breakdown_s["recompute"] - 1e-12
    assert max(s.memory.activations for s in hi.stages) <= max(s.memory.activations for s in lo.stages) + 1e-6
    assert hi.hfu * hi.step_time_s >= lo.hfu * lo.step_time_s * (1 - 1e-12)  # recompute FLOPs: never fewer


def test_modules_the_model_lacks_are_one_clear_error():
    with pytest.raises(InputError, match="mla_up_proj"):
        _layout(LLAMA, ("mla_up_proj",))
    with pytest.raises(InputError, match="no experts"):
        _layout(LLAMA, ("moe_act",))
    with pytest.raises(InputError, match="torchtitan"):
        estimate(LLAMA, Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=64)), WL,
                 ParallelConfig(recompute="selective", recompute_modules=("layernorm",)), runtime="torchtitan")


def test_cli_recompute_modules(capsys):
    code, out, err = run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--recompute",
                         "selective", "--recompute-modules", "core_attn,mlp", "--json")
    assert code == 0, err
    assert '"recompute_modules"' in out and '"mlp"' in out
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                            "--recompute-modules", "attn"), "recompute-modules", "core_attn")
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                            "--recompute", "selective", "--recompute-modules", "mla_up_proj"), "mla_up_proj")
    for command in ("estimate", "plan"):  # torchtitan's selective recompute is op-SAC: Runtime.lacks refuses
        assert_input_error(*run(capsys, command, "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                                "--runtime", "torchtitan", "--recompute-modules", "layernorm"), "torchtitan",
                           "recompute-modules")


def test_published_deepseek_v3_layout_fits_with_its_recomputation():
    """DeepSeek-V3 report sec. 3.3: RMSNorm and MLA up-projections recomputed, SwiGLU output recomputed from its
    cached input; with them the published PP16 EP64 layout fits the H800's 80 GB, with core attention alone not."""
    wl = Workload(global_batch=15360, seq_len=4096, dtype="fp8", fp8_recipe="blockwise")
    knobs = dict(tp=1, pp=16, ep=64, mbs=1, zero=1, recompute="selective", stage_layers=DEEPSEEK_V3_STAGES)
    paper = make_plan("deepseek-v3", "h800", 2048, wl, ParallelConfig(
        **knobs, recompute_modules=("layernorm", "mla_up_proj", "moe_act")), "megatron-core+ep-a2a-overlap+deepep")
    default = make_plan("deepseek-v3", "h800", 2048, wl, ParallelConfig(**knobs), "megatron-core+ep-a2a-overlap+deepep")
    assert max(s.peak_gib for s in paper.memory.stages) < 80 < max(s.peak_gib for s in default.memory.stages)


def test_megatron_export_round_trip_of_recompute_modules():
    plan = deepseek_v3(recompute="selective", recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    argv = megatron_args(plan)
    i = argv.index("--recompute-modules")
    assert argv[i + 1:i + 4] == ["layernorm", "mla_up_proj", "moe_act"]
    launch = parse_megatron_args(argv)
    assert launch.config.recompute_modules == ("layernorm", "mla_up_proj", "moe_act")
    default = megatron_args(deepseek_v3(recompute="selective"))
    assert "--recompute-modules" not in default  # megatron-core's own default, core_attn
    with pytest.raises(InputError, match="attn"):
        parse_megatron_args(argv[:i + 1] + ["attn"] + argv[i + 4:])



def test_exports_without_megatron_modules_refuse_them():
    """torchtitan's selective recompute is per-operator SAC, Megatron-DeepSpeed's and the executor's core attention
    only: a plan whose memory counts on other modules is refused there, not exported as plain 'selective'."""
    llama = make_plan("llama3.1-8b", "h100-sxm", 8, Workload(global_batch=16, seq_len=8192),
                      ParallelConfig(tp=2, recompute="selective", recompute_modules=("core_attn", "mlp")))
    for target in ("torchtitan", "deepspeed", "torchrun"):
        with pytest.raises(InputError, match="--recompute-modules"):
            export_plan(llama, target)
    assert export_plan(llama, "megatron").files
    plain = make_plan("llama3.1-8b", "h100-sxm", 8, Workload(global_batch=16, seq_len=8192),
                      ParallelConfig(tp=2, recompute="selective", zero=0))
    assert export_plan(plain, "torchtitan").files and export_plan(plain, "deepspeed").files

# ---- DeepEP-style dispatch -----------------------------------------------------------------------------------------

def test_node_dedup_share_by_hand():
    # top-8 over 8 nodes: 7 (1 - (7/8)^8) other nodes hit, against 8 x 7/8 copies sent
    assert comm.node_dedup_share(8, 8) == pytest.approx(7 * (1 - (7 / 8) ** 8) / 7)
    assert comm.node_dedup_share(8, 1) == 1.0 and comm.node_dedup_share(1, 8) == 1.0


@given(st.integers(1, 16), st.integers(1, 64))
def test_node_dedup_never_sends_more(top_k, nodes):
    share = comm.node_dedup_share(top_k, nodes)
    assert 0 < share <= 1 + 1e-12
    assert comm.node_dedup_share(top_k + 1, nodes) <= share + 1e-12


def test_deduplicated_dispatch_is_no_slower_and_only_across_nodes():
    inside = comm.Link(300e9, 1e-6, False, 250e9)
    across = comm.Link(300e9, 1e-6, True, 250e9, 45e9, 8)
    b = 512e6
    assert comm.all_to_all(b, 8, inside, 8) == comm.all_to_all(b, 8, inside)
    for n in (16, 32, 64):
        assert comm.all_to_all(b, n, across, 8) < comm.all_to_all(b, n, across)


def test_ep_overlap_never_beats_compute_alone():
    """The 1F1B / DualPipe all-to-all overlap hides at most the communication: every pass still takes its compute."""
    cluster = Cluster(ClusterSpec(gpu="h800", num_gpus=512))
    wl = Workload(global_batch=512, seq_len=4096, dtype="fp8", fp8_recipe="blockwise")
    for rt, (tp, ep) in itertools.product(("megatron-core", "megatron-core+ep-a2a-overlap",
                                           "megatron-core+ep-a2a-overlap+deepep"), ((1, 64), (2, 32))):
        cfg = ParallelConfig(tp=tp, pp=8, ep=ep, mbs=1, recompute="selective",
                             recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
        est = estimate(DSV3, cluster, wl, cfg, runtime=rt)
        assert est.step_time_s >= est.breakdown_s["compute"]
        assert est.breakdown_s["ep_comm"] >= 0
    plain = estimate(DSV3, cluster, wl, cfg, runtime="megatron-core")
    hidden = estimate(DSV3, cluster, wl, cfg, runtime="megatron-core+ep-a2a-overlap")
    assert hidden.breakdown_s["ep_comm"] < plain.breakdown_s["ep_comm"]


def test_fp8_dispatch_by_hand():
    """DeepSeek-V3 sec. 3.3.3: dispatch (and the gradient before the down-projection) in FP8 with a 4-byte scale per
    128 elements, combines in BF16: each pass's all-to-all pair moves (1.03125 + 2) / 4 of its BF16 bytes."""
    EP_FP8_DISPATCH_SHARE = (EP_FP8_DISPATCH_BYTES + ACT_BYTES) / (2 * ACT_BYTES)  # one FP8, one BF16 per pass
    assert pytest.approx((1 + 4 / 128 + 2) / 4) == EP_FP8_DISPATCH_SHARE
    lay = resolve(DSV3, 512, Workload(global_batch=512, seq_len=4096, dtype="fp8", fp8_recipe="blockwise"),
                  ParallelConfig(tp=1, pp=8, ep=64, mbs=1))
    fp8 = Workload(global_batch=512, seq_len=4096, dtype="fp8", fp8_recipe="blockwise")
    bf16 = Workload(global_batch=512, seq_len=4096, dtype="bf16")
    layer = DSV3.num_layers - 1

    def ep_bytes(wl, runtime):
        (c,) = [c for c in mlp_half(DSV3, layer, lay, wl, get_runtime(runtime)).comms if c.dim == "ep"]
        return c.bytes_

    assert ep_bytes(fp8, "megatron-core+fp8-dispatch") == pytest.approx(EP_FP8_DISPATCH_SHARE
                                                                        * ep_bytes(fp8, "megatron-core"))
    assert ep_bytes(bf16, "megatron-core+fp8-dispatch") == ep_bytes(bf16, "megatron-core")  # BF16 training: no FP8


def test_fp8_dispatch_is_never_slower():
    cluster = Cluster(ClusterSpec(gpu="h800", num_gpus=512))
    wl = Workload(global_batch=512, seq_len=4096, dtype="fp8", fp8_recipe="blockwise")
    for base in ("megatron-core", "megatron-core+ep-a2a-overlap", "megatron-core+ep-a2a-overlap+deepep"):
        cfg = ParallelConfig(tp=1, pp=8, ep=64, mbs=1, recompute="selective")
        plain = estimate(DSV3, cluster, wl, cfg, runtime=base)
        fp8 = estimate(DSV3, cluster, wl, cfg, runtime=base + "+fp8-dispatch")
        assert fp8.step_time_s <= plain.step_time_s * (1 + 1e-12)
        assert fp8.breakdown_s["ep_comm"] < plain.breakdown_s["ep_comm"]
