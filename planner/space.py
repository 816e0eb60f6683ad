"""The search space: every knob's domain, the launchers' divisibility rules as constraints, and pins.

A *candidate* is one value for every knob except the stage partition (the partitioner chooses that). The space
is enumerated mesh-first (tp x cp x pp x dp = GPUs), then experts (ep, etp) and the rank order, micro-batch size,
sequence parallelism, CP communication, ZeRO stage, schedule (with virtual stages) and recomputation. A rule that
fails at one level rejects the whole subtree below it; the account counts rejected candidates per rule, so that
the space size = evaluated + pruned + infeasible.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, TypeVar


from meshplan.costmodels.config import (BATCH_RULES, CP_RULES, DEFAULT_RANK_ORDER, DEFAULT_RECOMPUTE_MODULES,
                                        EXPERT_RULES, MESH_RULES, ORDER_NEEDS_NO_EP, PIPELINE_RULES, PP_INSIDE_DP,
                                        CpComm, Knobs, ParallelConfig, RankOrder, Recompute, RecomputeChoice,
                                        RecomputeModule, Schedule, Workload, ZeroStage, broken_rule, check_pin_rules,
                                        check_recompute_modules, check_rules, even_chunks, split_evenly)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.runtime import Runtime
from meshplan.hardware_db.errors import InputError

# the uniform policy a candidate's DPs run: per-stage starts from no recomputation (its relaxed DP), and its memory
# floor assumes full
UNIFORM_POLICY: dict[RecomputeChoice, Recompute] = {"none": "none", "selective": "selective", "full": "full",
                                                    "per-stage": "none"}
MEMORY_POLICY: dict[RecomputeChoice, Recompute] = {"none": "none", "selective": "selective", "full": "full",
                                                   "per-stage": "full"}
# vpp = 1; "interleaved" comes with each vpp > 1. Zero-bubble (ZB-H1) is searched only when pinned (--schedule zb):
# its weight passes are placed greedily by the simulation and its partition bound is loose, so including it by
# default would leave every search with an optimality gap.
SCHEDULES_FLAT: tuple[Schedule, ...] = ("1f1b", "gpipe")
SCHEDULES_ALL: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved", "zb")
CP_COMMS: tuple[CpComm, ...] = ("ring", "a2a")
RECOMPUTES: tuple[RecomputeChoice, ...] = ("none", "selective", "full", "per-stage")
ZEROS: tuple[ZeroStage, ...] = (0, 1, 2, 3)
DEFAULT_MAX_MBS = 16  # micro-batch sizes searched: divisors of gbs/dp up to this (plan --max-mbs)
MAX_VPP = 8  # virtual stages per pipeline rank searched unpinned: 2..8 (a pinned --vpp may be any degree)
MAX_CHUNK_OPTIONS = 2  # uneven virtual-stage splits tried per interleaved candidate (interleaved_chunks)
MIN_CP_TOKENS = 1024  # CP degrees searched leave each rank at least this many tokens of the sequence


class Mesh(NamedTuple):
    """A mesh: the degrees and the rank order. A NamedTuple (immutable, hashed in C): the search keys its caches by
    meshes, layer keys and candidates millions of times, where a frozen dataclass hashes in Python."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    etp: int
    order: RankOrder = DEFAULT_RANK_ORDER  # rank order: where each group's ranks sit (timing.group_ranks)

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


class LayerKey(NamedTuple):
    """What per-layer costs depend on (not pp, dp, ZeRO, schedule): cached across candidates. Not the rank order
    either: tp and cp are innermost in both orders, and the other order has ep = 1 (etp = tp), so the layer's
    groups sit on the same ranks."""

    tp: int
    cp: int
    cp_comm: str
    sp: bool
    mbs: int
    ep: int
    etp: int
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES  # what "selective" re-runs


