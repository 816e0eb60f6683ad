"""Measured steps read from the logs training frameworks print, for `meshplan calibrate --runs` (a runs file's
`log = ...` entries, planner/measured_runs.py). What a log says about its own layout is read from the log, so the
layout priced is the one that ran:

- Megatron-LM: the "arguments" block that
  `megatron/training/arguments.py` `_print_args` prints at start-up (`  name ........ value`, one per line), and the
  iteration lines of `megatron/training/training.py` `training_log` (`iteration N/ M | ... | elapsed time per
  iteration (ms): T | ... | global batch size: B |`); peak memory from `report_memory` (utils.py:
  `[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: X | ...`). Formats as of
  NVIDIA/Megatron-LM d98e8a6 (2026-08); the same fields are in core_r0.8.0 (2024).
- torchtitan: the job's TOML beside its log (read as `meshplan import` reads it), the step lines of
  `torchtitan/components/metrics.py` (`step: N loss: ... memory: X GiB(p%) tps: T ...`, with ANSI colours; `wps:`
  before 4d182a1 of 2024-11-25), the mesh line of `distributed/parallel_dims.py` (`Building device mesh with
  parallelism: pp=.., dp_replicate=.., dp_shard=.., cp=.., tp=..` in 0.2, `Building N-D device mesh with [names],
  [degrees]` before), and train.py's `Trainer is initialized with local batch size L, global batch size G, ...`
  (`Training starts at step 1, with local batch size L, ...` before 2025-03). Formats as of pytorch/torchtitan v0.2.2
  (73a0e69, 2026-02) and 37c4b81 (2025-02).

Not read yet: NeMo 2 and Megatron-Bridge, which print Megatron's iteration lines but their configuration as a
recipe (YAML), not as an arguments block.

A step time is the median over the logged intervals after the first `skip` (default 1: the first interval holds
start-up, compilation and warm-up), never a mean, so one stalled interval (a checkpoint save) does not move it.
"""

from __future__ import annotations

import ast
import re
import statistics
from dataclasses import dataclass

from meshplan.costmodels.fit import MemoryKind
from meshplan.costmodels.memory import GIB
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers.megatron import LaunchSpec, parse_megatron_args, parser_names
from meshplan.planner.launchers.torchtitan import parse_torchtitan_toml



@dataclass(frozen=True)
class LoggedRun:
    """What a log measured, beside the launch it describes."""

    launch: LaunchSpec
    num_gpus: int
    step_times_s: tuple[float, ...]  # one per logged interval kept (after the warm-up ones)
    peak_memory_gib: float | None  # the largest peak any rank printed, or None where the log prints none
    memory_kind: MemoryKind  # what the peak counts: "allocated" (Megatron), "reserved" (torchtitan: the cache too)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)


# --- Megatron-LM ---

_ARG_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*) \.* ?(.*?)\s*$")  # dots: 48 - len(name), none past 48
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                        r"(?:.*?global batch size:\s+(\d+) \|)?")
_MEMORY = re.compile(r"memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)")
# argument names whose flag differs from them (megatron/training/arguments.py: --disable-bias-linear stores False
# in add_bias_linear, --fp8-format stores in fp8)
_RENAMED = {"fp8": "fp8_format"}


def megatron_arguments(text: str, origin: str) -> dict[str, str]:
    """The arguments block as name -> printed value (the last block, where a log holds restarts)."""
    lines = text.splitlines()
    starts = [n for n, line in enumerate(lines) if re.search(r"-{8,} arguments -{8,}", line)]
    if not starts:
        raise InputError(f"{origin}: no Megatron arguments block (the '---- arguments ----' lines Megatron prints at "
                         f"start-up); keep the whole stdout of rank 0")
    found: dict[str, str] = {}
    for line in lines[starts[-1] + 1:]:
        if re.search(r"-{8,} end of arguments -{8,}", line):
            return found
        match = _ARG_LINE.match(line)
        if match:
            found[match.group(1)] = match.group(2)
    raise InputError(f"{origin}: the arguments block has no '---- end of arguments ----' line; the log is cut")


def _argument_tokens(args: dict[str, str], switches: frozenset[str], known: frozenset[str]) -> list[str]:
    """The printed arguments as the command-line flags that give them (what parse_megatron_args reads)."""
    tokens: list[str] = []
    if args.get("bf16") == "True" and args.get("accumulate_allreduce_grads_in_fp32") == "False":
        tokens.append("--grad-reduce-in-bf16")  # what validate_args leaves when gradients stay bf16
    if args.get("add_bias_linear") == "False":
        tokens.append("--disable-bias-linear")
    if args.get("vocab_size") in (None, "None") and "padded_vocab_size" in args:
        args = args | {"vocab_size": args["padded_vocab_size"]}  # the tokenizer's, padded: the embedding trained
    vpp = args.get("virtual_pipeline_model_parallel_size", "None")
    if vpp != "None" and all(args.get(k, "None") == "None" for k in ("num_layers_per_virtual_pipeline_stage",
                                                                      "num_virtual_stages_per_pipeline_rank")):
        args = args | {"num_virtual_stages_per_pipeline_rank": vpp}
    for name, value in args.items():
        name = _RENAMED.get(name, name)
        if name not in known or value in ("None", "False", "[]"):
            continue
        flag = "--" + name.replace("_", "-")
        if name in switches:
            if value == "True":
                tokens.append(flag)
        elif value.startswith("["):
            tokens += [flag, *(str(v) for v in ast.literal_eval(value))] if name == "recompute_modules" else \
                [flag, value]
        else:
            tokens += [flag, value]
    return tokens


