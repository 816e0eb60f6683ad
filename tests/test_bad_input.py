"""Bad input never crashes, hangs or lies (issue 17): the reproducers of the fuzz campaign as a corpus, each run
in-process through cli.main.main, and property tests over the readers. Every case must end in exit 2 with one
`error:` line on stderr, no traceback, and no file left behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.costmodels.model_io import load_model
from meshplan.hardware_db.documents import MAX_DEPTH, parse_document
from meshplan.hardware_db.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
LLAMA_HF = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192}
GPU_TOML = (ROOT / "hardware_db" / "gpus" / "h100-sxm.toml").read_text()
EST = ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8"]
PLAN = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048"]
MEGATRON = ["import", "--from", "megatron", "--model", "llama3.1-8b", "--gpus", "8", "--gpu", "h100-sxm", "--"]
WORKLOAD = " --seq-length 2048 --global-batch-size 16"
TITAN = '[model]\nname = "llama3"\nflavor = "8B"\n'  # a torchtitan job config's model section


def hf(**changes) -> str:
    return json.dumps({**LLAMA_HF, **changes})


# (name, {file name: text}, argv with {dir} for the folder the files are in, words the error line must hold)
CASES = [
    ("nested JSON", {"d.json": "[" * 100_000 + "]" * 100_000}, ["models", "show", "{dir}/d.json"], ["nested"]),
    ("5,000-digit integer", {"big.json": '{"x": ' + "9" * 5000 + "}"}, ["models", "show", "{dir}/big.json"],
     ["digits"]),
    ("not UTF-8", {"bad.json": b"\xff\xfe{}"}, ["models", "show", "{dir}/bad.json"], ["UTF-8"]),
    ("NaN in JSON", {"n.json": hf(vocab_size="NaN").replace('"NaN"', "NaN")}, ["models", "show", "{dir}/n.json"],
     ["NaN"]),
    ("vocab 10**300", {"v.json": hf().replace("128256", "1" + "0" * 300)}, ["models", "show", "{dir}/v.json"],
     ["digits"]),
    ("bool as a width", {"t.json": hf(intermediate_size=True)}, ["models", "show", "{dir}/t.json"],
     ["intermediate_size", "True"]),
    ("string as a width", {"s.json": hf(intermediate_size="14336")}, ["models", "show", "{dir}/s.json"],
     ["intermediate_size"]),
    ("fractional width", {"f.json": hf(intermediate_size=14336.5)}, ["models", "show", "{dir}/f.json"],
     ["intermediate_size"]),
    ("width past the bound", {"w.json": hf(hidden_size=2**40)}, ["models", "show", "{dir}/w.json"],
     ["hidden_size"]),
    ("scaleup_domain = inf",
     {"g.toml": GPU_TOML.replace("[scaleup_domain]\nvalue = 8", "[scaleup_domain]\nvalue = inf")},
     [*EST[:4], "{dir}/g.toml", *EST[5:]], ["finite"]),
    ("scaleup_domain = 0.5",
     {"g.toml": GPU_TOML.replace("[scaleup_domain]\nvalue = 8", "[scaleup_domain]\nvalue = 0.5")},
     [*EST[:4], "{dir}/g.toml", *EST[5:]], ["scaleup_domain", "whole"]),
    ("hbm_gib = inf", {"g.toml": GPU_TOML.replace("[hbm_gib]\nvalue = 80", "[hbm_gib]\nvalue = inf")},
     [*EST[:4], "{dir}/g.toml", *EST[5:]], ["finite"]),
    ("gemm_half_flops = nan", {"g.toml": GPU_TOML.replace("[efficiency]\n", "[efficiency]\ngemm_half_flops = nan\n")},
     [*EST[:4], "{dir}/g.toml", *EST[5:]], ["finite"]),
    ("cluster num_gpus 8.0", {"c.toml": 'gpu = "h100-sxm"\nnum_gpus = 8.0\n'},
     ["estimate", "--model", "llama3.1-8b", "--cluster", "{dir}/c.toml"], ["num_gpus"]),
    ("--nic-gbps inf", {}, [*EST, "--nic-gbps", "inf"], ["--nic-gbps", "finite"]),
    ("--gpus 2**63", {}, ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", str(2**63)], ["--gpus"]),
    ("--gbs 1e12 as an integer", {}, [*EST, "--gbs", str(10**12)], ["--gbs"]),
    ("--top 1e9", {}, [*PLAN, "--top", str(10**9)], ["--top"]),
    ("--out ''", {}, [*PLAN, "--out", ""], ["--out", "empty"]),
    ("--trace ''", {}, [*PLAN, "--trace", ""], ["--trace", "empty"]),
    ("--trace to a missing folder", {}, [*PLAN, "--out", "{dir}/p.json", "--trace", "{dir}/no/t.json"],
     ["--trace", "does not exist"]),
    ("serve --layout with a superscript", {},
     ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "100",
      "--layout", "tp\u00b2"], ["engine layout"]),
    ("--schedule interleaved with --pp 1", {}, [*EST, "--pp", "1", "--schedule", "interleaved"], ["--pp > 1"]),
    ("plan --schedule interleaved with --pp 1", {}, [*PLAN, "--pp", "1", "--schedule", "interleaved"], ["--pp > 1"]),
    ("import tp 0", {}, [*MEGATRON, "--tensor-model-parallel-size 0 --num-layers 32" + WORKLOAD],
     ["--tensor-model-parallel-size 0"]),
    ("import a word for a number", {}, [*MEGATRON, "--num-layers x" + WORKLOAD], ["--num-layers", "whole number"]),
    ("import Arabic-Indic digits", {}, [*MEGATRON, "--num-layers \u0663\u0662" + WORKLOAD], ["whole number"]),
    ("import a 400-digit number", {}, [*MEGATRON, "--num-layers " + "1" * 400 + WORKLOAD], ["whole number"]),
    ("import a flag without its value", {}, [*MEGATRON, "--num-layers"], ["expected one argument"]),
    ("import a layout that expands to 10**10", {},
     [*MEGATRON, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout (t*99999)*99999" + WORKLOAD],
     ["expands"]),
    ("import a MoE frequency of 10**12 layers", {},
     ["import", "--from", "megatron", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100-sxm", "--",
      "--num-experts 8 --moe-layer-freq [1]*1000000000000" + WORKLOAD], ["more layers"]),
    ("a pipeline of 16.8M passes to simulate", {},
     ["estimate", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "131072", "--seq", "256",
      "--pp", "64", "--mbs", "1"], ["16,777,216 pipeline passes", "at most 262,144", "--mbs"]),
    ("plan pinned to 16.8M pipeline passes", {},
     ["plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "131072", "--seq", "256",
      "--pp", "64", "--mbs", "1"], ["pipeline passes per step"]),
    ("a model of 2,000 layers", {"m.json": hf(num_hidden_layers=2000)}, ["models", "show", "{dir}/m.json"],
     ["1024"]),
    ("torchtitan: a degree of true", {"t.toml": '[parallelism]\ndata_parallel_shard_degree = 8\n'
                                                'tensor_parallel_degree = true\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["tensor_parallel_degree"]),
    ("torchtitan: a degree of 1.5", {"t.toml": TITAN + '[parallelism]\ndata_parallel_shard_degree = 1.5\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["data_parallel_shard_degree"]),
    ("torchtitan: a batch as a string", {"t.toml": TITAN + '[training]\nlocal_batch_size = "8"\n[parallelism]\n'
                                                   'data_parallel_shard_degree = 8\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["local_batch_size"]),
    ("torchtitan: a stage of a non-layer", {"t.toml": '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n'
                                                      'data_parallel_shard_degree = 4\npipeline_parallel_degree = 2\n'
                                                      'module_fqns_per_model_part = [["layers.x"], ["layers.y"]]\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["layers.0"]),
    ("torchtitan: float32 parameters",
     {"t.toml": TITAN + '[training]\nmixed_precision_param = "float32"\n'
                '[parallelism]\ndata_parallel_shard_degree = 8\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["float32", "bfloat16"]),
    ("torchtitan: a section as a number", {"t.toml": 'parallelism = 3\n'},
     ["import", "--from", "torchtitan", "{dir}/t.toml", "--gpu", "h100-sxm"], ["parallelism"]),
    ("torchrun with a non-ASCII process count", {},
     [*MEGATRON, "torchrun --nproc-per-node \u0668 pretrain_gpt.py --num-layers 32" + WORKLOAD],
     ["--nproc-per-node"]),
    # ---- issue 43's reproducers: the surfaces added since the first campaign
    ("hardware show of a non-UTF-8 TOML", {"g.toml": b"\xff\xfe"}, ["hardware", "show", "{dir}/g.toml"],
     ["UTF-8"]),
    ("a 5,000-digit TOML integer in a model file", {"m.toml": "layers = " + "9" * 5000 + "\n"},
     ["models", "show", "{dir}/m.toml"], ["digits"]),
    ("--ckpt-gbps inf", {}, [*EST, "--gbs", "16", "--tokens", "15e12", "--ckpt-gbps", "inf"],
     ["--ckpt-gbps", "finite"]),
    ("--tokens inf", {}, [*EST, "--gbs", "16", "--tokens", "inf"], ["--tokens", "finite"]),
    ("--restart-min inf", {}, [*EST, "--gbs", "16", "--tokens", "15e12", "--restart-min", "inf"],
     ["--restart-min", "finite"]),
    ("--price-per-gpu-hour 1e300", {}, [*EST, "--price-per-gpu-hour", "1e300"], ["--price-per-gpu-hour"]),
    ("serve --price-per-gpu-hour inf", {},
     ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "100",
      "--price-per-gpu-hour", "inf"], ["--price-per-gpu-hour", "finite"]),
    ("failures that never let the run finish", {},
     [*EST, "--gbs", "16", "--tokens", "1e18", "--failure-rate", "1", "--restart-min", "10000"], ["never finishes"]),
    ("torchrun --nnodes 0", {}, [*MEGATRON, "torchrun --nnodes 0 --nproc-per-node 8 pretrain_gpt.py --num-layers 32"
                                 + WORKLOAD], ["--nnodes 0"]),
    ("--recompute-num-layers past the layers per rank", {},
     [*MEGATRON, "--num-layers 32 --recompute-granularity full --recompute-method uniform --recompute-num-layers 99"
      + WORKLOAD], ["--recompute-num-layers 99", "32"]),
    ("--recompute-granularity full without a method", {},
     [*MEGATRON, "--num-layers 32 --recompute-granularity full" + WORKLOAD], ["--recompute-method"]),
    ("serve --isl past the model's context", {},
     ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000000", "--osl", "100"],
     ["131,072", "--beyond-context"]),
    ("plan --seq past the model's context", {}, [*PLAN[:-1], "4096", "--model", "gpt3-175b"], ["2,048"]),
    ("sweep --gpus up to 2**62", {},
     ["sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "1..4611686018427387904", "--gbs", "16",
      "--seq", "2048"], ["--gpus", "at most 262,144"]),
]


@pytest.mark.parametrize("name,files,argv,words", CASES, ids=[c[0] for c in CASES])
def test_the_corpus_ends_in_one_error_line(capsys, tmp_path, name, files, argv, words):
    for fname, text in files.items():
        (tmp_path / fname).write_bytes(text if isinstance(text, bytes) else text.encode())
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert_input_error(*run(capsys, *args), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary file left


def test_verify_under_the_torchrun_launcher_outside_torchrun_is_one_line(capsys, tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    plan = tmp_path / "p.json"
    assert run(capsys, *PLAN, "--out", str(plan))[0] == 0
    assert_input_error(*run(capsys, "verify", str(plan), "--launcher", "torchrun"), "torchrun", "--launcher spawn")


@pytest.mark.parametrize("flag,value,words", [("--steps", str(10**9), ["--steps", "1000"]),
                                              ("--seq", str(2**63), ["--seq", "16777216"]),
                                              ("--microbatches", str(2**63), ["--microbatches"]),
                                              ("--timeout", "inf", ["--timeout"]),
                                              ("--calibration", "", ["calibration"])])
def test_verify_flags_past_their_bounds_are_refused_before_any_run(capsys, tmp_path, flag, value, words):
    """verify's numbers are bounded (a billion steps drew a billion batches up front, --seq 2**63 crashed in torch)
    and an empty --calibration is a missing file, not "no calibration" (the run then started)."""
    plan = tmp_path / "p.json"
    assert run(capsys, *PLAN, "--out", str(plan))[0] == 0
    assert_input_error(*run(capsys, "verify", str(plan), flag, value, "--out", str(tmp_path / "r.json")), *words)
    assert not (tmp_path / "r.json").exists()


def test_the_verify_memory_floor_counts_the_batch_a_step_runs():
    """--seq 16,777,216 on a tiny model: its weights fit anywhere, its activations (each layer's input for the whole
    batch) do not: the floor grows with the tokens a step runs and with the steps whose batches are drawn."""
    from meshplan.executor.verify import verify_memory_bytes
    spec = load_model("llama3.1-8b")
    base = verify_memory_bytes(spec, 4, 8)
    assert verify_memory_bytes(spec, 4, 8, tokens=8 * 2**24) >= base + 8 * 2**24 * spec.hidden * spec.num_layers * 8
    assert verify_memory_bytes(spec, 4, 8, tokens=1000, steps=10) > verify_memory_bytes(spec, 4, 8, tokens=1000)


# ---- properties of the one reader ----------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(LLAMA_HF)), value=JSON_SCALARS)
def test_any_value_in_any_field_loads_exactly_or_is_one_input_error(tmp_path_factory, key, value):
    """Every field of a Hugging Face config given any JSON scalar: the model loads, and then the field was an
    integer in range (or the string model_type it must be), or one InputError line; never another exception and
    never a coerced value (true as 1, 4096.0 or "4096" as 4096)."""
    path = tmp_path_factory.mktemp("hf") / "config.json"
    text = json.dumps({**LLAMA_HF, key: value}, allow_nan=True)
    path.write_text(text)
    try:
        spec = load_model(str(path))
    except InputError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
        return
    if key == "model_type":
        assert value == "llama"
    elif value is None:  # JSON null in an optional field reads as absent, as Hugging Face reads it
        assert key in ("num_key_value_heads", "max_position_embeddings"), key
    else:
        assert type(value) is int and value > 0 and spec is not None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                    max_leaves=20), st.sampled_from(["json", "toml"]))
def test_parse_document_keeps_its_limits(doc, fmt):
    """Whatever JSON it is given, parse_document returns a document with only finite floats and integers under
    10**18, or one InputError; TOML text is tried where the document is a table."""
    text = json.dumps(doc, allow_nan=True) if fmt == "json" else _toml(doc)
    if text is None:
        return
    try:
        parsed = parse_document(text, fmt, "x")  # type: ignore[arg-type]
    except InputError as exc:
        assert str(exc).startswith("x: ") and "\n" not in str(exc)
        return
    stack = [parsed]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, list):
            stack += v
        elif isinstance(v, float):
            assert math.isfinite(v)
        elif isinstance(v, int):
            assert abs(v) < 10**18


def _toml(doc) -> str | None:
    """A flat table of scalars as TOML (enough to reach inf, nan and big integers), else None."""
    if not isinstance(doc, dict) or not all(isinstance(v, (bool, int, float)) for v in doc.values()):
        return None
    lines = []
    for k, v in doc.items():
        value = ("true" if v else "false") if isinstance(v, bool) else (
            "nan" if isinstance(v, float) and math.isnan(v) else
            ("inf" if v > 0 else "-inf") if isinstance(v, float) and math.isinf(v) else repr(v))
        lines.append(f"{json.dumps(k)} = {value}")
    return "\n".join(lines)


def test_nesting_past_the_limit_is_refused_and_within_it_is_not():
    assert parse_document("[" * MAX_DEPTH + "]" * MAX_DEPTH, "json", "x") is not None
    with pytest.raises(InputError, match="nested too deeply"):
        parse_document("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "json", "x")


# ---- plan files are validated against their own inputs ---------------------------------------------------------

@pytest.fixture(scope="module")
def mixtral_plan(tmp_path_factory) -> dict:
    from meshplan.cli.main import main

    path = tmp_path_factory.mktemp("plan") / "mixtral.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--gbs", "64", "--seq",
                 "4096", "--pp", "2", "--tp", "2", "--ep", "8", "--out", str(path), "--json"]) == 0
    return json.loads(path.read_text())


EDITS = [  # (what, edit, words)
    ("ep 16 for 8 experts", lambda d: (d["mesh"].update(ep=16), d["prediction"]["layout"].update(ep=16)),
     ["ep 16", "8 experts"]),
    ("tp 3 against 32 heads", lambda d: (d["mesh"].update(tp=3, dp=d["mesh"]["dp"])), ["tp"]),
    ("edp edited", lambda d: d["mesh"].update(edp=2), ["edp is 2"]),
    ("a stage's first layer moved", lambda d: d["pipeline"]["stages"][1].update(first_layer=3),
     ["stages[1].first_layer"]),
    ("embedding flag moved", lambda d: d["pipeline"]["stages"][0].update(embedding=False),
     ["stages[0].embedding"]),
    ("prediction of another layout", lambda d: d["prediction"]["layout"].update(ep=4), ["prediction.layout", "ep"]),
]


@pytest.mark.parametrize("what,edit,words", EDITS, ids=[e[0] for e in EDITS])
@pytest.mark.parametrize("command", [["export", "--to", "megatron"], ["show"]])
def test_an_edited_plan_is_refused_by_every_reader(capsys, tmp_path, mixtral_plan, what, edit, words, command):
    doc = json.loads(json.dumps(mixtral_plan))
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    assert_input_error(*run(capsys, command[0], str(path), *command[1:]), "invalid plan", *words)


def test_the_unedited_plan_reads(capsys, tmp_path, mixtral_plan):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(mixtral_plan))
    code, out, err = run(capsys, "export", str(path), "--to", "megatron")
    assert code == 0 and "--expert-model-parallel-size 8" in out, err


def test_warnings_on_the_way_to_an_error_are_held_back(capsys, monkeypatch, recwarn):
    """A numpy overflow warning raised before an input is refused used to print above the error line: a failing
    command prints its one line only, a successful one still shows its warnings."""
    import warnings

    import meshplan.cli.train as cli_train  # where `estimate` loads its model

    real = cli_train.load_model

    def warns_then(fail: bool):
        def load(name):
            warnings.warn("overflow encountered in multiply", RuntimeWarning, stacklevel=2)
            if fail:
                raise InputError("the model is refused")
            return real(name)
        return load

    monkeypatch.setattr(cli_train, "load_model", warns_then(True))
    assert_input_error(*run(capsys, *EST), "the model is refused")
    assert not [w for w in recwarn if "overflow" in str(w.message)]
    monkeypatch.setattr(cli_train, "load_model", warns_then(False))
    code, out, err = run(capsys, *EST)
    # shown through warnings.showwarning (stderr in a shell; pytest's recorder here)
    assert code == 0 and [w for w in recwarn if "overflow" in str(w.message)]


def test_a_sample_of_the_fuzz_campaign_keeps_the_promise():
    """25 cases of each family of benchmarks/fuzz.py (files, flags, torchtitan TOML, verify flags): each one error
    line and exit 2. The whole campaign (about 4,000 cases, 50 s) is a benchmark, recorded in
    benchmarks/RESULTS.md."""
    import random
    import sys
    from collections import defaultdict

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fuzz

    rng = random.Random(0)
    plan_doc, verify_plan, titan_toml = fuzz.valid_documents()
    cases = fuzz.document_cases(rng, plan_doc, titan_toml) + fuzz.flag_cases() + fuzz.verify_flag_cases(verify_plan)
    assert len(cases) >= 2000
    families = defaultdict(list)
    for case in cases:
        families[case.family].append(case)
    assert {"torchtitan-toml", "flags-verify", "plan-file", "hf-config", "gpu-toml"} <= set(families)
    bad = []
    for family in sorted(families):
        for case in rng.sample(families[family], min(25, len(families[family]))):
            outcome, detail = fuzz.run_case(case, timeout=120)
            if outcome != "one error line, exit 2":
                bad.append(f"[{case.family}] {case.what}: {outcome} {detail}")
    assert bad == []


# ---- issue 43: the HF cache, paths as markup, plans re-derived on read ------------------------------------------

def test_an_hf_cache_under_a_missing_home_or_with_a_binary_ref_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", "~nouser-meshplan-test/hub")
    assert_input_error(*run(capsys, "models", "show", "owner/name"), "HF_HUB_CACHE")
    refs = tmp_path / "hub" / "models--owner--name" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_bytes(b"\xff\xfe\x00")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert_input_error(*run(capsys, "models", "show", "owner/name"), "refs/main", "UTF-8")
    (refs / "main").write_text("../../../etc")
    assert_input_error(*run(capsys, "models", "show", "owner/name"), "does not name a snapshot")


def test_a_path_that_looks_like_markup_is_printed_as_it_is(capsys, tmp_path):
    """`meshplan show '[/].json'` was a rich MarkupError traceback: paths and names print as given."""
    folder = tmp_path / "["
    folder.mkdir()
    path = folder / "].json"
    code, out, err = run(capsys, *PLAN, "--out", str(path))
    assert code == 0, err
    assert f"plan written to {path}" in out
    code, out, err = run(capsys, "show", str(path))
    assert code == 0 and f"plan {path} (schema" in out, err


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory) -> dict:
    from meshplan.cli.main import main

    path = tmp_path_factory.mktemp("llama") / "p.json"
    assert main([*PLAN, "--tokens", "1e12", "--out", str(path)]) == 0
    return json.loads(path.read_text())


FIGURE_EDITS = [  # (edit, words the one line holds): each from the issue's reproducers
    (lambda d: d["prediction"].update(step_time_s=-5), ["prediction.step_time_s", "greater than 0"]),
    (lambda d: d["prediction"].update(mfu=2.0), ["prediction.mfu", "1"]),
    (lambda d: d["prediction"]["stages"][0]["memory_gib"].update(weights=-1.0), ["weights", "0"]),
    (lambda d: d["inputs"]["cluster"]["gpu_spec"]["hbm_gib"].update(value=1e-300), ["hbm_gib", "1e-300"]),
    (lambda d: d["inputs"]["workload"].update(seq_len=1), ["tokens_per_s"]),
    (lambda d: d["memory"].update(recompute="bogus"), ["memory.recompute"]),
    (lambda d: d["prediction"].update(tokens_per_s=0), ["prediction.tokens_per_s"]),
    (lambda d: d["memory"]["stages"][0]["breakdown_gib"].update(weights=3.0),
     ["memory.stages[0].breakdown_gib.weights", "is 3", "give"]),
    (lambda d: d["economics"].update(total_usd=5.0), ["economics.total_usd", "is 5", "give"]),
    (lambda d: d["prediction"]["breakdown_s"].update(compute=d["prediction"]["breakdown_s"]["compute"] * 0.9),
     ["prediction.breakdown_s.compute"]),
]


@pytest.mark.parametrize("edit,words", FIGURE_EDITS, ids=[str(i) for i in range(len(FIGURE_EDITS))])
@pytest.mark.parametrize("command", [["show"], ["export", "--to", "megatron"], ["compare", "{same}"]])
def test_a_plan_with_an_edited_figure_is_refused_by_every_reader(capsys, tmp_path, llama_plan, edit, words, command):
    """A figure a plan derives, edited by hand (or its inputs edited under it), used to be written into a launch
    script (`# predicted: step -5 s`): this cost model made the plan, so its own inputs and layout must give every
    figure again, and the first that does not is named in one line."""
    doc = json.loads(json.dumps(llama_plan))
    edit(doc)
    path, same = tmp_path / "edited.json", tmp_path / "same.json"
    path.write_text(json.dumps(doc))
    same.write_text(json.dumps(llama_plan))
    args = [command[0], str(path), *(str(same) if a == "{same}" else a for a in command[1:])]
    assert_input_error(*run(capsys, *args), "invalid plan", *words)


def test_a_serving_plan_whose_engine_the_model_cannot_take_is_refused(capsys, tmp_path):
    """`ep: 3` on a dense model's serving plan was exported: engines are checked as training layouts are."""
    path = tmp_path / "s.json"
    assert run(capsys, "serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000",
               "--osl", "100", "--out", str(path))[0] == 0
    doc = json.loads(path.read_text())
    doc["engines"][0]["ep"] = 3
    path.write_text(json.dumps(doc))
    for command in (["show"], ["export", "--to", "vllm"]):
        assert_input_error(*run(capsys, command[0], str(path), *command[1:]), "invalid plan", "ep 3", "no experts")


