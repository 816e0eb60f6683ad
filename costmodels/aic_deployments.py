"""Measured serving deployments (issue 45): the rows of NVIDIA AIConfigurator's `systems/silicon_sample.csv`
(Apache-2.0, in the `aiconfigurator-core` wheel, the optional extra `meshplan[aic]`), read from the installed wheel,
and meshplan's serving model priced on each with its measured layout, precision and request shape.

A row is one benchmark point of vLLM, SGLang or TensorRT-LLM: a model on a system, ISL x OSL tokens per request, a
closed-loop client of `silicon_concurrency` users (in the row's `silicon_data_source`), and the measured mean TTFT and
TPOT. Its layout, as AIConfigurator writes it:
- aggregated: one engine of tp_size x attention_dp_size x pp_size GPUs; moe_tp_size x moe_ep_size = tp_size x
  attention_dp_size (the experts spread over the attention ranks); batch_size is the users per attention-DP rank;
- disaggregated: prefill and decode pools, each with its layout, worker count and batch size; most rows lack the
  counts (AIConfigurator's own curation keeps only the complete ones), and those are not priced.
meshplan's EngineLayout(tp, dp = attention DP, pp, ep) says the same: its expert TP is tp x dp / ep.
Some runs are listed twice (under a database dump and the CSV it came from: every cell the same but the id and the
source); the copy is kept as unread, with the row it repeats, so that each measurement counts once. Rows that measure
one deployment with different figures (another engine version, or a rerun) are all read; `repeats` pairs them.

Not in the file, so assumed (each stated where it is used): the KV-cache dtype (FP8 with FP8 or FP4 weights, else
BF16: AIConfigurator's own default, sdk/models/helpers.py _infer_quant_modes_from_raw_config), fixed request lengths
(the client's synthetic ISL/OSL), one aggregated engine taking all the users, the token budget AIConfigurator's
benchmark rules set (token_budget: each attention-DP rank's batch + ISL + 1,500 tokens per iteration), and the
client's run: AIConfigurator's benchmark template (aiperf, 20 rounds from idle), which an aggregated engine is
simulated under (an attention-DP one as one of its groups in lockstep), and disaggregated deployments request by
request through their prefill and decode engines (serving_sim.simulate_disaggregated).
The throughput is not measured in the file: it is derived from TTFT and TPOT by Little's law for the closed loop
(users / (TTFT + (OSL - 1) TPOT) requests/s), for the measurement and the prediction alike.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from typing import Literal

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.engine_calibration import EngineParameters
from meshplan.costmodels.kernel_tables import EXTRA, PACKAGE, SYSTEMS, aic_package
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model_file
from meshplan.costmodels.serving import (UNMIXED_ENGINES, EngineLayout, ServeWorkload, WeightDtype, aggregated_state,
                                         decode_state, prefill_state)
from meshplan.costmodels.serving_load import closed_loop_ttft, concurrency_point
from meshplan.costmodels.serving_sim import group_view, simulate_benchmark, simulate_disaggregated
from meshplan.hardware_db.cluster import Cluster, ClusterSpec, engine_cluster
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

CSV_PATH = ("systems", "silicon_sample.csv")
GPUS = {system: gpu for gpu, system in SYSTEMS.items()}  # AIConfigurator system -> meshplan GPU
# the row's model_path -> the config file of aiconfigurator_core/model_configs that describes it, where the names
# differ (a quantised or instruct checkpoint of the same architecture)
CONFIG_OF = {"meta-llama/Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B",
             "meta-llama/Llama-3.1-8B-Instruct": "meta-llama--Meta-Llama-3.1-8B",
             "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama--Meta-Llama-3.1-8B",
             "nvidia/Qwen3-32B-NVFP4": "Qwen--Qwen3-32B",
             "nvidia/DeepSeek-R1-NVFP4": "deepseek-ai--DeepSeek-R1",
             "zhipuai/GLM-5": "zai-org--GLM-5"}
# the row's precision -> meshplan weight dtype
WEIGHTS: dict[str, WeightDtype] = {"fp8": "fp8", "fp4": "fp4", "bf16": "bf16", "": "bf16"}
COPY = "a copy of row"  # the start of a copied row's reason (Unread.why)
# An aggregated engine's tokens per iteration, per attention-DP rank, as AIConfigurator's benchmark rules set them:
# the rank's batch + ISL + 1,500 (generator/rule_plugin/benchmark/{vllm,trtllm,sglang}.rule: max_num_tokens, or
# SGLang's max_prefill_tokens = ISL + 1,500), TensorRT-LLM's rounded up to its 32-token KV blocks
BUDGET_MARGIN = 1500
TRTLLM_BLOCK = 32
ROUNDS = 20  # AIConfigurator's benchmark template: users x 20 requests after a drained warm-up (serving_reference.yaml)
Mode = Literal["aggregated", "disaggregated"]


@dataclass(frozen=True)
class Pool:
    """Engines of one layout: AIConfigurator's tp, pp, attention DP and expert EP, how many engines, and its batch
    size (aggregated: users per attention-DP rank; prefill: prompts per iteration; decode: sequences per engine)."""

    layout: EngineLayout
    moe_tp: int  # the row's expert TP (meaningless for a dense model, whose rows give 1)
    workers: int | None
    batch: int | None

    def check(self, model: ModelSpec) -> None:
        """InputError where meshplan refuses the layout, or where the row's expert TP x EP is not its attention
        ranks (meshplan spreads the experts over them)."""
        self.layout.check(model)
        lay = self.layout
        if model.moe is not None and self.moe_tp * lay.ep != lay.tp * lay.dp:
            raise InputError(f"moe_tp {self.moe_tp} x moe_ep {lay.ep} is not tp {lay.tp} x attention dp {lay.dp}")


@dataclass(frozen=True)
class Deployment:
    """One measured row."""

    id: str
    engine: str  # vllm, sglang, trtllm
    version: str  # the engine's version ("" where the row has none)
    model_path: str
    gpu: str  # meshplan's name of the system
    mode: Mode
    precision: str  # the row's precision ("" where it has none: an unquantised checkpoint)
    isl: int
    osl: int
    users: int  # the closed-loop client's concurrency
    pool: Pool  # aggregated: the engine; disaggregated: the decode pool
    prefill: Pool | None
    ttft_ms: float
    tpot_ms: float

    @property
    def gpus(self) -> int | None:
        """GPUs the deployment runs on; None where a pool's worker count is missing."""
        if self.prefill is None:
            return self.pool.layout.gpus
        if self.pool.workers is None or self.prefill.workers is None:
            return None
        return self.pool.workers * self.pool.layout.gpus + self.prefill.workers * self.prefill.layout.gpus

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """The measured output throughput per GPU, derived (module docstring)."""
        return little_throughput(self.users, self.osl, self.ttft_ms / 1e3, self.tpot_ms / 1e3, self.gpus)