class Candidate(NamedTuple):
    """One point of the space below its stage partition (a NamedTuple, as Mesh)."""

    mesh: Mesh
    mbs: int
    sp: bool
    cp_comm: CpComm
    zero: ZeroStage
    schedule: Schedule
    vpp: int
    recompute: RecomputeChoice
    modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES  # ParallelConfig.recompute_modules

    @property
    def layer_key(self) -> LayerKey:
        m = self.mesh
        return LayerKey(m.tp, m.cp, self.cp_comm, self.sp, self.mbs, m.ep, m.etp, self.modules)

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.mbs * self.mesh.dp)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


Picked = TypeVar("Picked")


def _pick(domain: list[Picked], pinned: Picked | None) -> list[Picked]:
    return [pinned] if pinned is not None else domain


@dataclass(frozen=True)
class Group:
    """Candidates sharing a mesh and micro-batch size (so the micro-batch count): per (sp, cp_comm) the
    (schedule, vpp) variants that pass the rules; every variant is tried with each ZeRO stage and recomputation."""

    mesh: Mesh
    mbs: int
    num_microbatches: int
    variants: tuple[tuple[bool, CpComm, Schedule, int], ...]  # (sp, cp_comm, schedule, vpp)
    zeros: tuple[ZeroStage, ...]
    recomputes: tuple[RecomputeChoice, ...]  # per-stage dropped by the search where vpp > 1
    # how many candidates the group holds (the search counts pruned groups by it, thousands at a time): the
    # enumeration's count, which must equal candidate_count()
    count: int

    def size(self) -> int:
        return self.count

    def candidate_count(self) -> int:
        flat, virtual = len(self.recomputes_for(1)), len(self.recomputes_for(2))
        return len(self.zeros) * sum(flat if v[3] == 1 else virtual for v in self.variants)

    def recomputes_for(self, vpp: int) -> tuple[RecomputeChoice, ...]:
        return self._recomputes_flat if vpp == 1 else self._recomputes_virtual

    @cached_property
    def _recomputes_flat(self) -> tuple[RecomputeChoice, ...]:  # read per candidate: cached
        # per-stage recomputation is a partitioner choice: it needs stages (pp > 1) and no virtual stages
        return tuple(r for r in self.recomputes if r != "per-stage" or self.mesh.pp > 1)

    @cached_property
    def _recomputes_virtual(self) -> tuple[RecomputeChoice, ...]:
        return tuple(r for r in self.recomputes if r != "per-stage")


@dataclass
class Enumeration:
    """The groups that pass every rule, and how many candidates each rule rejected."""

    groups: list[Group]
    space_size: int
    infeasible: dict[str, int]
    domains: dict[str, str]  # what was searched, in words (for the report)


