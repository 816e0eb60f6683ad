"""Fuzz campaign over the CLI: malformed files and flags, each run in-process through cli.main.main (issue 17).

Usage:  python benchmarks/fuzz.py [--cases N] [--seed S] [--timeout SECONDS] [--show K]

Every case is garbage by construction: a value of the wrong type, out of range, not finite, non-ASCII, far too
large or nested too deep, put into one field of a valid document (a Hugging Face config, a meshplan model file, a
GPU TOML, a cluster file, a plan JSON, a calibration, a torchtitan job config) or into one flag of a valid command
(plan, estimate, serve, verify, import --from megatron). The promise checked for each: exit 2 with exactly one
`error:` line on stderr, no traceback, no hang (SIGALRM after --timeout seconds), no file left in the case's output
folder. Counts per outcome and per family go to stdout (benchmarks/RESULTS.md records the last run); --show K
prints K cases of each failing outcome with their reproducer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.cli.main import main
from meshplan.cli.options import BUDGET_BOUNDS

HF_LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}  # the fields meshplan reads
HF_MOE = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
          "num_experts_per_tok": 2, "max_position_embeddings": 32768}
MODEL_FILE = json.loads((ROOT / "costmodels" / "zoo" / "llama3.1-8b.json").read_text())
GPU_TOML = (ROOT / "hardware_db" / "gpus" / "h100-sxm.toml").read_text()
CLUSTER = {"gpu": "h100-sxm", "num_gpus": 16, "gpus_per_node": 8, "nic_gbps": 400.0}
CALIBRATION = json.loads((ROOT / "hardware_db" / "calibrations" / "example-cpu.json").read_text())

# garbage for a count or a size: each is wrong for every numeric field of these documents
NUMERIC_GARBAGE = [True, False, None, "4096", "", "x", -1, 0, -0.5, 0.5, 1.5, 10**30, -(10**30), 1e308 * 10,
                   float("nan"), float("-inf"), [], {}, [1, 2], "\u0663\u0662", 2**63]
# garbage for a command-line number (as typed)
FLAG_GARBAGE = ["", "-1", "0", "0.5", "inf", "-inf", "nan", "1e400", "x", "\u0663\u0662", "1" * 5000,
                str(2**63), "1e12", "8,", "0x10", "--"]
# fields where JSON null means "absent" (the schema's default): null there is valid
OPTIONAL = {"kv_heads", "num_key_value_heads", "max_seq_len", "max_position_embeddings", "nic_gbps",
            "nvlink_gb_s", "activation_ratio", "head_dim", "gpus_per_node",
            # a model file's optional settings (costmodels/model.py: default None, the framework's own default)
            "norm_eps", "rope_theta", "dropout", "low_freq_factor", "high_freq_factor"}


@dataclass
class Case:
    family: str
    what: str
    argv: list[str]
    files: dict[str, str | bytes]
    env: dict[str, str] = field(default_factory=dict)  # environment for the case ({d}: its folder)
    dirs: tuple[str, ...] = ()  # folders made in the case's folder before it runs


def _json(doc) -> str:
    return json.dumps(doc, allow_nan=True)


def _paths(doc, prefix=()):
    """(path, value) of every scalar leaf of a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield from _paths(v, prefix + (i,))
    else:
        yield prefix, doc