@pytest.mark.parametrize("digest", [None, "sha256:0000000000000000"], ids=["not recorded", "another"])
def test_a_plan_of_another_cost_model_is_repriced_and_says_so(capsys, tmp_path, llama_plan, digest):
    """A plan an older meshplan wrote (no digest, or another) is not refused for figures this cost model computes
    otherwise: they are computed again, and show, export and compare say which figure moved and from what."""
    doc = json.loads(json.dumps(llama_plan))
    doc["cost_model"] = digest
    doc["prediction"]["breakdown_s"]["compute"] *= 0.9  # as an older cost model's figure would differ
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    code, out, err = run(capsys, "show", str(path))
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("re-priced:"))
    assert "prediction.breakdown_s.compute" in line and "where the file has" in line
    code, out, err = run(capsys, "export", str(path), "--to", "megatron")
    assert code == 0 and "note: re-priced:" in err
    stored = llama_plan["prediction"]["step_time_s"]
    assert f"step {stored:.4g} s" in out  # the export carries the figures computed again, not the file's
    code, out, err = run(capsys, "show", str(path), "--json")
    assert code == 0 and json.loads(out)["prediction"] == llama_plan["prediction"]


def test_every_help_is_readable_at_80_columns(capsys, monkeypatch):
    """At 80 columns rich's option tables cut `--ttft-ms` to "Time-to-first-to…" and broke choice lists mid-word:
    click's plain help wraps words whole, no line past 80, nothing elided."""
    monkeypatch.setenv("COLUMNS", "80")
    for command in (["estimate"], ["plan"], ["sweep"], ["serve"], ["profile"], ["export"], ["import"], ["show"],
                    ["compare"], ["verify"], ["models", "show"], ["hardware", "show"]):
        code, out, err = run(capsys, *command, "--help")
        assert code == 0, (command, err)
        assert all(len(line) <= 80 for line in out.splitlines()), (command, max(out.splitlines(), key=len))
        assert "…" not in out, command
        if command == ["serve"]:
            assert "Time-to-first-token target, ms." in " ".join(out.split())


def test_compare_price_is_held_to_the_budget_bounds(capsys, tmp_path, llama_plan):
    """compare's --price-per-gpu-hour goes through the same bounds as the training commands' (it was unchecked
    above 0; serve's inf ended in an internal field's name)."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(llama_plan))
    assert_input_error(*run(capsys, "compare", str(path), str(path), "--price-per-gpu-hour", "1e300"),
                       "--price-per-gpu-hour", "finite")