@dataclass(frozen=True)
class Unread:
    """A row that cannot be read as a deployment, and why."""

    id: str
    model_path: str
    why: str


@dataclass(frozen=True)
class DeploymentSet:
    """The rows read, those that could not be, and where they came from (the wheel's version and the file's hash)."""

    deployments: tuple[Deployment, ...]
    unread: tuple[Unread, ...]
    source: str


@dataclass(frozen=True)
class Priced:
    """meshplan's figures for a deployment, from its layout alone."""

    ttft_ms: float
    tpot_ms: float
    tokens_per_s_per_gpu: float | None


def little_throughput(users: int, osl: int, ttft_s: float, tpot_s: float, gpus: int | None) -> float | None:
    """Output tokens/s per GPU of a closed loop of `users` (Little's law: each user's request takes TTFT + (OSL - 1)
    TPOT, then the next one starts)."""
    if gpus is None:
        return None
    return users * osl / (ttft_s + (osl - 1) * tpot_s) / gpus


def relative_errors(d: Deployment, ttft_s: float, tpot_s: float) -> dict[str, float]:
    """predicted / measured - 1 of TTFT, TPOT and, where the GPU count is known, the throughput (Little's law)."""
    out = {"ttft": ttft_s * 1e3 / d.ttft_ms - 1, "tpot": tpot_s * 1e3 / d.tpot_ms - 1}
    predicted = little_throughput(d.users, d.osl, ttft_s, tpot_s, d.gpus)
    if predicted is not None and d.tokens_per_s_per_gpu is not None:
        out["throughput"] = predicted / d.tokens_per_s_per_gpu - 1
    return out