def _set(doc, path, value):
    doc = json.loads(json.dumps(doc))
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _garbage_for(path: tuple, original, value) -> bool:
    """Whether `value` is wrong for the field at `path` that holds `original`: the same value is no mutation; in a
    float field any finite float is the schema's to judge, except a negative one where the field is a positive
    quantity (rates, sizes, ratios; a calibration's overheads are residuals and may be negative)."""
    if value == original and type(value) is type(original):
        return False
    if value is None and path and path[-1] in OPTIONAL:
        return False
    if isinstance(original, float) and _numeric(value) and value == value and abs(value) < 1e300:
        # a finite float in a float field: its sign and size are the schema's to judge; only where the field is a
        # positive quantity (a rate, a size, a ratio) is a negative one garbage
        return value < 0 and original > 0 and not any("overhead" in str(p) for p in path)
    return True


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def document_cases(rng: random.Random, plan_doc: dict, titan_toml: str) -> list[Case]:
    cases = []
    for family, doc, name, argv in (
            ("hf-config", HF_LLAMA, "config.json", ["models", "show", "{d}/config.json"]),
            ("hf-config-moe", HF_MOE, "config.json", ["models", "show", "{d}/config.json"]),
            ("model-file", MODEL_FILE, "m.json", ["models", "show", "{d}/m.json"]),
            ("cluster-file", CLUSTER, "c.json", ["estimate", "--model", "llama3.1-8b", "--cluster", "{d}/c.json"]),
            ("calibration", CALIBRATION, "cal.json", ["estimate", "--model", "llama3.1-8b", "--gpu", "cpu",
                                                      "--gpus", "1", "--gbs", "8", "--seq", "512",
                                                      "--calibration", "{d}/cal.json"]),
            ("plan-file", plan_doc, "p.json", ["export", "{d}/p.json", "--to", "megatron"])):
        leaves = [(p, v) for p, v in _paths(doc) if _numeric(v)]
        if family == "plan-file":  # the fields a launcher reads: degrees, stages, batch
            leaves = [(p, v) for p, v in leaves if p[0] in ("mesh", "pipeline", "inputs") and "gpu_spec" not in p]
        if family == "calibration":
            leaves = [(p, v) for p, v in leaves if p[0] in ("fitted", "schema_version")]
        for path, original in leaves:
            for value in NUMERIC_GARBAGE:
                if not _garbage_for(path, original, value):
                    continue
                if family == "hf-config" and value is None and path[-1] in ("num_key_value_heads",
                                                                            "max_position_embeddings",
                                                                            "rms_norm_eps", "rope_theta"):
                    continue  # null in an optional Hugging Face field means absent: valid
                if isinstance(value, bool) and path[-1] in ("tie_word_embeddings",):
                    continue
                text = _json(_set(doc, path, value))
                cases.append(Case(family, f"{'.'.join(map(str, path))} = {value!r:.30}", argv, {name: text}))
    # whole-document garbage for each reader
    blobs = {"nested": "[" * 100_000 + "]" * 100_000, "not utf-8": b"\xff\xfe\x00{", "empty": "", "array": "[]",
             "number": "1e999", "big int": "9" * 5000, "NaN": "NaN", "truncated": '{"model_type": "llama", "hid'}
    for family, name, argv in (("hf-config", "config.json", ["models", "show", "{d}/config.json"]),
                               ("cluster-file", "c.json", ["estimate", "--model", "llama3.1-8b", "--cluster",
                                                           "{d}/c.json"]),
                               ("plan-file", "p.json", ["show", "{d}/p.json"]),
                               ("calibration", "cal.json", ["estimate", "--model", "llama3.1-8b", "--gpu", "cpu",
                                                            "--gpus", "1", "--calibration", "{d}/cal.json"])):
        for what, blob in blobs.items():
            cases.append(Case(family, f"whole file: {what}", argv, {name: blob}))
    # GPU TOML: every `value = X` and every efficiency field
    lines = GPU_TOML.splitlines()
    numeric_lines = [i for i, line in enumerate(lines) if re.match(r"^\s*[a-z_0-9]+\s*=\s*[-0-9.e+]+\s*$", line)]
    toml_garbage = ["inf", "nan", "-inf", "0", "-1", "true", '"8"', "1" * 400, "[1, 2]", "{}", "0.5e-400"]
    for i in numeric_lines:
        key = lines[i].split("=")[0].strip()
        for g in toml_garbage:
            if key == "gemm_k_half" and g == "0":
                continue  # 0 means "no ramp": valid
            if key in ("gemm_k_half", "fp8_gemm_k_half", "attention_causal_s0", "kernel_overhead_us") and g in (
                    "0", "0.5e-400"):
                continue
            mutated = lines[:i] + [f"{key} = {g}"] + lines[i + 1:]
            cases.append(Case("gpu-toml", f"line {i + 1}: {key} = {g[:20]}",
                              ["estimate", "--model", "llama3.1-8b", "--gpu", "{d}/g.toml", "--gpus", "8"],
                              {"g.toml": "\n".join(mutated) + "\n"}))
    cases += torchtitan_cases(titan_toml)
    rng.shuffle(cases)
    return cases


# TOML garbage for one `key = value` line of a torchtitan job config
TITAN_GARBAGE = ["inf", "nan", "-inf", "0", "-1", "-2", "true", '"8"', "1.5", "1" * 400, "[1, 2]", "{}", '"x"', '""',
                 "[]", '"\u0663"', "[[1]]", '[["layers.x"]]']