def read_megatron_log(text: str, origin: str, skip: int = 1) -> LoggedRun:
    """A Megatron-LM rank-0 log as the launch it ran and the step times it measured."""
    args = megatron_arguments(text, origin)
    switches, known = parser_names()
    try:
        launch = parse_megatron_args(_argument_tokens(args, switches, known))
    except InputError as exc:
        raise InputError(f"{origin}: {exc}") from None
    world = args.get("world_size", "None")
    if not world.isdigit() or int(world) < 1:
        raise InputError(f"{origin}: the arguments block gives no world_size; keep the whole block")
    batch = launch.workload.global_batch
    lines = [(int(m.group(1)), float(m.group(2)) / 1e3, m.group(3)) for m in _ITERATION.finditer(text)]
    kept = [t for _, t, b in lines if b is None or int(b) == batch]  # a batch ramp-up's smaller steps are left out
    times = _after_warm_up(kept, skip, origin, "iteration lines ('elapsed time per iteration (ms)')")
    peaks = [float(m.group(1)) for m in _MEMORY.finditer(text)]
    return LoggedRun(launch, int(world), times, max(peaks) * 2**20 / GIB if peaks else None, "allocated")  # MiB


def _after_warm_up(times: list[float], skip: int, origin: str, what: str) -> tuple[float, ...]:
    if skip < 0:
        raise InputError(f"{origin}: skip {skip}: give the logged intervals to leave out as warm-up (0 or more)")
    if len(times) <= skip:
        raise InputError(f"{origin}: {len(times)} {what} at the global batch the arguments give, and {skip} are "
                         f"left out as warm-up; log more steps (or lower skip)")
    return tuple(times[skip:])


# --- torchtitan ---

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(?<![a-z] )\bstep:\s*(\d+)\s.*?memory:\s*([0-9.]+)\s*GiB.*?\b[tw]ps:\s*([0-9,]+)")
_MESH_02 = re.compile(r"Building device mesh with parallelism: ((?:\w+=\d+(?:, )?)+)")
_MESH_01 = re.compile(r"Building \d+-D device mesh with \[([^\]]*)\], \[([^\]]*)\]")
# train.py: "Trainer is initialized with ..." in 0.2, "Training starts at step N, with ..." before 2025-03
_TRAINER = re.compile(r"(?:Trainer is initialized|Training starts at step \d+,) with local batch size (\d+), global "
                      r"batch size (\d+), .*?sequence length (\d+)")
_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # ep and etp are carved out of these (parallel_dims.py)


def torchtitan_world_size(text: str, origin: str) -> int:
    """The GPUs the job ran on, from its device-mesh line."""
    match = _MESH_02.search(text)
    if match:
        degrees = dict(pair.split("=") for pair in match.group(1).split(", "))
        world = 1
        for dim in _MESH_DIMS:
            world *= int(degrees.get(dim, "1"))
        return world
    match = _MESH_01.search(text)
    if match:
        world = 1
        for degree in match.group(2).split(","):
            world *= int(degree.strip())
        return world
    raise InputError(f"{origin}: no device-mesh line ('Building device mesh with parallelism: ...'); keep the log "
                     f"from the start")


def read_torchtitan_log(text: str, config_text: str, origin: str, config_origin: str,
                        skip: int = 1) -> LoggedRun:
    """A torchtitan rank-0 log and its TOML as the launch it ran and the step times it measured."""
    text = _ANSI.sub("", text)
    world = torchtitan_world_size(text, origin)
    launch, _zoo = parse_torchtitan_toml(config_text, config_origin, world_size=world)
    trainer = _TRAINER.search(text)
    if trainer:
        logged = (int(trainer.group(2)), int(trainer.group(3)))
        configured = (launch.workload.global_batch, launch.workload.seq_len)
        if logged != configured:
            raise InputError(f"{origin}: the log trained global batch {logged[0]} x sequence {logged[1]}, and "
                             f"{config_origin} gives {configured[0]} x {configured[1]}; pair the log with its own "
                             f"config")
    if launch.num_gpus != world:
        raise InputError(f"{origin}: the log ran on {world} GPUs, and {config_origin}'s degrees multiply to "
                         f"{launch.num_gpus}; pair the log with its own config")
    steps = [(float(m.group(2)), float(m.group(3).replace(",", ""))) for m in _STEP.finditer(text)]
    tokens = launch.workload.global_batch * launch.workload.seq_len
    # tps is tokens per second per GPU (metrics.py: tokens this rank saw / time / non-data-parallel size)
    times = _after_warm_up([tokens / (tps * world) for _, tps in steps if tps > 0], skip, origin,
                           "step lines ('step: N ... tps: T')")
    return LoggedRun(launch, world, times, max(gib for gib, _ in steps) if steps else None, "reserved")