def _int(value: str) -> int | None:
    """A count cell: None when empty; ValueError when not a whole number."""
    if value.strip() == "":
        return None
    number = float(value)
    if number != int(number):
        raise ValueError(f"{value!r} is not a whole number")
    return int(number)


def _pool(row: dict[str, str], prefix: str) -> Pool:
    """One pool's layout from the `prefix`ed columns ("" for an aggregated row); ValueError naming the column that
    is missing or does not add up."""
    cells = {name: _int(row[f"{prefix}{name}"]) for name in ("tp_size", "pp_size", "attention_dp_size",
                                                              "moe_tp_size", "moe_ep_size")}
    if cells["attention_dp_size"] is None:  # left empty where attention DP is off (dense models' rows)
        cells["attention_dp_size"] = 1
    for name, value in cells.items():
        if value is None or value < 1:
            raise ValueError(f"{prefix}{name} is {row[prefix + name] or 'empty'}")
    tp, pp, dp, moe_tp, ep = (cells[n] for n in ("tp_size", "pp_size", "attention_dp_size", "moe_tp_size",
                                                  "moe_ep_size"))
    assert tp and pp and dp and moe_tp and ep
    workers = _int(row[f"{prefix}num_workers"]) if prefix else 1
    return Pool(EngineLayout(tp=tp, dp=dp, pp=pp, ep=ep), moe_tp, workers, _int(row[f"{prefix}batch_size"]))


def parse_row(row: dict[str, str]) -> Deployment:
    """A CSV row as a Deployment; ValueError saying what it lacks."""
    gpu = GPUS.get(row["system"])
    if gpu is None:
        raise ValueError(f"system {row['system']} has no meshplan GPU")
    found = re.search(r"silicon_concurrency=(\d+)", row["silicon_data_source"])
    if found is None:
        raise ValueError("silicon_data_source gives no silicon_concurrency")
    mode: Mode = "aggregated" if row["mode"] == "agg" else "disaggregated"
    if row["mode"] not in ("agg", "disagg"):
        raise ValueError(f"mode {row['mode']!r} is neither agg nor disagg")
    pool = _pool(row, "" if mode == "aggregated" else "decode_")
    prefill = None if mode == "aggregated" else _pool(row, "prefill_")
    ttft, tpot = float(row["silicon_ttft_ms"] or "nan"), float(row["silicon_tpot_ms"] or "nan")
    if not (ttft > 0 and tpot > 0):
        raise ValueError("silicon_ttft_ms or silicon_tpot_ms is missing")
    return Deployment(row["id"], row["backend"], row["backend_version"], row["model_path"], gpu, mode,
                      row["precision"], int(row["isl"]), int(row["osl"]), int(found.group(1)), pool, prefill, ttft,
                      tpot)


