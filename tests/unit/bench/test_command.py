"""posbench bench on the CPU: the structure and sanity of its output, not its speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import posbench
from posbench.bench import command, flops, measure, timing
from posbench.bench import report as bench_report
from posbench.bench.checks import settings_from_config
from posbench.config import config_dir
from posbench.core.errors import PosbenchError

SMALL_RUN = ["model=tiny", "steps=2", "warmup_steps=1", "eval_lengths=[64,128]", "eval_steps=1",
             "batch_size=2", "context=32"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are far too small for intra-op threads; on a busy 2-core machine the thread
    pool's contention makes each step ~40x slower. Restored afterwards for other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def compose_bench(*overrides: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("bench", overrides=list(overrides))


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def rope_alibi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = compose_bench(*SMALL_RUN, "methods=[rope,alibi]", "peer=true", f"out='{out}'")
    report = command.run_bench(cfg)
    return out, report


@pytest.mark.slow
def test_bench_json_structure_and_values(rope_alibi_run):
    out, report = rope_alibi_run
    saved = json.loads((out / "bench.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for key in ("date", "device", "torch", "command", "config", "methods", "peer", "peer_ratio", "flops"):
        assert key in saved
    assert saved["torch"] == torch.__version__
    assert saved["complete"] is True
    assert saved["config"]["methods"] == ["rope", "alibi"]
    assert list(saved["methods"]) == ["rope", "alibi"]
    for name, entry in saved["methods"].items():
        train = entry["train"]
        assert train["attention_backend"] == "sdpa"
        for key in ("step_ms_median", "step_ms_p10", "step_ms_p90", "tokens_per_second_median", "tflops",
                    "tokens_per_second_overall"):
            assert finite_positive(train[key]), (name, key, train[key])
        assert train["step_ms_min"] <= train["step_ms_p10"] <= train["step_ms_median"] <= train["step_ms_p90"] <= train["step_ms_max"]
        assert len(train["step_ms_all"]) == 2
        assert train["tokens_per_step"] == 2 * 32
        assert 0 < train["mfu"] < 1 and train["peak_memory_gb"] is None  # CPU: measured peak, no CUDA memory stats
        # random tokens through a freshly initialised model: loss close to ln(vocab)
        assert abs(train["final_loss"] - math.log(8192)) < 1.0
        assert set(entry["eval"]) == {"64", "128"}
        for length, ev in entry["eval"].items():
            assert finite_positive(ev["tokens_per_second_median"]), (name, length)
            assert ev["tokens_per_batch"] == 8 * int(length)
            assert abs(ev["mean_loss"] - math.log(8192)) < 1.0


@pytest.mark.slow
def test_bench_peer_and_flops(rope_alibi_run):
    _, report = rope_alibi_run
    peer = report["peer"]
    assert "skipped" not in peer, peer
    assert finite_positive(peer["train"]["tokens_per_second_median"])
    # the peer is the same shape: the same matmul weights, hence the same FLOPs per token
    assert peer["matmul_parameters"] == report["methods"]["rope"]["matmul_parameters"] == report["flops"]["matmul_parameters"]
    expected = report["methods"]["rope"]["train"]["tokens_per_second_median"] / peer["train"]["tokens_per_second_median"]
    assert report["peer_ratio"] == pytest.approx(expected)


@pytest.mark.slow
def test_bench_markdown(rope_alibi_run, capsys):
    out, report = rope_alibi_run
    text = (out / "bench.md").read_text()
    assert text == bench_report.render_markdown(report)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| method | attention |") and "% of rope" in rows[0]
    assert "eval tok/s @64" in rows[0] and "eval tok/s @128" in rows[0]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["rope", "alibi"]
    star = "*" if report["methods"]["rope"]["train"]["load"]["contended"] else ""  # a busy machine is marked
    assert f"| 100%{star} |" in rows[1]
    assert f"posbench rope / peer tokens/s = {report['peer_ratio']:.2f}" in text
    assert "6*N + 12*L*T*d" in text


def test_flop_formula_counts_linear_weights():
    model = posbench.create_model("rope", flavour="tiny")
    d, L, V, h = 64, 2, 8192, model.cfg.hidden_size
    n = L * (4 * d * d + 3 * d * h) + d * V  # qkv + out, gate/up/down, LM head; no embedding
    assert flops.matmul_parameters(model) == n
    assert flops.train_flops_per_token(n, L, 256, d) == 6 * n + 12 * L * 256 * d


@pytest.mark.slow
def test_peak_table(monkeypatch):
    cpu = torch.device("cpu")
    measured, source = flops.resolve_peak_tflops("auto", cpu)
    assert 0 < measured < 100 and "measured CPU peak" in source and "float32" in source
    assert "bfloat16" in flops.resolve_peak_tflops("auto", cpu, torch.bfloat16)[1]
    assert flops.resolve_peak_tflops(None, cpu)[0] is None
    assert flops.resolve_peak_tflops(400.0, cpu)[0] == 400.0
    for name, peak in [("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert flops.resolve_peak_tflops("auto", torch.device("cuda"))[0] == peak, name


def test_default_config_composes():
    settings, model = settings_from_config(compose_bench())
    assert settings.methods == posbench.list_methods()
    assert (settings.batch_size, settings.context, settings.warmup_steps, settings.steps) == (64, 256, 5, 30)
    assert settings.eval_lengths == [512, 1024, 2048]
    assert settings.peer is True and settings.compile == "auto" and settings.peak_tflops == "auto"
    assert model.flavour == "small" and model.vocab_size == 8192


@pytest.mark.parametrize(
    "override, words",
    [
        ("methods=[rope,nosuch]", "unknown position method 'nosuch'"),
        ("methods=[]", "methods must be all or a non-empty list"),
        ("batch_size=0", "batch_size must be a positive integer"),
        ("context=-4", "context must be a positive integer"),
        ("steps=0", "steps must be a positive integer"),
        ("warmup_steps=-1", "warmup_steps must be an integer >= 0"),
        ("eval_lengths=[512,0]", "eval_lengths entries must be a positive integer, got 0; e.g. eval_lengths=[512,1024]"),
        ("batch_size=abc", "batch_size must be an integer, got 'abc'"),
        ("peer=maybe", "peer must be true or false"),
        ("+speed=1", "unknown option(s) speed"),
        ("compile=maybe", "compile must be auto, true or false"),
        ("precision=fp16", "precision must be auto, fp32 or bf16"),
        ("peak_tflops=-3", "peak_tflops must be auto, null or a positive number"),
        ("device=tpu", "device must be auto, cpu, cuda or cuda:N"),
        ("context=8192", "method learned supports positions up to 4096"),
    ],
)
def test_bad_input_is_a_one_line_error(override, words):
    with pytest.raises(PosbenchError) as info:
        settings_from_config(compose_bench("model=tiny", override))
    assert words in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override, field, value", [
    ("eval_lengths=128", "eval_lengths", [128]), ("eval_lengths=null", "eval_lengths", []),
    ("eval_lengths=[256,128,256]", "eval_lengths", [128, 256]), ("out=2024", "out", "2024"),
    ("peak_tflops=null", "peak_tflops", None), ("peak_tflops=400", "peak_tflops", 400.0),
    ("compile=true", "compile", "true"), ("methods=[alibi,rope,alibi]", "methods", ["alibi", "rope"]),
])
def test_short_forms_of_the_command_line(override, field, value):
    """What the command line writes short stays accepted as before the settings were typed."""
    settings, _ = settings_from_config(compose_bench("model=tiny", override))
    assert getattr(settings, field) == value


def test_methods_null_is_every_method():
    assert settings_from_config(compose_bench("model=tiny", "methods=null"))[0].methods == posbench.list_methods()


def test_unknown_method_fails_before_any_work(tmp_path):
    with pytest.raises(PosbenchError, match="unknown position method 'nosuch'"):
        command.run_bench(compose_bench(*SMALL_RUN, "methods=[nosuch]", f"out='{tmp_path}'"))
    assert not (tmp_path / "bench.json").exists()


def test_eval_oom_and_unsupported_lengths_are_recorded(monkeypatch):
    settings, model_cfg = settings_from_config(compose_bench(*SMALL_RUN, "eval_lengths=[64,128,256]"))
    env = measure.Env(settings, model_cfg, None, torch.device("cpu"), None, False, None)

    def fake(env, model, length):
        if length == 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"tokens_per_second_median": 1.0}

    monkeypatch.setattr(measure, "time_eval_length", fake)
    result = measure.bench_eval(env, model=None, max_positions=200)
    assert result == {"64": {"tokens_per_second_median": 1.0}, "128": "oom",
                      "256": "unsupported: positions up to 200"}


@pytest.mark.slow
def test_a_failing_method_keeps_the_others(tmp_path, monkeypatch):
    real = command.bench_method

    def flaky(env, name):
        if name == "alibi":
            raise RuntimeError("kernel exploded")
        return real(env, name)

    monkeypatch.setattr(command, "bench_method", flaky)
    cfg = compose_bench("model=tiny", "steps=1", "warmup_steps=0", "eval_lengths=[32]", "eval_steps=1",
                        "batch_size=2", "context=16", "methods=[alibi,nope]", "peer=false", f"out='{tmp_path}'")
    with pytest.raises(PosbenchError, match="alibi .*kernel exploded"):
        command.run_bench(cfg)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["methods"]["alibi"]["train"]["error"] == "RuntimeError: kernel exploded"
    assert finite_positive(saved["methods"]["nope"]["train"]["tokens_per_second_median"])
    assert saved["peer"] is None and saved["peer_ratio"] is None
    md = (tmp_path / "bench.md").read_text()
    assert "| alibi | sdpa | RuntimeError |" in md and "| nope |" in md and "peer=false" in md


@pytest.mark.slow
def test_bench_compiles_as_the_trainer(tmp_path, monkeypatch):
    """The model and the peer go through the trainer's compile_model, in the trainer's compile mode."""
    seen = []

    def fake_compile(model, mode, cache_dir=None):
        seen.append((type(model).__name__, mode, cache_dir))
        return model

    monkeypatch.setattr(measure, "compile_model", fake_compile)
    cfg = compose_bench("model=tiny", "steps=1", "warmup_steps=0", "eval_lengths=[]", "batch_size=2", "context=16",
                        "methods=[rope]", "peer=true", "compile=true", "peak_tflops=1", f"out='{tmp_path}'")
    report = command.run_bench(cfg)
    assert report["compiled"] is True and "skipped" not in report["peer"], report["peer"]
    assert seen == [("Transformer", "default", None), ("LlamaForCausalLM", "default", None)]


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # cwd=tmp_path: Hydra creates its run dir (outputs/bench/...) relative to the working directory
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "posbench.commands.cli", "bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(tmp_path, "model=tiny", "methods=[nope]", "steps=1", "warmup_steps=1", "eval_lengths=[64]",
                   "eval_steps=1", "batch_size=2", "context=32", "peer=false", f"out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "bench.json").read_text())
    assert list(saved["methods"]) == ["nope"]
    assert saved["command"].startswith("posbench bench ") and "methods=[nope]" in saved["command"]
    assert finite_positive(saved["methods"]["nope"]["eval"]["64"]["tokens_per_second_median"])
    assert "| nope |" in proc.stdout  # the table is printed too


@pytest.mark.slow
def test_cli_bad_method_is_one_line(tmp_path):
    proc = run_cli(tmp_path, "model=tiny", "methods=[nosuch]")
    assert proc.returncode == 2
    assert "posbench bench: error: unknown position method 'nosuch'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cuda_event_timing_bookkeeping(monkeypatch):
    """The CUDA branch of time_steps with fake events on a fake GPU clock: step i is the time
    between events i and i+1, and the host synchronises only before and after the loop."""
    clock = {"ms": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t = None

        def record(self) -> None:
            self.t = clock["ms"]

        def elapsed_time(self, end: FakeEvent) -> float:
            assert self.t is not None and end.t is not None, "an event was read before being recorded"
            return end.t - self.t

    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    seen = []

    def step(i):
        seen.append(i)
        clock["ms"] += 10.0 * i  # step i takes 10*i "GPU" milliseconds
        return i

    ms, wall, last = timing.time_steps(step, 3, torch.device("cuda", 0), offset=3)
    assert seen == [3, 4, 5] and last == 5
    assert ms == [30.0, 40.0, 50.0]
    assert len(syncs) == 2 and wall >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_on_cuda(tmp_path):
    """The CUDA path end to end: compile, bf16, events, memory stats, flex (alibi), the peer."""
    cfg = compose_bench("model=tiny", "methods=[rope,alibi]", "steps=3", "warmup_steps=2", "eval_lengths=[256,512]",
                        "eval_steps=2", "batch_size=8", "context=128", "peer=true", "peak_tflops=100",
                        f"out='{tmp_path}'")
    report = command.run_bench(cfg)
    assert report["device_type"] == "cuda" and report["compiled"] and report["autocast"] == "bfloat16"
    assert report["methods"]["alibi"]["train"]["attention_backend"] == "flex"
    for entry in report["methods"].values():
        train = entry["train"]
        assert finite_positive(train["step_ms_median"]) and finite_positive(train["peak_memory_gb"])
        assert 0 < train["mfu"] < 1
        for ev in entry["eval"].values():
            assert finite_positive(ev["tokens_per_second_median"]) and finite_positive(ev["peak_memory_gb"])
    assert "skipped" not in report["peer"], report["peer"]
    assert finite_positive(report["peer_ratio"])


@pytest.mark.slow
def test_cli_out_naming_a_file_is_one_line(tmp_path):
    """`out=<an existing file>` was a FileExistsError traceback; now one line, exit 2, as viz
    and plot, with the file untouched."""
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    proc = run_cli(tmp_path, "model=tiny", "methods=[nope]", f"out={target}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"posbench bench: error: out={target} names an existing file, not a folder; choose another out"
    assert target.read_text() == "mine"


def test_contention_flags_a_wide_spread_or_a_load_above_the_cores():
    clean = timing.contention([10.0, 10.2, 10.1, 10.4, 10.3], 0.5, 0.7, cores=4)
    assert clean["contended"] is False and clean["contention"] is None
    assert clean["ms_p50"] == pytest.approx(10.2) and clean["ms_p10"] < clean["ms_p50"] < clean["ms_p90"]
    assert clean["load_average_before"] == 0.5 and clean["cpu_cores"] == 4
    wide = timing.contention([10.0, 10.0, 30.0, 31.0, 10.0], 0.5, 0.7, cores=4)
    assert wide["contended"] and wide["contention"].startswith("step-time spread p90/p10 ")
    assert wide["spread_p90_p10"] == pytest.approx(wide["ms_p90"] / wide["ms_p10"])
    busy = timing.contention([10.0, 10.2, 10.1], 3.0, 14.2, cores=4)
    assert busy["contended"] and busy["contention"] == "load average 14.2 > 4 cores"
    assert timing.contention([10.0, 10.1], None, None, cores=4)["contended"] is False  # no load average known


@pytest.mark.slow
def test_bench_records_the_load_and_the_spread(rope_alibi_run):
    """Each timed block records the load average around it and its p10/p50/p90; the report the
    load at start and end and the core count."""
    _, report = rope_alibi_run
    assert report["load_average"]["cpu_cores"] == os.cpu_count()
    assert report["load_average"]["end"] is not None and report["load_average"]["start"] is not None
    assert report["load_average"]["contended_spread"] == timing.CONTENDED_SPREAD
    assert len(report["flops"]["peak_load_average"]) == 2 and isinstance(report["flops"]["peak_contended"], bool)
    for block in [report["methods"]["rope"]["train"], report["methods"]["rope"]["eval"]["64"], report["peer"]["train"]]:
        load = block["load"]
        assert load["ms_p10"] <= load["ms_p50"] <= load["ms_p90"]
        assert isinstance(load["contended"], bool) and load["load_average_after"] is not None


@pytest.mark.slow
def test_markdown_marks_contended_numbers(rope_alibi_run):
    """A contended block is marked, with its reason, and so is every ratio it enters; a clean
    report has no mark."""
    import copy

    _, measured = rope_alibi_run
    report = copy.deepcopy(measured)
    report["load_average"].update(start=0.1, end=0.2, cpu_cores=4)
    report["flops"]["peak_contended"] = False
    blocks = [report["methods"][m]["train"] for m in ("rope", "alibi")] + [report["peer"]["train"]]
    blocks += [ev for m in ("rope", "alibi") for ev in report["methods"][m]["eval"].values()]
    for block in blocks:
        block["load"] = timing.contention([10.0, 10.1, 10.2], 0.1, 0.2, cores=4)
    clean = bench_report.render_markdown(report)
    assert "contended" not in clean and "*" not in clean.split("| method |")[1].split("peer:")[0]
    assert "load average 0.1 at the start, 0.2 at the end, on 4 cores" in clean
    report["methods"]["alibi"]["train"]["load"] = timing.contention([10.0, 10.0, 30.0, 31.0], 0.1, 9.5, cores=4)
    text = bench_report.render_markdown(report)
    assert "**contended: 1 of 7 timed blocks ran on a busy machine" in text
    rows = {r.split("|")[1].strip(): r for r in text.splitlines() if r.startswith("| ")}
    assert "* |" not in rows["rope"] and rows["rope"].endswith("| - | " + " | ".join(
        bench_report._cell_eval(report["methods"]["rope"]["eval"][str(n)]) for n in (64, 128)) + " |")
    spread = report["methods"]["alibi"]["train"]["load"]["spread_p90_p10"]
    assert "%* |" in rows["alibi"] and f"| spread {spread:.2f}, load 9.5 |" in rows["alibi"]
    assert "(* contended" not in text  # rope and the peer, the ratio's two numbers, are clean
    report["methods"]["rope"]["train"]["load"] = report["methods"]["alibi"]["train"]["load"]
    assert "(* contended: not a clean measurement)" in bench_report.render_markdown(report)