def enumerate_space(model: ModelSpec, num_gpus: int, gpus_per_node: int, wl: Workload, pins: ParallelConfig,
                    runtime: Runtime | None = None, max_mbs: int = DEFAULT_MAX_MBS) -> Enumeration:
    """All candidates, grouped; the launchers' rules (Megatron-LM arguments.py) reject subtrees, counted by rule.

    Domains (in the plan's account, `_domains`): tp divides the GPUs within one node unless pinned; cp divides what
    is left with seq/cp >= MIN_CP_TOKENS; pp divides what is left; dp fills the GPUs; ep divides the experts, etp
    tp; the rank order where it moves a group (`rank_orders`); mbs divides the batch up to max_mbs; vpp 2..MAX_VPP;
    ZeRO 0-3; recomputation none, selective, full or per stage; with a runtime, only what its framework has."""
    infeasible: dict[str, int] = {}
    # by (tp, cp, pp, micro-batches), the variants the rules keep, those they refuse (candidates by rule) and the
    # candidates kept: the rules read nothing else of a mesh
    knob_rules: dict[tuple, tuple] = {}
    groups: list[Group] = []
    size = 0
    rt_schedules = runtime.schedules if runtime is not None else SCHEDULES_ALL
    rt_cp_comms = runtime.cp_comms if runtime is not None else ("ring", "a2a")
    zeros = tuple(z for z in _pick(list(ZEROS), pins.zero) if runtime is None or z in runtime.zero_stages)
    recs = tuple(r for r in _pick(list(RECOMPUTES), pins.recompute) if runtime is None or r in runtime.recomputes)

    def reject(rule: str, count: int) -> None:
        if count:
            infeasible[rule] = infeasible.get(rule, 0) + count

    weights: dict[tuple[int, int], int] = {}

    def weight(pp: int, vpp: int) -> int:
        if (pp, vpp) not in weights:
            weights[(pp, vpp)] = len(zeros) * len([r for r in recs if r != "per-stage" or (pp > 1 and vpp == 1)])
        return weights[(pp, vpp)]

    tp_domain = [t for t in divisors(num_gpus) if t <= gpus_per_node] if pins.tp is None else [pins.tp]
    for tp in tp_domain:
        if num_gpus % tp:
            continue
        cp_domain = [c for c in divisors(num_gpus // tp)
                     if c == 1 or (wl.seq_len // c >= MIN_CP_TOKENS and rt_cp_comms)]
        for cp in _pick(cp_domain, pins.cp):
            if (num_gpus // tp) % cp:
                continue
            for pp in _pick(divisors(num_gpus // (tp * cp)), pins.pp):
                if (num_gpus // (tp * cp)) % pp:
                    continue
                dp = num_gpus // (tp * cp * pp)
                var = _variants(pins, rt_schedules, rt_cp_comms, tp, cp, pp)
                per_mbs = sum(weight(pp, v[3]) for v in var)
                meshes = _expert_meshes(model, pins, num_gpus, gpus_per_node, tp, cp, pp)
                mbs_domain = [pins.mbs] if pins.mbs is not None else [
                    b for b in divisors(wl.global_batch) if b <= max_mbs]
                subtree = len(meshes) * len(mbs_domain) * per_mbs
                size += subtree
                refused = _mesh_rule(model, wl, tp, cp, pp, dp, pins)
                if refused:
                    reject(refused, subtree)
                    continue
                # the batch rules read only (tp, cp, pp, dp, mbs): once here, not per ep, etp and order
                batch_rules = [(mbs, broken_rule(BATCH_RULES, Knobs(model, wl, tp, cp, pp, dp, mbs=mbs)))
                               for mbs in mbs_domain]
                for ep, etp, order in meshes:
                    rule = broken_rule(EXPERT_RULES, Knobs(model, wl, tp, cp, pp, dp, ep, etp, order))
                    if rule is not None:
                        reject(rule.name, len(mbs_domain) * per_mbs)
                        continue
                    mesh = Mesh(tp, cp, pp, dp, ep, etp, order)
                    for mbs, rule in batch_rules:
                        if rule is not None:
                            reject(rule.name, per_mbs)
                            continue
                        m = wl.global_batch // (mbs * dp)
                        outcome = knob_rules.get((tp, cp, pp, m))  # the same for every ep, etp and order
                        if outcome is None:
                            ok: list[tuple[bool, CpComm, Schedule, int]] = []
                            refusals: dict[str, int] = {}
                            for v in var:
                                knobs = Knobs(model, wl, tp, cp, pp, dp, ep, etp, order, mbs, v[1], v[2], v[3])
                                why = _knob_rule(knobs, pins.vpp is not None)
                                if why:
                                    refusals[why] = refusals.get(why, 0) + weight(pp, v[3])
                                else:
                                    ok.append(v)
                            outcome = knob_rules[(tp, cp, pp, m)] = (
                                tuple(ok), tuple(refusals.items()), sum(weight(pp, v[3]) for v in ok))
                        ok_variants, refused_variants, count = outcome
                        for why, n in refused_variants:
                            reject(why, n)
                        if ok_variants:
                            groups.append(Group(mesh, mbs, m, ok_variants, zeros, recs, count))
    domains = _domains(num_gpus, gpus_per_node, pins, model.moe is not None, zeros, recs, runtime, rt_schedules,
                       max_mbs)
    return Enumeration(groups, size, infeasible, domains)


def _expert_meshes(model: ModelSpec, pins: ParallelConfig, num_gpus: int, gpus_per_node: int, tp: int, cp: int,
                   pp: int) -> list[tuple[int, int, RankOrder]]:
    """(ep, etp, rank order) of one (tp, cp, pp): ep divides the experts and etp divides tp (MoE models only)."""
    dp = num_gpus // (tp * cp * pp)
    if model.moe is None:
        pairs = [(1, tp)]
    else:
        pairs = [(ep, etp) for ep in _pick(divisors(model.moe.num_experts), pins.ep)
                 for etp in _pick(divisors(tp), pins.etp)]
    return [(ep, etp, order) for ep, etp in pairs
            for order in rank_orders(num_gpus, gpus_per_node, tp, cp, pp, dp, ep, pins.rank_order)]


def _variants(pins: ParallelConfig, rt_schedules, rt_cp_comms, tp: int, cp: int,
              pp: int) -> list[tuple[bool, CpComm, Schedule, int]]:
    """(sp, cp kind, schedule, vpp) of one (tp, cp, pp): what the pins and the runtime leave."""
    sps = _pick([True, False], pins.sp) if tp > 1 else [False]
    comms: list[CpComm] = [c for c in _pick(list(CP_COMMS), pins.cp_comm) if c in rt_cp_comms] if cp > 1 else ["ring"]
    scheds: list[tuple[Schedule, int]]
    if pp == 1:
        # one stage has no schedule: 1F1B by convention; a pinned pipeline schedule needs stages
        scheds = [("1f1b", 1)] if pins.schedule in (None, "1f1b") and pins.vpp in (None, 1) else []
    else:
        scheds = [(s, 1) for s in SCHEDULES_FLAT] + [("interleaved", v) for v in range(2, MAX_VPP + 1)]
        if pins.schedule == "zb":
            scheds = [("zb", 1)]
        elif pins.schedule is not None:
            scheds = [(s, v) for s, v in scheds if s == pins.schedule]
    if pins.vpp is not None:
        scheds = [(s, v) for s, v in scheds if v == pins.vpp]
        if pp > 1 and pins.vpp > MAX_VPP and pins.schedule in (None, "interleaved"):
            scheds = [("interleaved", pins.vpp)]  # above the searched range: honoured as pinned
    scheds = [(s, v) for s, v in scheds if s in rt_schedules or pp == 1]
    return [(sp, cc, sch, v) for sp in sps for cc in comms for sch, v in scheds]


def _domains(num_gpus: int, gpus_per_node: int, pins: ParallelConfig, moe: bool, zeros: tuple[int, ...],
             recs: tuple[str, ...], runtime: Runtime | None, rt_schedules, max_mbs: int) -> dict[str, str]:
    """What the space holds for each knob, in words (the plan's account)."""
    return {
        "tp": f"divisors of {num_gpus} up to {gpus_per_node} (one node)" if pins.tp is None else f"pinned {pins.tp}",
        "cp": f"seq/cp >= {MIN_CP_TOKENS} tokens" if pins.cp is None else f"pinned {pins.cp}",
        "pp": "divisors of what is left, <= layers" if pins.pp is None else f"pinned {pins.pp}",
        "vpp": (f"1, or 2..{MAX_VPP}: even virtual stages, or (where pp does not divide the layers) fewer layers on "
                f"the first and last" if pins.vpp is None else f"pinned {pins.vpp}"),
        "mbs": f"divisors of the global batch up to {max_mbs}" if pins.mbs is None else f"pinned {pins.mbs}",
        "ep/etp": ("ep divides the experts, etp divides tp" if moe else "no experts"),
        "order": (f"{DEFAULT_RANK_ORDER}; also {PP_INSIDE_DP} (pp inside dp) where it moves a group onto other "
                  f"links: tp*cp < GPUs per node < GPUs, pp > 1, dp > 1, ep = 1")
                 if pins.rank_order is None else f"pinned {pins.rank_order}",
        "zero": ",".join(map(str, zeros)) + (f" ({runtime.name} has these)" if runtime is not None and len(
            runtime.zero_stages) < len(ZEROS) and pins.zero is None else ""),
        "recompute": ",".join(recs),
        "schedule": (", ".join(s for s in ("1f1b", "gpipe", "interleaved") if s in rt_schedules)
                     + (" (zb only when pinned)" if "zb" in rt_schedules else "")
                     + (f"; {runtime.name} runs no other" if runtime is not None else "")
                     if pins.schedule is None else f"pinned {pins.schedule}"),
        "stages": ("contiguous uneven layer ranges (exact DP); with virtual stages even, or the first and last "
                   "chunk lighter"),
    }


def rank_orders(num_gpus: int, gpus_per_node: int, tp: int, cp: int, pp: int, dp: int, ep: int,
                pinned: RankOrder | None) -> list[RankOrder]:
    """Rank orders searched for one mesh: the pinned one, else the default and, where it moves some group onto
    other links, pp inside dp. It does only when tp*cp ranks leave room in a node for pp and dp neighbours, the
    job spans nodes and both pp and dp exist; elsewhere every group crosses the same link levels in both orders
    (a duplicate candidate). Taken only without EP: Megatron then folds
    the expert ranks etp-ep-pp-edp (initialize.py order tp-cp-ep-pp-dp), a folding the cost model does not have."""
    if pinned is not None:
        return [pinned]
    moves = tp * cp < gpus_per_node < num_gpus and pp > 1 and dp > 1 and ep == 1
    return [DEFAULT_RANK_ORDER, PP_INSIDE_DP] if moves else [DEFAULT_RANK_ORDER]


def _mesh_rule(model: ModelSpec, wl: Workload, tp: int, cp: int, pp: int, dp: int, pins: ParallelConfig) -> str | None:
    if pins.dp is not None and dp != pins.dp:
        return "dp differs from the pinned --dp"
    rule = broken_rule(MESH_RULES, Knobs(model, wl, tp, cp, pp, dp))
    if rule is not None:
        return rule.name
    if pp > model.num_layers:
        return "more pipeline stages than layers"
    if wl.global_batch % dp:
        return "global batch not divisible by dp"
    return None


def _knob_rule(knobs: Knobs, vpp_pinned: bool = False) -> str | None:
    """The first rule a (CP kind, schedule, vpp) variant breaks, by name: the table's (costmodels/config.py) and the
    search's own on virtual stages."""
    rule = broken_rule(CP_RULES, knobs)
    if rule is not None:
        return rule.name
    model, pp, vpp = knobs.model, knobs.pp, knobs.vpp
    if knobs.schedule == "interleaved":
        if not interleaved_chunks(model.num_layers, pp, vpp):
            return "interleaving needs at least one layer per virtual stage (layers >= pp*vpp)"
        if not vpp_pinned and model.num_layers % (pp * vpp) and model.num_layers % pp == 0:
            # where pp divides the layers an even interleaving exists at some vpp: uneven ones are searched only
            # where the stages are uneven anyway (126 layers on 8 or 16 stages, 61, 94), or with --vpp pinned
            return "uneven virtual stages only where pp does not divide the layers (or with --vpp pinned)"
    rule = broken_rule(PIPELINE_RULES, knobs)
    return None if rule is None else rule.name


@functools.lru_cache(maxsize=4096)
def _interleaved_chunks(num_layers: int, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(_splits(num_layers, pp, vpp))


def interleaved_chunks(num_layers: int, pp: int, vpp: int) -> list[tuple[int, ...]]:
    """The virtual-stage splits searched (_splits), cached: the search asks for the same ones many times over."""
    return list(_interleaved_chunks(num_layers, pp, vpp))


def _splits(num_layers: int, pp: int, vpp: int) -> list[tuple[int, ...]]:
    """The virtual-stage splits searched for pp x vpp model chunks (decoder layers per chunk, model order): the even
    split where the layers divide; else k = ceil(layers / chunks) on every chunk but the first and the last, which
    share the rest (at most k each, the last no more than the first: it also runs the LM head and loss; the splits
    nearest to even first, at most MAX_CHUNK_OPTIONS), and the stages balanced with each stage's layers split
    evenly over its chunks (resolve's default). Megatron writes such splits as --pipeline-model-parallel-layout
    (e.g. DeepSeek-V3's 'Et|(tt|)*30mL', 61 layers on pp 16 x vpp 2)."""
    chunks = pp * vpp
    if num_layers % chunks == 0:
        return [(num_layers // chunks,) * chunks]
    out = []
    k = -(-num_layers // chunks)
    rest = num_layers - (chunks - 2) * k
    if rest >= 0:
        ends = sorted(((f, rest - f) for f in range(max(0, rest - k), min(k, rest) + 1) if rest - f <= f),
                      key=lambda fl: fl[0] - fl[1])[:MAX_CHUNK_OPTIONS]
        out = [(f,) + (k,) * (chunks - 2) + (last,) for f, last in ends]
    stages = split_evenly(num_layers, pp)
    if min(stages) >= vpp:
        balanced = even_chunks(tuple(stages), vpp)
        if balanced not in out:
            out.append(balanced)
    return [c for c in out if all(sum(c[s::pp]) >= 1 for s in range(pp))]


def check_pins(model: ModelSpec, num_gpus: int, wl: Workload, pins: ParallelConfig,
               runtime: Runtime | None = None) -> None:
    """Pinned knobs that contradict each other, the cluster or the runtime fail before the search, with the rule that
    failed; so do knobs the search does not take pinned (KnobHelp.searched, and the stage partition it chooses)."""
    for name in ("stage_layers", "chunk_layers", "stage_recompute", "offload_layers"):
        if getattr(pins, name):
            raise InputError(f"plan chooses the stage partition and does not search {name}: leave it unset, or "
                             f"price that configuration with `meshplan estimate`")
    if (pins.recompute_group or 1) > 1:
        raise InputError("plan does not search recompute_group (its bounds assume one kept input per recomputed "
                         "layer): leave it unset, or price that configuration with `meshplan estimate`")
    prod = 1
    for name in ("tp", "cp", "pp", "dp"):
        v = getattr(pins, name)
        if v is not None:
            prod *= v
    if num_gpus % prod:
        raise InputError(f"the pinned degrees multiply to {prod}, which does not divide the {num_gpus} GPUs")
    check_recompute_modules(model, pins.recompute_modules)
    check_pin_rules(model, pins)
    if pins.etp is not None and model.moe is None:
        raise InputError(f"--etp given but {model.name} has no experts")
    if pins.rank_order is not None and pins.ep is not None:  # the rule reads only these two of the knobs
        check_rules((ORDER_NEEDS_NO_EP,), Knobs(model, wl, 1, 1, 1, 1, ep=pins.ep, order=pins.rank_order))
    if runtime is not None:
        default_comm = runtime.cp_comms[0] if runtime.cp_comms else "ring"
        why = runtime.lacks(schedule=pins.schedule, cp=pins.cp or 1, cp_comm=pins.cp_comm or default_comm,
                            zero=pins.zero, recompute_modules=pins.recompute_modules, recompute=pins.recompute)
        if why:
            raise InputError(f"{why}: unpin it, or plan for a --runtime that has it")