def torchtitan_cases(text: str) -> list[Case]:
    """Every `key = value` line of a valid torchtitan TOML (meshplan's own export) set to each garbage value, and the
    whole file replaced by garbage, read by `import --from torchtitan`."""
    argv = ["import", "--from", "torchtitan", "{d}/t.toml", "--gpu", "h100-sxm", "--out", "{d}/o.json"]
    lines, cases = text.splitlines(), []
    for i, line in enumerate(lines):
        found = re.match(r"^([a-z_0-9]+) = (.*)$", line)
        if not found:
            continue
        key, value = found.groups()
        for g in TITAN_GARBAGE:
            if g == value or (key == "global_batch_size" and g == "-1"):  # -1: local x DP (valid)
                continue
            mutated = lines[:i] + [f"{key} = {g}"] + lines[i + 1:]
            cases.append(Case("torchtitan-toml", f"{key} = {g[:20]}", argv, {"t.toml": "\n".join(mutated) + "\n"}))
    for what, blob in {"nested": "a = " + "[" * 100_000 + "]" * 100_000, "not utf-8": b"\xff\xfe[model]",
                       "empty": "", "not toml": "{}", "section as value": 'model = 3\n',
                       "parallelism as array": "[[parallelism]]\ntensor_parallel_degree = 2\n"}.items():
        cases.append(Case("torchtitan-toml", f"whole file: {what}", argv, {"t.toml": blob}))
    return cases


def flag_cases() -> list[Case]:
    base = {
        "plan": ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048",
                 "--max-mbs", "2", "--out", "{d}/out.json"],
        "estimate": ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16",
                     "--seq", "2048"],
        "serve": ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl",
                  "100", "--out", "{d}/out.json"],
    }
    flags = {
        "plan": ["--gpus", "--gbs", "--seq", "--tp", "--pp", "--vpp", "--dp", "--cp", "--mbs", "--zero", "--max-mbs",
                 "--top", "--time-limit", "--nic-gbps", "--nvlink-gbs", "--gpus-per-node"],
        "estimate": ["--gpus", "--gbs", "--seq", "--tp", "--pp", "--vpp", "--cp", "--mbs", "--zero", "--nic-gbps",
                     "--gpus-per-node"],
        "serve": ["--isl", "--osl", "--ttft-ms", "--tpot-ms", "--top", "--time-limit", "--nic-gbps"],
    }
    cases = []
    for command, argv in base.items():
        for flag in flags[command]:
            for g in FLAG_GARBAGE:
                if flag == "--time-limit" and g in ("inf", "1e400", "1e12", str(2**63), "1" * 5000):
                    continue  # no limit: valid
                if flag in ("--ttft-ms", "--tpot-ms") and g == "inf":
                    continue  # no target: valid
                if flag == "--zero" and g == "0":
                    continue
                if flag in ("--time-limit", "--ttft-ms", "--tpot-ms", "--nic-gbps", "--nvlink-gbs") and g == "0.5":
                    continue  # a fractional limit, target or bandwidth is valid
                args = list(argv)
                if flag in args:
                    i = args.index(flag)
                    args[i + 1] = g
                else:
                    args += [flag, g]
                cases.append(Case(f"flags-{command}", f"{flag} {g[:20]!r}", args, {}))
    megatron = "--num-layers 32 --seq-length 2048 --global-batch-size 16 --tensor-model-parallel-size 2"
    for flag in ("--num-layers", "--seq-length", "--global-batch-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--micro-batch-size", "--context-parallel-size"):
        for g in ["-1", "0", "x", "\u0663", "1" * 400, "1.5", "inf"]:
            args = re.sub(rf"{flag} \S+", f"{flag} {g}", megatron) if flag in megatron else f"{megatron} {flag} {g}"
            cases.append(Case("import-megatron", f"{flag} {g[:20]}",
                              ["import", "--from", "megatron", "--model", "llama3.1-8b", "--gpus", "8", "--gpu",
                               "h100-sxm", "--", args], {}))
    for layout in ["(t*99999)*99999", "E|t*99999999999|L", "Et|X|L", "E||L", "t*4"]:
        cases.append(Case("import-megatron", f"layout {layout}",
                          ["import", "--from", "megatron", "--model", "llama3.1-8b", "--gpus", "8", "--gpu",
                           "h100-sxm", "--", f"{megatron} --pipeline-model-parallel-size 2 "
                                             f"--pipeline-model-parallel-layout {layout}"], {}))
    return cases


