"""The workload, the parallel configuration (the knobs) and the runtime's behaviour, and their validation.

`resolve()` turns user knobs into a `Layout` whose every degree divides what it must, or raises InputError
with the rule that failed (the rules are those Megatron-LM's arguments.py enforces).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.pipeline import MAX_PIPELINE_PASSES, pipeline_passes
from meshplan.hardware_db.errors import InputError

if TYPE_CHECKING:
    from meshplan.costmodels.runtime import Runtime  # runtime.py reads this module's types

Recompute = Literal["none", "selective", "full"]
# what a knob may ask for: a uniform policy, or per-stage policies (the partitioner's choice, or stage_recompute)
RecomputeChoice = Literal["none", "selective", "full", "per-stage"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb"]
CpComm = Literal["ring", "a2a"]  # ring attention P2P, or all-to-all over heads (DeepSpeed-Ulysses)
ZeroStage = Literal[0, 1, 2, 3]
TrainDtype = Literal["bf16", "fp16", "fp8"]
# What selective recomputation re-runs in Megatron-Core (--recompute-modules; megatron/training/arguments.py, default
# core_attn): the attention core, the two norms, MLA's up-projections and RoPE, a dense MLP, the MoE experts'
# activation function, a whole MoE layer (router, dispatch, experts, combine), the shared experts.
RecomputeModule = Literal["core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "moe", "shared_experts"]
RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = get_args(RecomputeModule)
DEFAULT_RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = ("core_attn",)
# How global ranks are numbered over the dense dimensions, innermost (fastest-varying) first.
RankOrder = Literal["tp-cp-dp-pp", "tp-cp-pp-dp"]
RANK_ORDERS: tuple[RankOrder, ...] = get_args(RankOrder)
DenseDim = Literal["tp", "cp", "dp", "pp"]
DEFAULT_RANK_ORDER: RankOrder = "tp-cp-dp-pp"  # Megatron-LM's default "tp-cp-ep-dp-pp"
# Megatron --use-tp-pp-dp-mapping ("tp-cp-ep-pp-dp", training/initialize.py); ep = 1
PP_INSIDE_DP: RankOrder = "tp-cp-pp-dp"


# Bounds far above any published run, so a typo is refused up front instead of simulating 10**12 micro-batches: the
# largest published global batches are a few thousand sequences (Llama 3 405B: 16M tokens = 2,048 x 8K; DeepSeek-V3:
# 15,360), the longest training sequences about 1M tokens.
MAX_GLOBAL_BATCH = 2**17
MAX_SEQ_LEN = 2**24


class Workload(BaseModel):
    """What one training step processes: `global_batch` sequences of `seq_len` tokens."""

    # defer_build (here and on every meshplan model): a schema is built on first use, so a command pays at start-up
    # only for the models it reads (about 0.1 s less for `plan`, benchmarks/RESULTS.md)
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    global_batch: int = Field(gt=0, le=MAX_GLOBAL_BATCH)
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    dtype: TrainDtype = "bf16"
    # FP8 scaling recipe (dtype fp8 only): delayed (TE DelayedScaling), tensorwise (current scaling, TE
    # Float8CurrentScaling / torchao tensorwise), rowwise (torchao), blockwise (1x128 / 128x128, DeepSeek-V3 /
    # TE Float8BlockScaling), mxfp8 (Blackwell MX 32-element blocks)
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"] = "tensorwise"
    moe_imbalance: float = Field(default=1.0, ge=1.0)  # busiest expert's load / mean load
    dropout: bool | None = None  # hidden/attention dropout on; None: the runtime's default (Runtime.dropout)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def uses_dropout(self, rt: Runtime) -> bool:
        return rt.dropout if self.dropout is None else self.dropout



Choice = TypeVar("Choice")


def one_of(value: object, options: Sequence[Choice], what: str) -> Choice:
    """`value` as the option it equals (options: a Literal's values, so the result has that type), or InputError
    naming `what`: where text read from a file or a launcher's arguments becomes a knob."""
    for option in options:
        if value == option:
            return option
    raise InputError(f"{what} {value!r:.40}: choose one of {', '.join(map(str, options))}")


def rank_order_of(dims: Sequence[str]) -> RankOrder:
    """The rank order whose dimensions, innermost first, are `dims` (a plan's mesh.rank_order)."""
    return one_of("-".join(dims), RANK_ORDERS, "rank order")


def rank_order_dims(order: RankOrder) -> list[DenseDim]:
    """The dimensions of a rank order, innermost first."""
    return [one_of(d, get_args(DenseDim), "dimension") for d in order.split("-")]


class StagePolicy(BaseModel):
    """Recomputation on one pipeline stage: none, selective (attention core, Korthikanti et al. 2022 sec. 5), or
    full on the stage's first `full_layers` layers (Megatron --recompute-method block --recompute-num-layers k)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    granularity: Recompute = "none"
    full_layers: int = Field(default=0, ge=0)  # "full" only: layers recomputed in full, counted from the stage's first

    @model_validator(mode="after")
    def _check(self) -> StagePolicy:
        if self.granularity == "full" and self.full_layers < 1:
            raise ValueError("full recomputation needs full_layers >= 1")
        if self.granularity != "full" and self.full_layers:
            raise ValueError(f"'{self.granularity}' takes full_layers 0, got {self.full_layers}")
        return self

    def layer_mode(self, position: int) -> Recompute:
        """The mode of the stage's position-th layer (0 = its first)."""
        if self.granularity == "full":
            return "full" if position < self.full_layers else "none"
        return self.granularity

    def label(self, stage_layers: int) -> str:
        if self.granularity == "full" and self.full_layers < stage_layers:
            return f"full:{self.full_layers}"
        return self.granularity


Degree = Annotated[int | None, Field(gt=0)]  # a parallel degree or a size; None: unset (searched, or the default)


@dataclass(frozen=True)
class KnobHelp:
    """What a knob means to a user: cli/options.py makes the `estimate` and `plan` options of it (flag, help, unit,
    what an unset knob means to each), and docs/knobs.md lists them. A field without one has no command-line flag."""

    help: str  # one sentence, no trailing period
    default: str  # what `estimate` takes when it is unset (resolve's default), in words
    unit: str = ""  # what the number counts, where it counts something
    flag: str = ""  # the option's name; default: --field-name with dashes
    searched: bool = True  # `plan` searches it when unset and honours it pinned; False: `estimate` only
    metavar: str = ""

    def flag_name(self, field: str) -> str:
        return self.flag or "--" + field.replace("_", "-")


class ParallelConfig(BaseModel):
    """The parallel configuration, the one type for the knobs. A field left None is searched by `plan` and takes its
    default in `estimate` (resolve fills it: KnobHelp.default says to what). Adding a knob: docs/knobs.md."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    tp: Annotated[Degree, KnobHelp("Tensor-parallel degree", "1", unit="GPUs per group")] = None
    pp: Annotated[Degree, KnobHelp("Pipeline-parallel degree", "1", unit="stages")] = None
    vpp: Annotated[Degree, KnobHelp(
        "Virtual pipeline stages (model chunks) per pipeline rank; above 1 means the interleaved schedule", "1")
                   ] = None
    dp: Annotated[Degree, KnobHelp("Data-parallel degree", "GPUs / (tp x pp x cp)", unit="replicas")] = None
    cp: Annotated[Degree, KnobHelp("Context-parallel degree (splits the sequence)", "1", unit="GPUs per group")] = None
    cp_comm: Annotated[CpComm | None, KnobHelp(
        "Context-parallel communication: ring (K,V passed around a ring, overlapped with attention) or a2a "
        "(all-to-all over heads, DeepSpeed-Ulysses)", "ring")] = None
    ep: Annotated[Degree, KnobHelp("Expert-parallel degree, MoE models only", "1", unit="GPUs per group")] = None
    etp: Annotated[Degree, KnobHelp("Expert tensor-parallel degree, MoE models only", "--tp",
                                    unit="GPUs per group")] = None
    mbs: Annotated[Degree, KnobHelp("Micro-batch size", "1", unit="sequences")] = None
    zero: Annotated[ZeroStage | None, KnobHelp(
        "ZeRO stage 0-3: 1 shards the optimizer state (Megatron's --use-distributed-optimizer), 2 also the "
        "gradients, 3 also the weights (FSDP)", "1")] = None
    recompute: Annotated[RecomputeChoice | None, KnobHelp(
        "Activation recomputation: none, selective (--recompute-modules), full (whole layers), or per-stage (each "
        "stage none, selective or full on its first k layers: the partitioner's choice, plan only; an estimate "
        "reads it from stage_recompute)", "none")] = None
    # what "selective" recomputes (Megatron --recompute-modules); used only where a stage recomputes selectively
    recompute_modules: Annotated[tuple[RecomputeModule, ...], KnobHelp(
        "What selective recomputation re-runs (Megatron-Core --recompute-modules), comma-separated: "
        + ", ".join(RECOMPUTE_MODULES), ",".join(DEFAULT_RECOMPUTE_MODULES),
        metavar="MODULE[,MODULE...]")] = DEFAULT_RECOMPUTE_MODULES
    # full recomputation in groups of this many layers (Megatron --recompute-method uniform --recompute-num-layers N,
    # transformer_block.py _checkpointed_forward): one input kept per group, a group's layers rebuilt together
    recompute_group: Annotated[Degree, KnobHelp(
        "Layers recomputed together under --recompute full (Megatron --recompute-method uniform "
        "--recompute-num-layers): the input of each group is kept, and its layers are rebuilt at once in the backward",
        "1", unit="decoder layers", searched=False)] = None
    # activations of this many decoder layers kept in host memory between their forward and backward (Megatron
    # --cpu-offloading-num-layers, TransformerEngine's CPU offload); pp 1 and no recomputation, as Megatron requires
    offload_layers: Annotated[int | None, Field(ge=0), KnobHelp(
        "Decoder layers whose activations wait in host memory between forward and backward (Megatron "
        "--cpu-offloading-num-layers); needs --pp 1, no recomputation and the GPU's host_link_gb_s", "0",
        searched=False)] = None
    sp: Annotated[bool | None, KnobHelp("Sequence parallelism with TP", "on when --tp > 1")] = None
    schedule: Annotated[Schedule | None, KnobHelp(
        "Pipeline schedule (zb = zero-bubble ZB-H1; interleaved needs --vpp > 1)",
        "interleaved when --vpp > 1, else 1f1b")] = None
    # decoder layers per pipeline stage; default: balanced
    stage_layers: tuple[int, ...] | None = None
    # decoder layers of every model chunk in model order (pp * vpp entries; chunk c * pp + s is stage s's c-th
    # virtual stage), as Megatron's --pipeline-model-parallel-layout places them; default: each stage's layers
    # split evenly over its chunks, the larger shares first
    chunk_layers: tuple[int, ...] | None = None
    stage_recompute: tuple[StagePolicy, ...] | None = None  # per pipeline stage; overrides `recompute` when given
    rank_order: Annotated[RankOrder | None, KnobHelp(
        "Rank order of the dimensions, innermost first: tp-cp-dp-pp (Megatron's default) or tp-cp-pp-dp "
        "(--use-tp-pp-dp-mapping; needs ep = 1)", DEFAULT_RANK_ORDER, flag="--order")] = None


def knob_help(field: str) -> KnobHelp | None:
    """The command-line help of a ParallelConfig field, or None where it has no flag."""
    return next((m for m in ParallelConfig.model_fields[field].metadata if isinstance(m, KnobHelp)), None)


@dataclass(frozen=True)
class Layout:
    """A validated configuration: every degree known and consistent with model, GPU count and batch. A plan embeds
    it as its prediction's layout (planner/plan.py), where pydantic validates it with unknown keys refused."""

    __pydantic_config__ = ConfigDict(defer_build=True, extra="forbid")

    tp: int
    pp: int
    vpp: int
    dp: int
    cp: int
    cp_comm: CpComm
    ep: int
    etp: int
    edp: int  # expert data parallel: (tp * cp * dp) / (etp * ep), Megatron "MoE parallel folding"
    mbs: int
    num_microbatches: int
    zero: ZeroStage
    recompute: str  # none | selective | full, or "per-stage" when the stages differ (see stage_recompute)
    sp: bool
    schedule: Schedule
    stage_layers: tuple[int, ...]  # decoder layers per pipeline stage (pp entries)
    stage_recompute: tuple[StagePolicy, ...]  # recomputation per pipeline stage (pp entries)
    rank_order: RankOrder = DEFAULT_RANK_ORDER  # dense dims innermost first (group placement, timing.group_ranks)
    chunks: tuple[int, ...] = ()  # decoder layers per model chunk, model order (resolve fills it: pp * vpp entries)
    recompute_modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES  # what "selective" re-runs
    offload_layers: int = 0  # decoder layers whose activations wait in host memory (ParallelConfig.offload_layers)
    recompute_group: int = 1  # layers per full-recomputation group (ParallelConfig.recompute_group)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def chunk_layers(self) -> tuple[tuple[int, int], ...]:
        """(first layer, layer count) of every model chunk, in model order: chunk c*pp + stage holds a slice."""
        counts = self.chunks or even_chunks(self.stage_layers, self.vpp)
        out, start = [], 0
        for n in counts:
            out.append((start, n))
            start += n
        return tuple(out)

    def chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) of every model chunk, in model order (chunk_layers as ranges)."""
        return tuple((first, first + n) for first, n in self.chunk_layers())

    def size(self, dim: str) -> int:
        """The size of a group: a dense dim, an expert dim (etp, ep, edp) or dp_cp (the dense gradients' group)."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "etp": self.etp, "ep": self.ep,
                "edp": self.edp, "dp_cp": self.dp * self.cp}[dim]

    def label(self, inject: str | None = None) -> str:
        """One line naming the layout (every degree, micro-batching, stages, recompute), for the executor's reports;
        `inject` names a deliberate fault, appended in brackets."""
        parts = [f"tp{self.tp}" + (" sp" if self.sp else ""),
                 f"cp{self.cp}" + (f" {self.cp_comm}" if self.cp > 1 else ""),
                 f"pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else ""), f"dp{self.dp}"]
        if self.ep > 1 or self.etp != self.tp:
            parts.append(f"ep{self.ep} etp{self.etp} edp{self.edp}")
        parts += [f"zero{self.zero}", f"mbs{self.mbs} x{self.num_microbatches}"]
        if self.pp > 1:
            parts += [self.schedule, f"stages{list(self.stage_layers)}"]
        parts.append("recompute[" + ",".join(p.granularity if p.granularity != "full" else f"full:{p.full_layers}"
                                             for p in self.stage_recompute) + "]")
        if self.rank_order != DEFAULT_RANK_ORDER:
            parts.append(self.rank_order)
        return " ".join(parts) + (f" [{inject}]" if inject else "")

    @property
    def chunks_even(self) -> bool:
        """Each stage's layers split over its chunks as evenly as possible, larger first (Megatron's
        --num-layers-per-virtual-pipeline-stage and decoder-first/last splits); else only a layout expresses it."""
        return self.chunks == even_chunks(self.stage_layers, self.vpp)


def even_chunks(stage_layers: tuple[int, ...], vpp: int) -> tuple[int, ...]:
    """Chunk layer counts in model order when each stage's layers split evenly over its vpp chunks."""
    per_stage = [split_evenly(n, vpp) for n in stage_layers]
    return tuple(per_stage[s][c] for c in range(vpp) for s in range(len(stage_layers)))


def stages_of_chunks(chunks: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: stage s holds chunks s, s + pp, s + 2 pp, ..."""
    return tuple(sum(chunks[s::pp]) for s in range(pp))


def split_evenly(total: int, parts: int) -> list[int]:
    """Split as evenly as possible, the larger shares first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ---- the divisibility rules: one table, read by resolve() and by the search (planner/space.py) --------------------

@dataclass(frozen=True, slots=True)
class Knobs:
    """What the rules read: the model, the workload and the degrees fixed so far. The search checks each group of
    rules as it fixes their degrees (the mesh, then the experts, the micro-batch, the schedule); resolve() all."""

    model: ModelSpec
    workload: Workload
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int = 1
    etp: int = 1
    order: RankOrder = DEFAULT_RANK_ORDER
    mbs: int = 1
    cp_comm: CpComm = "ring"
    schedule: Schedule = "1f1b"
    vpp: int = 1

    @property
    def num_microbatches(self) -> int:
        return self.workload.global_batch // (self.mbs * self.dp)


@dataclass(frozen=True)
class Rule:
    """A rule a configuration must keep (the framework's, or the cost model's own limit)."""

    name: str  # how the search's account counts the candidates it refuses
    broken: Callable[[Knobs], bool]
    message: Callable[[Knobs], str]  # resolve's one error line: what is wrong and how to fix it


# TP splits the heads (Megatron: query and, without MLA, KV heads); load-balanced causal CP splits the sequence in 2 cp
MESH_RULES = (
    Rule("tp does not divide the attention heads", lambda k: k.model.num_heads % k.tp != 0,
         lambda k: f"--tp {k.tp} does not divide the {k.model.num_heads} attention heads of {k.model.name}"),
    Rule("tp does not divide the KV heads", lambda k: k.model.mla is None and k.model.kv_heads % k.tp != 0,
         lambda k: f"--tp {k.tp} does not divide the {k.model.kv_heads} KV heads of {k.model.name} "
                   f"(Megatron needs it)"),
    Rule("seq not divisible by 2*cp (load-balanced causal CP)",
         lambda k: k.cp > 1 and k.workload.seq_len % (2 * k.cp) != 0,
         lambda k: f"--seq {k.workload.seq_len} is not divisible by 2*cp = {2 * k.cp} (load-balanced causal CP)"),
)
# Ulysses all-to-all splits each TP rank's heads over cp
CP_RULES = (
    Rule("cp a2a needs heads per TP rank divisible by cp",
         lambda k: k.cp > 1 and k.cp_comm == "a2a" and (k.model.num_heads // k.tp) % k.cp != 0,
         lambda k: f"--cp-comm a2a needs the {k.model.num_heads // k.tp} heads per TP rank divisible by cp ({k.cp})"),
)
BATCH_RULES = (
    Rule("global batch not divisible by mbs*dp", lambda k: k.workload.global_batch % (k.mbs * k.dp) != 0,
         lambda k: f"global batch {k.workload.global_batch} is not divisible by mbs*dp = {k.mbs}*{k.dp}; "
                   f"pick --gbs a multiple of {k.mbs * k.dp}"),
)
# Megatron's interleaved schedule needs micro-batches divisible by pp; the simulation's own limit on passes
PIPELINE_RULES = (
    Rule("interleaving needs micro-batches divisible by pp",
         lambda k: k.schedule == "interleaved" and k.num_microbatches % k.pp != 0,
         lambda k: f"interleaved schedule needs micro-batches ({k.num_microbatches}) divisible by pp ({k.pp}) "
                   f"(Megatron rule)"),
    Rule(f"more than {MAX_PIPELINE_PASSES:,} pipeline passes per step to simulate (micro-batches x stages)",
         lambda k: pipeline_passes(k.schedule, k.pp, k.num_microbatches, k.vpp) > MAX_PIPELINE_PASSES,
         lambda k: f"{k.num_microbatches} micro-batches on pp*vpp = {k.pp * k.vpp} model stages make "
                   f"{pipeline_passes(k.schedule, k.pp, k.num_microbatches, k.vpp):,} pipeline passes per step; "
                   f"meshplan simulates at most {MAX_PIPELINE_PASSES:,}: raise --mbs or --dp, or lower --gbs"),
)
# Megatron-Core MoE parallel folding: the expert groups (etp x ep) tile the dense ranks (tp x cp x dp); its
# tp-pp-dp rank mapping has no expert parallelism
EXPERT_RULES = (
    Rule("etp*ep does not divide tp*cp*dp (MoE parallel folding)",
         lambda k: k.model.moe is not None and (k.tp * k.cp * k.dp) % (k.ep * k.etp) != 0,
         lambda k: f"etp*ep = {k.etp}*{k.ep} must divide tp*cp*dp = {k.tp * k.cp * k.dp} (experts fold onto the "
                   f"same ranks)"),
    Rule(f"rank order {PP_INSIDE_DP} needs ep = 1", lambda k: k.order == PP_INSIDE_DP and k.ep > 1,
         lambda k: f"rank order {PP_INSIDE_DP} (Megatron --use-tp-pp-dp-mapping) needs ep = 1; got ep={k.ep}; "
                   f"use --order tp-cp-dp-pp for expert parallelism"),
)
RULES = MESH_RULES + CP_RULES + BATCH_RULES + PIPELINE_RULES + EXPERT_RULES
ORDER_NEEDS_NO_EP = EXPERT_RULES[1]  # reads only the rank order and ep: the search checks it on the pins too


@dataclass(frozen=True)
class PinRule:
    """A rule among the knobs themselves, before any degree is derived: it reads a ParallelConfig where None means
    "not fixed" and breaks only on fixed values, so the search checks it on the pins (planner/space.py check_pins)
    and resolve() on the knobs with their defaults."""

    name: str
    broken: Callable[[ModelSpec, ParallelConfig], bool]
    message: Callable[[ModelSpec, ParallelConfig], str]


# Megatron's interleaved schedule is the one with virtual stages, and interleaves pipeline ranks
PIN_RULES = (
    PinRule("virtual stages need pp > 1",
            lambda m, c: c.pp == 1 and (c.schedule == "interleaved" or (c.vpp or 1) > 1),
            lambda m, c: "--schedule interleaved / --vpp > 1 need --pp > 1 (virtual stages interleave pipeline "
                         "ranks); drop them or raise --pp"),
    PinRule("virtual stages need the interleaved schedule",
            lambda m, c: (c.vpp or 1) > 1 and c.schedule not in (None, "interleaved"),
            lambda m, c: f"--vpp {c.vpp} needs --schedule interleaved (got {c.schedule})"),
    PinRule("the interleaved schedule needs virtual stages", lambda m, c: c.schedule == "interleaved" and c.vpp == 1,
            lambda m, c: "--schedule interleaved needs --vpp > 1"),
    PinRule("expert parallelism on a model without experts", lambda m, c: m.moe is None and (c.ep or 1) > 1,
            lambda m, c: f"--ep {c.ep} given but {m.name} has no experts"),
)


def check_pin_rules(model: ModelSpec, config: ParallelConfig) -> None:
    """InputError with the first broken pin rule's message."""
    for rule in PIN_RULES:
        if rule.broken(model, config):
            raise InputError(rule.message(model, config))


def broken_rule(rules: Sequence[Rule], knobs: Knobs) -> Rule | None:
    """The first of `rules` the knobs break, or None."""
    for rule in rules:
        if rule.broken(knobs):
            return rule
    return None


def check_rules(rules: Sequence[Rule], knobs: Knobs) -> None:
    """InputError with the first broken rule's message."""
    rule = broken_rule(rules, knobs)
    if rule is not None:
        raise InputError(rule.message(knobs))


def resolve(model: ModelSpec, num_gpus: int, workload: Workload, cfg: ParallelConfig) -> Layout:
    """Fill defaults (KnobHelp.default) and check every rule; raise InputError naming the rule and a fix."""
    tp, pp, cp, vpp, ep, mbs = (1 if v is None else v for v in (cfg.tp, cfg.pp, cfg.cp, cfg.vpp, cfg.ep, cfg.mbs))
    check_pin_rules(model, cfg.model_copy(update={"pp": pp, "vpp": vpp, "ep": ep}))
    cp_comm: CpComm = cfg.cp_comm or "ring"
    order = cfg.rank_order or DEFAULT_RANK_ORDER
    dp = _data_parallel(model, num_gpus, workload, (tp, pp, cp, cfg.dp), mbs, cp_comm)
    schedule = _schedule(model, workload, (tp, pp, cp, dp), vpp, mbs, cfg.schedule)
    stage_layers, chunks = _stage_split(model, cfg, pp, vpp)
    etp, edp = _expert_layout(model, workload, (tp, pp, cp, dp), ep, cfg.etp, order)
    sp = cfg.sp if cfg.sp is not None else tp > 1
    if sp and tp == 1:
        sp = False  # sequence parallel is a no-op without tensor parallel
    stage_recompute, recompute = _stage_recompute(cfg, stage_layers)
    modules = check_recompute_modules(model, cfg.recompute_modules)
    offload = cfg.offload_layers or 0
    _check_offload(model, pp, offload, stage_recompute)
    group = cfg.recompute_group or 1
    _check_recompute_group(group, stage_recompute, stage_layers)
    return Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, cp_comm=cp_comm, ep=ep, etp=etp, edp=edp, mbs=mbs,
                  num_microbatches=workload.global_batch // (mbs * dp), zero=1 if cfg.zero is None else cfg.zero,
                  recompute=recompute, sp=sp, schedule=schedule, stage_layers=stage_layers,
                  stage_recompute=stage_recompute, rank_order=order, chunks=chunks, recompute_modules=modules,
                  offload_layers=offload, recompute_group=group)


Degrees = tuple[int, int, int, int]  # (tp, pp, cp, dp) as resolve has fixed them


def _data_parallel(model: ModelSpec, num_gpus: int, workload: Workload, mesh: tuple[int, int, int, int | None],
                   mbs: int, cp_comm: CpComm) -> int:
    """dp (given, or what fills the GPUs), after the mesh's rules: the degrees tile the GPUs, TP splits the heads,
    CP the sequence, and the global batch splits into micro-batches over dp."""
    tp, pp, cp, given = mesh
    if num_gpus % (tp * pp * cp):
        raise InputError(f"tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide {num_gpus} GPUs")
    dp = given if given is not None else num_gpus // (tp * pp * cp)
    if tp * pp * cp * dp != num_gpus:
        raise InputError(
            f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {tp * pp * cp * dp} but the cluster has {num_gpus} GPUs; "
            f"omit --dp to derive it"
        )
    check_rules(MESH_RULES + CP_RULES + BATCH_RULES, Knobs(model, workload, tp, cp, pp, dp, mbs=mbs, cp_comm=cp_comm))
    return dp


def _schedule(model: ModelSpec, workload: Workload, mesh: Degrees, vpp: int, mbs: int,
              given: Schedule | None) -> Schedule:
    """The pipeline schedule (given, or interleaved with virtual stages, else 1F1B), after its rules."""
    tp, pp, cp, dp = mesh
    schedule = given or ("interleaved" if vpp > 1 else "1f1b")  # PIN_RULES hold: virtual stages iff interleaved
    check_rules(PIPELINE_RULES, Knobs(model, workload, tp, cp, pp, dp, mbs=mbs, schedule=schedule, vpp=vpp))
    return schedule


def _stage_split(model: ModelSpec, cfg: ParallelConfig, pp: int, vpp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(decoder layers per pipeline stage, per model chunk): given as chunks or stages, else balanced."""
    if cfg.chunk_layers is not None:
        chunks = tuple(cfg.chunk_layers)
        if len(chunks) != pp * vpp or sum(chunks) != model.num_layers or min(chunks) < 0:
            raise InputError(f"chunk_layers {list(chunks)} must have pp*vpp = {pp * vpp} entries >= 0 summing to "
                             f"{model.num_layers} layers")
        stage_layers = stages_of_chunks(chunks, pp)
        if min(stage_layers) < 1:
            raise InputError(f"chunk_layers {list(chunks)} leave a pipeline stage without layers "
                             f"({list(stage_layers)})")
        if cfg.stage_layers is not None and tuple(cfg.stage_layers) != stage_layers:
            raise InputError(f"stage_layers {list(cfg.stage_layers)} disagree with chunk_layers "
                             f"(stages of {list(stage_layers)})")
    elif cfg.stage_layers is not None:
        stage_layers = tuple(cfg.stage_layers)
        if len(stage_layers) != pp or sum(stage_layers) != model.num_layers or min(stage_layers) < vpp:
            raise InputError(
                f"stage_layers {list(stage_layers)} must have pp={pp} entries, each >= vpp={vpp}, "
                f"summing to {model.num_layers} layers"
            )
        chunks = even_chunks(stage_layers, vpp)
    else:
        if model.num_layers < pp * vpp:
            raise InputError(f"{model.num_layers} layers cannot fill pp*vpp = {pp * vpp} model chunks")
        stage_layers = tuple(split_evenly(model.num_layers, pp))
        chunks = even_chunks(stage_layers, vpp)
    return stage_layers, chunks


def _expert_layout(model: ModelSpec, workload: Workload, mesh: Degrees, ep: int, given_etp: int | None,
                   order: RankOrder) -> tuple[int, int]:
    """(etp, edp): the experts folded onto the dense ranks (Megatron's MoE parallel folding)."""
    tp, pp, cp, dp = mesh
    etp = given_etp if given_etp is not None else tp
    if model.moe is None:  # ep = 1 (PIN_RULES)
        etp, edp = tp, dp * cp
    else:
        if model.moe.num_experts % ep:
            raise InputError(f"--ep {ep} does not divide the {model.moe.num_experts} experts of {model.name}")
        edp = tp * cp * dp // (etp * ep)
    check_rules(EXPERT_RULES, Knobs(model, workload, tp, cp, pp, dp, ep=ep, etp=etp, order=order))
    return etp, edp


def _check_offload(model: ModelSpec, pp: int, offload_layers: int, stage_recompute: tuple[StagePolicy, ...]) -> None:
    """Activation offload's rules (Megatron's): no pipeline, no recomputation, fewer layers than the model's."""
    if offload_layers:
        # megatron/core/transformer/transformer_config.py __post_init__: the same three rules
        if pp > 1:
            raise InputError(f"--offload-layers needs --pp 1 (Megatron has no CPU offloading with pipeline "
                             f"parallelism); got --pp {pp}")
        if any(p.granularity != "none" for p in stage_recompute):
            raise InputError("--offload-layers cannot be combined with recomputation (Megatron refuses it): "
                             "use --recompute none")
        if offload_layers >= model.num_layers:
            raise InputError(f"--offload-layers {offload_layers}: offload fewer than the model's "
                             f"{model.num_layers} layers")


def _check_recompute_group(group: int, stage_recompute: tuple[StagePolicy, ...], stage_layers: tuple[int, ...]) -> None:
    """Recomputation in groups is Megatron's uniform method: full recomputation of every layer."""
    uniform = all(p.granularity == "full" and p.full_layers == n for p, n in zip(stage_recompute, stage_layers,
                                                                                    strict=True))
    if group > 1 and not uniform:
        raise InputError(f"--recompute-group {group} groups the full recomputation of every layer (Megatron "
                         f"--recompute-method uniform): add --recompute full, or drop --recompute-group")


def check_recompute_modules(model: ModelSpec, given: tuple[str, ...]) -> tuple[RecomputeModule, ...]:
    """The selective-recompute modules, each once, in Megatron's order; refused where the model lacks the part."""
    if not given:
        raise InputError("--recompute-modules is empty: name at least one of " + ", ".join(RECOMPUTE_MODULES))
    lacking = {"mla_up_proj": model.mla is None and "no multi-latent attention",
               "moe_act": model.moe is None and "no experts", "moe": model.moe is None and "no experts",
               "shared_experts": (model.moe is None or not model.moe.num_shared_experts) and "no shared experts"}
    for name in given:
        if lacking.get(name):
            raise InputError(f"recompute module {name} needs a part {model.name} lacks ({lacking[name]}); "
                             f"drop it from --recompute-modules")
    return tuple(m for m in RECOMPUTE_MODULES if m in given)


def _stage_recompute(cfg: ParallelConfig, stage_layers: tuple[int, ...]) -> tuple[tuple[StagePolicy, ...], str]:
    """Per-stage policies from --recompute (uniform) or an explicit list; and the layout's one-word summary."""
    if cfg.stage_recompute is None:
        uniform = cfg.recompute or "none"
        if uniform == "per-stage":
            raise InputError("--recompute per-stage needs each stage's policy: `plan` chooses them, an estimate "
                             "reads them from stage_recompute (a plan file or the Python API); on the command line "
                             "choose none, selective or full")
        made: dict[int, StagePolicy] = {}  # one (frozen) policy per stage size: a planner resolves thousands
        for n in stage_layers:
            if n not in made:
                made[n] = StagePolicy(granularity=uniform, full_layers=n if uniform == "full" else 0)
        policies = tuple(made[n] for n in stage_layers)
        return policies, uniform
    policies = tuple(cfg.stage_recompute)
    if len(policies) != len(stage_layers):
        raise InputError(f"stage_recompute has {len(policies)} entries but there are {len(stage_layers)} pipeline "
                         f"stages")
    for r, (pol, n) in enumerate(zip(policies, stage_layers, strict=True)):
        if pol.granularity == "full" and not 1 <= pol.full_layers <= n:
            raise InputError(f"stage {r}: full recompute of {pol.full_layers} layers, but the stage has {n}")
        if pol.granularity != "full" and pol.full_layers:
            raise InputError(f"stage {r}: full_layers is only meaningful with granularity 'full'")
    labels = {p.label(n) for p, n in zip(policies, stage_layers, strict=True)}
    return policies, (labels.pop() if len(labels) == 1 else "per-stage")