def read_deployments(text: str | None = None) -> DeploymentSet:
    """Every row of the installed wheel's silicon_sample.csv (or of `text`, a file of the same columns): the rows
    read, and those that could not be with the reason."""
    source = "text"
    if text is None:
        path = aic_package().joinpath(*CSV_PATH)
        if not path.is_file():
            raise InputError(f"the installed aiconfigurator-core has no {'/'.join(CSV_PATH)}; upgrade it ({EXTRA})")
        text = path.read_text(encoding="utf-8")
        source = (f"aiconfigurator-core {metadata.version('aiconfigurator-core')} {'/'.join(CSV_PATH)} "
                  f"sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}")
    read, unread = [], []
    first_of: dict[Deployment, str] = {}  # a row without its id -> the first row's id
    for row in csv.DictReader(io.StringIO(text)):
        try:
            d = parse_row(row)
        except (ValueError, KeyError) as exc:
            unread.append(Unread(row.get("id", "?"), row.get("model_path", "?"), str(exc)))
            continue
        first = first_of.setdefault(dataclasses.replace(d, id=""), d.id)
        if first == d.id:
            read.append(d)
        else:  # one run listed twice (under a database dump and the CSV it came from): counted once
            unread.append(Unread(d.id, d.model_path, f"{COPY} {first} (the same engine version, layout, load and "
                                                     "measured TTFT and TPOT)"))
    return DeploymentSet(tuple(read), tuple(unread), source)


@dataclass(frozen=True)
class Repeat:
    """Two rows measuring one deployment (the same engine, model, GPU, precision, layout, request shape and users)
    with different figures: another engine version, or the same version run again."""

    first: Deployment
    second: Deployment

    @property
    def same_version(self) -> bool:
        return self.first.version == self.second.version

    def spread(self, metric: Literal["ttft", "tpot"]) -> float:
        """The larger measured figure over the smaller, less 1."""
        a, b = ((self.first.ttft_ms, self.second.ttft_ms) if metric == "ttft"
                else (self.first.tpot_ms, self.second.tpot_ms))
        return max(a, b) / min(a, b) - 1


def repeats(deployments: Iterable[Deployment]) -> list[Repeat]:
    """Every pair of rows that measure one deployment, in file order. How far the measurements disagree bounds what
    any prediction from the deployment alone can reach: exact on one row of a pair, it is off on the other by
    1 - smaller / larger."""
    rows_of: dict[Deployment, list[Deployment]] = {}
    for d in deployments:
        rows_of.setdefault(measured_deployment(d), []).append(d)
    return [Repeat(a, b) for rows in rows_of.values() for i, a in enumerate(rows) for b in rows[i + 1:]]


def measured_deployment(d: Deployment) -> Deployment:
    """What a row measures, without the measurement: its id, engine version and figures blanked."""
    return dataclasses.replace(d, id="", version="", ttft_ms=0.0, tpot_ms=0.0)


@cache
def deployment_model(model_path: str) -> ModelSpec:
    """The model of a row, from the Hugging Face config AIConfigurator ships for it (model_configs/); InputError
    when meshplan cannot express it (an unsupported model_type) or no config ships."""
    name = CONFIG_OF.get(model_path, model_path.replace("/", "--"))
    path = aic_package().joinpath("model_configs", f"{name}_config.json")
    if not path.is_file():
        raise InputError(f"{PACKAGE} ships no config for {model_path}")
    with resources.as_file(path) as local:
        model = load_model_file(local)
    return model.model_copy(update={"name": model_path})


def deployment_workload(d: Deployment) -> ServeWorkload:
    """Fixed lengths; KV cache FP8 with FP8 or FP4 weights, else BF16 (AIConfigurator's default, module docstring)."""
    weights = WEIGHTS.get(d.precision)
    if weights is None:
        raise InputError(f"{d.precision} weights: meshplan's serving model has no such dtype")
    return ServeWorkload(isl=d.isl, osl=d.osl, weight_dtype=weights,
                         kv_dtype="fp8" if weights in ("fp8", "fp4") else "bf16")


def cluster_of(gpu: str, gpus: int, spec: GPUSpec | None = None) -> Cluster:
    """A cluster of whole nodes holding `gpus`, and the engine's `gpus` of it (on `spec`, a calibrated copy of the
    GPU's spec, where given)."""
    per_node = Cluster(ClusterSpec(gpu=gpu, num_gpus=1), gpu=spec).gpus_per_node
    whole = Cluster(ClusterSpec(gpu=gpu, num_gpus=max(1, math.ceil(gpus / per_node)) * per_node), gpu=spec)
    return engine_cluster(whole, gpus)