# ---- the surfaces added since the first campaign (issue 43) ------------------------------------------------------

ESTIMATE = ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048"]


def economics_cases() -> list[Case]:
    """Each budget flag set to garbage, on estimate and plan (with --tokens so that the run's time is priced): a
    value in the flag's range is valid and skipped."""
    cases = []
    for flag, (low, high) in BUDGET_BOUNDS.items():
        for g in FLAG_GARBAGE:
            try:
                value = float(g)
            except ValueError:
                value = math.nan
            if math.isfinite(value) and low <= value <= high:
                continue
            for command in ("estimate", "plan"):
                argv = [command, *ESTIMATE[1:], *(["--max-mbs", "2"] if command == "plan" else [])]
                if flag != "--tokens":
                    argv += ["--tokens", "15e12"]
                cases.append(Case("flags-economics", f"{command} {flag} {g[:20]!r}", [*argv, flag, g], {}))
    return cases


def _leaves(doc, prefix=()):
    """(path, value) of every scalar leaf, lists whole (not the first three as _paths)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, prefix + (i,))
    else:
        yield prefix, doc


def plan_edit_cases(plan_doc: dict) -> list[Case]:
    """Every figure a plan derives (prediction, memory, economics) edited to a plausible wrong value (x1.5, x0.5)
    or to garbage, read by show, export and compare in turn: a plan this meshplan made reproduces its figures on
    read, so each edit is refused in one line. The search's account is not re-derived and is left out."""
    cases, commands = [], (["show", "{d}/p.json"], ["export", "{d}/p.json", "--to", "megatron"],
                           ["compare", "{d}/p.json", "{d}/q.json"])
    valid = json.dumps(plan_doc)
    n = 0
    for path, original in _leaves(plan_doc):
        if path[0] not in ("prediction", "memory", "economics") or not _numeric(original) or "layout" in path:
            continue
        for value in (original * 1.5, original * 0.5, -1, 0, 1e300, None, "x", True):
            if _numeric(value) and abs(value - original) <= 1e-12:  # the same number, or a difference of rounding
                continue
            argv = commands[n % len(commands)]
            n += 1
            cases.append(Case("plan-edit", f"{argv[0]} {'.'.join(map(str, path))} = {value!r:.24}", argv,
                              {"p.json": _json(_set(plan_doc, path, value)), "q.json": valid}))
    return cases


def compare_cases(plan_doc: dict) -> list[Case]:
    """compare's own inputs: a serving plan, one plan, the same file twice, a plan of another model's figures."""
    train, serve = json.dumps(plan_doc), json.dumps(_serving_plan())
    zero = _json(_set(plan_doc, ("prediction", "tokens_per_s"), 0))
    return [Case("compare", "a serving plan", ["compare", "{d}/p.json", "{d}/s.json"], {"p.json": train,
                                                                                     "s.json": serve}),
            Case("compare", "one plan", ["compare", "{d}/p.json"], {"p.json": train}),
            Case("compare", "tokens_per_s 0", ["compare", "{d}/p.json", "{d}/z.json"], {"p.json": train,
                                                                                         "z.json": zero}),
            Case("compare", "not a plan", ["compare", "{d}/p.json", "{d}/x.json"], {"p.json": train, "x.json": "[]"}),
            Case("compare", "--price-per-gpu-hour -1", ["compare", "{d}/p.json", "{d}/p.json",
                                                        "--price-per-gpu-hour", "-1"], {"p.json": train})]


def hf_cache_cases() -> list[Case]:
    """An HF id resolved through a damaged cache: refs/main binary, a path, empty; a snapshot's config.json
    garbage; the cache folder under a home directory that does not exist."""
    ref = "{d}/hub/models--owner--name/refs/main"
    snap = "{d}/hub/models--owner--name/snapshots/abc"
    cases = []
    for what, blob in {"binary ref": b"\xff\xfe\x00", "a path as ref": "../../../etc", "empty ref": "",
                       "ref naming no snapshot": "0" * 40}.items():
        cases.append(Case("hf-cache", what, ["models", "show", "owner/name"], {ref: blob},
                          {"HF_HUB_CACHE": "{d}/hub"}))
    for what, blob in {"config not JSON": "{", "config an array": "[]", "config without model_type": "{}",
                       "config binary": b"\xff\xfe"}.items():
        cases.append(Case("hf-cache", what, ["models", "show", "owner/name"],
                          {ref: "abc", f"{snap}/config.json": blob}, {"HF_HUB_CACHE": "{d}/hub"}))
    for env in ({"HF_HUB_CACHE": "~nouser-meshplan-fuzz/hub"}, {"HF_HOME": "~nouser-meshplan-fuzz"},
                {"HF_HUB_CACHE": "{d}/missing"}):
        cases.append(Case("hf-cache", f"cache {env}", ["models", "show", "owner/name"], {}, env))
    return cases