def price(d: Deployment, eff: Efficiency | None = None, from_idle: bool = True,
          engine: EngineParameters | None = None) -> Priced:
    """meshplan's TTFT, TPOT and throughput for a measured deployment; InputError saying why it cannot be priced: a
    model meshplan cannot express, a layout it refuses, missing worker counts, a batch that does not fit, a prefill
    pool that cannot keep up. Every deployment is run from idle as the rows were measured (`from_idle`: benchmarked,
    and the disaggregated ones serving_sim.simulate_disaggregated); with `from_idle` False, in steady state. With
    `engine` (a calibration's parameters; it replaces `eff`) the iterations are timed under them and its request
    time adds to TTFT."""
    spec = None
    if engine is not None:
        spec, eff = engine.apply(load_gpu(d.gpu), d.engine)
    model = deployment_model(d.model_path)
    wl = deployment_workload(d)
    for pool in (d.pool, d.prefill):
        if pool is not None:
            pool.check(model)
    if d.prefill is not None:
        ttft, tpot = _disaggregated(d, model, wl, eff, spec, from_idle)
    elif from_idle:
        ttft, tpot = benchmarked(d, model, wl, eff, spec)
    else:
        lay = d.pool.layout
        point = concurrency_point(model, cluster_of(d.gpu, lay.gpus, spec), lay, wl, d.users, token_budget(d), None,
                                  eff)
        if point is None:
            raise InputError(f"{d.users} users do not fit {lay.label()} (no batch fits, or prefill cannot keep up)")
        ttft, tpot = point.ttft_s, point.tpot_s
    return Priced(ttft * 1e3, tpot * 1e3, little_throughput(d.users, d.osl, ttft, tpot, d.gpus))


def token_budget(d: Deployment) -> int:
    """The aggregated engine's tokens per iteration over all its attention-DP ranks (BUDGET_MARGIN's rules), the
    chunk the serving model takes. SGLang's cap counts prompt tokens only, so the rank's batch is added as the others'
    decode tokens are: the same prompt tokens beside a full decode batch (an unmixed prefill iteration may take that
    many more)."""
    lay = d.pool.layout
    per_rank = (d.pool.batch or math.ceil(d.users / lay.dp)) + d.isl + BUDGET_MARGIN
    if d.engine == "trtllm":
        per_rank = math.ceil(per_rank / TRTLLM_BLOCK) * TRTLLM_BLOCK
    return lay.dp * per_rank


def curve_batches(users: int) -> list[int]:
    """The running sequences an engine's iterations are timed at for a run of `users`: 1, 2, 3, 4, 6, 8, 12, ...
    (powers of two and 1.5 times them) below it, and `users` itself; the simulation interpolates between them."""
    grid = {b for k in range(0, 24) for b in (2 ** k, 3 * 2 ** k // 2) if b < users}
    return sorted(grid | {users})


def benchmarked(d: Deployment, model: ModelSpec, wl: ServeWorkload, eff: Efficiency | None,
                spec: GPUSpec | None = None) -> tuple[float, float]:
    """(TTFT, TPOT) of the row's closed loop as its client ran it: AIConfigurator's benchmark template runs aiperf
    with a warm-up it drains, then all users' first requests together, ROUNDS x users requests in all
    (serving_sim.simulate_benchmark; benchmarks/serving_reference.yaml cites the template), at the token budget its
    rules set (token_budget). The engine holds the largest batch up to the users that fits; the rest wait. An
    attention-DP engine of dp groups is run as one group with its 1 / dp of the users (serving_sim.group_view: the
    groups take the users in turn and step together)."""
    lay = d.pool.layout
    cluster, curve, chunk = cluster_of(d.gpu, lay.gpus, spec), [], token_budget(d)
    users = max(1, math.ceil(d.users / lay.dp))  # the busiest group's
    for b in curve_batches(users):
        state = aggregated_state(model, cluster, lay, wl, b * lay.dp, chunk, eff)
        if state is None:
            break
        curve.append(state)
    if not curve:
        raise InputError(f"no batch of {lay.label()} fits (or its prefill cannot keep pace)")
    run = simulate_benchmark(group_view(curve) if lay.dp > 1 else curve, wl, users, ROUNDS,
                             mixed=d.engine not in UNMIXED_ENGINES)
    return run.ttft(None), run.tpot(None)


def _disaggregated(d: Deployment, model: ModelSpec, wl: ServeWorkload, eff: Efficiency | None,
                   spec: GPUSpec | None = None, from_idle: bool = True) -> tuple[float, float]:
    """Closed-loop users over x prefill engines of one prompt per attention group and iteration and y decode
    engines: run from idle as the benchmark runs them (serving_sim.simulate_disaggregated, the decode steps timed
    at 1, 2, 3, 4, 6, ... sequences up to the users per engine), or in steady state (`from_idle` False:
    serving_load.closed_loop_ttft, as benchmarks/serving_reference.py prices them, TPOT the decode step at N / y
    sequences per engine)."""
    assert d.prefill is not None
    x, y = d.prefill.workers, d.pool.workers
    if x is None or y is None:
        raise InputError("the row gives no worker counts (prefill_num_workers, decode_num_workers)")
    pre_lay, dec_lay = d.prefill.layout, d.pool.layout
    pre = prefill_state(model, cluster_of(d.gpu, pre_lay.gpus, spec), pre_lay, wl, pre_lay.dp, eff,
                        crosses_nodes=True)
    dec_cluster = cluster_of(d.gpu, dec_lay.gpus, spec)
    dec = decode_state(model, dec_cluster, dec_lay, wl, max(dec_lay.dp, round(d.users / y)), eff)
    if pre is None or dec is None:
        raise InputError(f"a prompt or {round(d.users / y)} sequences do not fit the prefill or decode engine")
    if from_idle:
        per_group = max(1, math.ceil(d.users / y / dec_lay.dp))
        curve = [st for b in curve_batches(per_group)
                 for st in [decode_state(model, dec_cluster, dec_lay, wl, b * dec_lay.dp, eff)] if st is not None]
        run = simulate_disaggregated(pre, x, curve, y, wl, d.users, ROUNDS)
        return run.ttft(None), run.tpot(None)
    ttft = closed_loop_ttft(pre, dec, d.users, x, wl)
    if ttft is None:
        raise InputError(f"{x} prefill engine(s) cannot keep up with {d.users} users")
    return ttft, dec.step_s


@dataclass(frozen=True)
class Outcome:
    """A deployment and meshplan's figures for it, or why there are none (the model or layout it cannot take)."""

    deployment: Deployment
    priced: Priced | None
    why: str = ""


def price_all(deployments: Iterable[Deployment], eff: Efficiency | None = None,
              from_idle: bool = True, engine: EngineParameters | None = None) -> list[Outcome]:
    """Every deployment priced (price) or, where it cannot be, kept with the reason: none is dropped."""
    out = []
    for d in deployments:
        try:
            out.append(Outcome(d, price(d, eff, from_idle, engine)))
        except InputError as exc:
            out.append(Outcome(d, None, str(exc)))
    return out


def models_named(deployments: Iterable[Deployment]) -> dict[str, str]:
    """Each model_path, and why meshplan cannot express it ("" where it can)."""
    out = {}
    for path in sorted({d.model_path for d in deployments}):
        try:
            deployment_model(path)
            out[path] = ""
        except InputError as exc:
            out[path] = str(exc).split(": ", 1)[-1] if "unsupported model_type" in str(exc) else str(exc)
    return out