SERVE = ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "100"]
SWEEP = ["sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048"]
PLAN_Z3 = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048",
           "--zero", "3", "--max-mbs", "2"]


def collision_cases(plan_text: str) -> list[Case]:
    """Outputs that collide: a flag's file that a report or export folder writes by its real name, a directory
    where a folder writes a file, a report folder that is a file, two flags on one file. Each is refused before
    any work, nothing left behind."""
    cases = []
    for name in ("serve.html", "serve-pareto.csv", "serve-pareto.png"):
        cases.append(Case("collisions", f"serve --out R/{name} --report R", [*SERVE, "--report", "{d}/R", "--out",
                                                                            f"{{d}}/R/{name}"], {}, dirs=("R",)))
        cases.append(Case("collisions", f"serve --report R with R/{name} a directory", [*SERVE, "--report", "{d}/R"],
                          {}, dirs=("R", f"R/{name}")))
    for name in ("torchtitan.toml", "torchtitan_config.py"):
        cases.append(Case("collisions", f"plan --out D/{name} --export-out D",
                          [*PLAN_Z3, "--export", "torchtitan", "--export-out", "{d}/D", "--out", f"{{d}}/D/{name}"],
                          {}, dirs=("D",)))
        cases.append(Case("collisions", f"plan --trace D/{name} --export-out D",
                          [*PLAN_Z3, "--export", "torchtitan", "--export-out", "{d}/D", "--trace", f"{{d}}/D/{name}"],
                          {}, dirs=("D",)))
        cases.append(Case("collisions", f"export into D with D/{name} a directory",
                          ["export", "{d}/p.json", "--to", "torchtitan", "--out", "{d}/D"], {"p.json": plan_text},
                          dirs=("D", f"D/{name}")))
    for name in ("sweep.csv", "sweep.html", "sweep-scaling.png"):
        cases.append(Case("collisions", f"sweep --out S with S/{name} a directory", [*SWEEP, "--out", "{d}/S"], {},
                          dirs=("S", f"S/{name}")))
    cases.append(Case("collisions", "serve --out F --report F", [*SERVE, "--out", "{d}/F", "--report", "{d}/F"], {}))
    cases.append(Case("collisions", "sweep --out a file", [*SWEEP, "--out", "{d}/f.txt"], {"f.txt": "x"}))
    cases.append(Case("collisions", "vllm export D/node-0.sh as --out", [*SERVE, "--export", "vllm", "--export-out",
                                                                          "{d}/V", "--out", "{d}/V/node-0.sh"],
                      {}, dirs=("V",)))
    return cases


def verify_flag_cases(plan_text: str) -> list[Case]:
    """verify's flags set to garbage: each is refused before any rank starts (a valid value would run the plan)."""
    cases = []
    for flag in ("--steps", "--seq", "--microbatches", "--timeout", "--max-ranks", "--scale", "--dtype", "--backend",
                 "--launcher", "--calibration"):
        for g in FLAG_GARBAGE:
            cases.append(Case("flags-verify", f"{flag} {g[:20]!r}", ["verify", "{d}/p.json", flag, g,
                                                                      "--out", "{d}/r.json"], {"p.json": plan_text}))
    return cases


class _Hang(Exception):
    pass


def run_case(case: Case, timeout: float) -> tuple[str, str]:
    """(outcome, stderr) of one case in a fresh folder (its files, folders and environment set up first)."""
    d = Path(tempfile.mkdtemp(prefix="fuzz-"))
    saved = {k: os.environ.get(k) for k in case.env}
    try:
        for name in case.dirs:
            (d / name).mkdir(parents=True, exist_ok=True)
        for name, text in case.files.items():
            path = d / name.replace("{d}/", "")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        for k, v in case.env.items():
            os.environ[k] = v.replace("{d}", str(d))
        before = set(d.rglob("*"))
        argv = [a.replace("{d}", str(d)) for a in case.argv]
        out, err = io.StringIO(), io.StringIO()

        def expired(signum, frame):
            raise _Hang()

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except _Hang:
            return "hang", ""
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - an exception out of main() is the traceback a user sees
            return "traceback", f"{type(exc).__name__}: {exc}"[:300]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        text = err.getvalue()
        left = set(d.rglob("*")) - before
        if "Traceback" in text or "Traceback" in out.getvalue():
            return "traceback", text[-300:]
        if code == 0:
            return "accepted (exit 0)", ""
        if left:
            return "file left behind", ", ".join(p.name for p in left)
        lines = [x for x in text.strip().splitlines() if not x.startswith("progress: ")]  # a long step's, piped
        if code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
            return "one error line, exit 2", lines[0]
        return f"exit {code}, {len(lines)} stderr lines", text[-300:]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(d, ignore_errors=True)


def valid_documents() -> tuple[dict, str, str]:
    """(a Mixtral plan, a small Llama plan for verify, its torchtitan TOML export), written by meshplan itself."""
    d = Path(tempfile.mkdtemp(prefix="fuzz-valid-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "4", "--gbs", "8", "--seq",
                         "2048", "--tp", "2", "--pp", "2", "--order", "tp-cp-dp-pp", "--zero", "3",
                         "--out", str(d / "v.json")]) == 0
            assert main(["export", str(d / "v.json"), "--to", "torchtitan", "--out", str(d / "titan")]) == 0
        return valid_plan(), (d / "v.json").read_text(), (d / "titan" / "torchtitan.toml").read_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _serving_plan() -> dict:
    d = Path(tempfile.mkdtemp(prefix="fuzz-serve-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main([*SERVE, "--out", str(d / "s.json")]) == 0
        return json.loads((d / "s.json").read_text())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def valid_plan() -> dict:
    d = Path(tempfile.mkdtemp(prefix="fuzz-plan-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--gbs", "64",
                         "--seq", "4096", "--pp", "2", "--tp", "2", "--ep", "8", "--out", str(d / "p.json")]) == 0
        return json.loads((d / "p.json").read_text())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def all_cases(rng: random.Random, plan_doc: dict, verify_plan: str, titan_toml: str) -> list[Case]:
    """Every family: the first campaign's (files, flags, torchtitan TOML, verify flags) and issue 43's (economics
    flags, compare, plan edits of every derived figure, the HF cache, output collisions and reports)."""
    return (document_cases(rng, plan_doc, titan_toml) + flag_cases() + verify_flag_cases(verify_plan)
            + economics_cases() + compare_cases(plan_doc) + plan_edit_cases(plan_doc) + hf_cache_cases()
            + collision_cases(verify_plan))


def main_() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=0, help="run at most this many (0: all, about 2,500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    ap.add_argument("--show", type=int, default=3, help="cases to print per failing outcome")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    plan_doc, verify_plan, titan_toml = valid_documents()
    cases = all_cases(rng, plan_doc, verify_plan, titan_toml)
    if args.cases:
        cases = rng.sample(cases, min(args.cases, len(cases)))
    outcomes: Counter = Counter()
    by_family: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, list[str]] = defaultdict(list)
    t0 = time.perf_counter()
    for case in cases:
        outcome, detail = run_case(case, args.timeout)
        outcomes[outcome] += 1
        by_family[case.family][outcome] += 1
        if outcome != "one error line, exit 2" and len(examples[outcome]) < args.show:
            examples[outcome].append(f"[{case.family}] {case.what}: {detail}")
    print(f"{len(cases):,} cases in {time.perf_counter() - t0:.0f} s (seed {args.seed})")
    for outcome, n in outcomes.most_common():
        print(f"  {n:6,}  {outcome}")
    print("by family:")
    for family in sorted(by_family):
        c = by_family[family]
        bad = sum(n for o, n in c.items() if o != "one error line, exit 2")
        print(f"  {family:18s} {sum(c.values()):6,} cases, {bad:,} not one error line")
    for outcome, lines in examples.items():
        print(f"{outcome}:")
        for line in lines:
            print(f"    {line}")
    return 0 if set(outcomes) <= {"one error line, exit 2"} else 1


if __name__ == "__main__":
    raise SystemExit(main_())
