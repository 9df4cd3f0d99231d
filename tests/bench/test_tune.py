"""`ember tune`: the SLO selection on fixed numbers, then the real command on the default
model (CPU): two block sizes at two rates within a one-minute budget, the config file it
writes started as `ember serve --config`, the plots read back against the JSON, and a run
cut short by its budget. `ember bench serve --plot` against the tuned server."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.bench.tune import SLO, Point, choose, knee, ladder, parse_sweep, plan_rungs

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("matplotlib")


def point(rate: float, ttft: float, tpot: float, throughput: float = 0.0, failed: int = 0) -> Point:
    return Point(rate, 4 - failed, failed, 1.0, rate, throughput, ttft / 2, ttft, tpot / 2, tpot)


A = [point(1, 100, 20, 100), point(2, 150, 25, 200), point(4, 400, 40, 400), point(8, 2000, 90, 500)]
B = [point(1, 90, 30, 100), point(2, 120, 35, 200), point(4, 300, 60, 420), point(8, 900, 200, 600)]


def test_the_knee_is_the_top_of_the_passing_prefix():
    assert knee(A, SLO(500, 50)) == A[2]
    assert knee(B, SLO(500, 50)) == B[1]  # TPOT 60 > 50 at rate 4
    assert knee(list(reversed(A)), SLO(500, 50)) == A[2]  # order of measurement does not matter
    assert knee(A, SLO(50, 50)) is None
    # a pass above a miss does not count: the rate between them already broke the SLO
    assert knee([point(1, 100, 10), point(2, 900, 10), point(4, 100, 10)], SLO(500, 50)).rate == 1
    assert knee([point(1, 100, 10), point(2, 100, 10, failed=1)], SLO(500, 50)).rate == 1  # a failed request misses


def test_choose_takes_the_highest_knee_then_the_higher_throughput():
    assert choose([A, B], SLO(500, 50)) == (0, A[2])
    assert choose([A, B], SLO(1000, 100)) == (1, B[2])  # both knees at 4 req/s: B does 420 tok/s there
    assert choose([A, B], SLO(200, 30)) == (0, A[1])
    assert choose([A, B], SLO(50, 50)) is None
    assert choose([A, A], SLO(500, 50)) == (0, A[2])  # a full tie: the earlier setting
    assert choose([[], A], SLO(500, 50)) == (1, A[2])  # a setting that measured nothing


_points = st.lists(st.builds(point, st.sampled_from([0.5, 1, 2, 4, 8]), st.floats(1, 1000), st.floats(1, 100),
                             st.floats(0, 1000), st.integers(0, 1)), max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(_points, min_size=1, max_size=4), st.floats(1, 1000), st.floats(1, 100), st.floats(0, 1),
       st.floats(0, 1))
def test_a_stricter_slo_never_chooses_a_higher_rate(runs, ttft, tpot, tighter_ttft, tighter_tpot):
    def rate(slo: SLO) -> float:
        chosen = choose(runs, slo)
        return chosen[1].rate if chosen else 0.0

    assert rate(SLO(ttft * tighter_ttft, tpot * tighter_tpot)) <= rate(SLO(ttft, tpot))


def test_the_ladder_and_its_length_come_from_the_budget():
    assert ladder(10, 3) == [4.0, 8.0, 12.0]
    assert ladder(15.9, 5) == [3.82, 7.63, 11.4, 15.3, 19.1]
    # saturated: 4 requests in 1 s; each rate costs max(4 / rate, 1) + 1 s; a new setting 5 s to start
    assert plan_rungs(100, 5, 1.0, 4.0, 4, 1) == 5  # 14.7 + 19.7 s
    assert plan_rungs(30, 5, 1.0, 4.0, 4, 1) == 4  # 11.1 + 16.1 s
    assert plan_rungs(21, 5, 1.0, 4.0, 4, 1) == 3  # 7.75 + 12.75 s
    assert plan_rungs(20, 5, 1.0, 4.0, 4, 1) == 2


def test_sweep_flags_parse_and_bad_ones_say_what_to_write():
    assert parse_sweep(["block-size=16,32", "kv_cache_dtype=float16,float32"]) == \
        {"block_size": [16, 32], "kv_cache_dtype": ["float16", "float32"]}
    with pytest.raises(ValueError, match="expected KNOB=V1,V2,... with KNOB one of max_num_batched_tokens"):
        parse_sweep(["max_num_tokens=1,2"])
    with pytest.raises(ValueError, match="max_num_seqs takes integers"):
        parse_sweep(["max_num_seqs=a,b"])


def test_a_missing_workload_file_is_refused_before_anything_starts(capsys):
    from ember.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--slo-ttft-p99", "100", "--slo-tpot-p99", "10", "--workload", "/nonexistent.jsonl"])
    assert exit_.value.code == 2
    assert "--workload '/nonexistent.jsonl': give random, shared-prefix or an existing .jsonl file" in \
        capsys.readouterr().err


def test_a_workload_file_gives_token_ids_and_lengths(gguf_path, tmp_path):
    from ember.bench.serve import file_requests
    from ember.loader.tokenizer_files import load_tokenizer

    tok = load_tokenizer(gguf_path)
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "The capital of France is", "max_tokens": 5}\n\n{"prompt": [1, 2, 3], "max_tokens": 2}\n')
    requests = file_requests(str(path), lambda text: tok.encode(text, add_special_tokens=False))
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == \
        [(tok.encode("The capital of France is", add_special_tokens=False), 5), ([1, 2, 3], 2)]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"w.jsonl line 1: expected \{\"prompt\""):
        file_requests(str(path), lambda text: [1])


# ---- the real command ----------------------------------------------------------------------

BUDGET_MIN = 1.0


def ember(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ember.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def tuned(gguf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    done, wall = ember("tune", str(gguf_path), "--slo-ttft-p99", "30000", "--slo-tpot-p99", "5000",
                       "--budget-minutes", str(BUDGET_MIN), "--max-model-len", "512", "--block-size", "16",
                       "--sweep", "block_size=16,32", "--request-rates", "2,8", "--num-prompts", "3",
                       "--random-input-len", "16", "--random-output-len", "6", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout, wall, json.loads((out / "results.json").read_text())


def test_tune_measures_each_setting_at_each_rate_within_its_budget(tuned, gguf_path):
    out, printed, wall, report = tuned
    assert report["elapsed_s"] <= BUDGET_MIN * 60
    assert wall <= BUDGET_MIN * 60 + 15  # + the interpreter's start and the imports before the clock
    assert report["notes"] == [] and report["calibration"] is None
    assert report["flags"] == {"model": str(gguf_path), "max-model-len": 512, "block-size": 16}
    assert [(s["label"], s["knob"], s["values"]["block_size"], s["note"]) for s in report["settings"]] == \
        [("defaults", None, 16, ""), ("block_size=32", "block_size", 32, "")]
    for s in report["settings"]:
        assert [(p["rate"], p["completed"], p["failed"]) for p in s["points"]] == [(2.0, 3, 0), (8.0, 3, 0)]
        assert s["knee"] == s["points"][-1]  # the SLOs are loose
        assert all(0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] and 0 < p["tpot_p50_ms"] <= p["tpot_p99_ms"]
                   for p in s["points"])
    best = report["best"]
    assert best["knee"]["rate"] == 8.0 and best["config"] == str(out / "config.yaml")
    assert f"best: {best['label']} at 8 req/s -> {out / 'config.yaml'}" in printed
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["block_size"], float(r["rate"]), float(r["ttft_p99_ms"]), r["meets_slo"]) for r in rows] == \
        [(s["label"], str(s["values"]["block_size"]), p["rate"], p["ttft_p99_ms"], "True")
         for s in report["settings"] for p in s["points"]]
    assert sorted(p.name for p in (out / "settings").iterdir()) == ["00.yaml", "01.yaml"]


def test_the_written_config_starts_a_server_that_answers_as_the_engine(tuned, gguf_path, tmp_path):
    import yaml

    from ember import LLM, SamplingParams
    from ember.bench.serve import _arrival_gaps
    from ember.distributed.parallel_state import free_port
    from ember.server.cli import main

    out, _, _, report = tuned
    config = yaml.safe_load((out / "config.yaml").read_text())
    values = report["best"]["values"]
    assert config == {"model": str(gguf_path), "max-model-len": 512, "block-size": values["block_size"],
                      "max-num-batched-tokens": values["max_num_batched_tokens"],
                      "max-num-seqs": values["max_num_seqs"], "kv-cache-dtype": values["kv_cache_dtype"],
                      "scheduling-policy": values["scheduling_policy"]}
    port = free_port()
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "ember.server.cli", "serve", "--config", str(out / "config.yaml"),
                             "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        text = log.read_text()
        assert f"({values['kv_cache_dtype']}) = " in text and f"blocks of {values['block_size']} tokens" in text
        assert "max_model_len 512" in text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
        llm = LLM(str(gguf_path), max_model_len=512, block_size=values["block_size"],
                  kv_cache_dtype=values["kv_cache_dtype"], max_num_seqs=values["max_num_seqs"])
        want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        assert got.choices[0].text == want.text and got.usage.completion_tokens == 6

        # `ember bench serve --plot` against it: the PNG, and the plotted values in the JSON
        png, out_json = tmp_path / "latency.png", tmp_path / "bench.json"
        main(["bench", "serve", "--base-url", url, "--tokenizer", str(gguf_path), "--num-prompts", "3",
              "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos", "--plot", str(png),
              "--output-json", str(out_json)])
        bench = json.loads(out_json.read_text())
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        per_request, results = bench["per_request"], bench["results"]
        assert len(per_request["ttft_ms"]) == len(per_request["tpot_ms"]) == results["completed"] == 3
        assert np.median(per_request["ttft_ms"]) == pytest.approx(results["median_ttft_ms"], rel=1e-12)
        assert np.percentile(per_request["tpot_ms"], 99) == pytest.approx(results["p99_tpot_ms"], rel=1e-12)

        # a workload file: its prompts and lengths exactly
        workload = tmp_path / "w.jsonl"
        workload.write_text('{"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}\n{"prompt": "Once upon a time", "max_tokens": 2}\n')
        main(["bench", "serve", "--base-url", url, "--tokenizer", str(gguf_path), "--dataset", str(workload),
              "--ignore-eos", "--output-json", str(out_json)])
        results = json.loads(out_json.read_text())["results"]
        tok = llm.get_tokenizer()
        assert (results["completed"], results["total_input_tokens"], results["total_output_tokens"]) == \
            (2, 5 + len(tok.encode("Once upon a time", add_special_tokens=False)), 5)

        # shared-prefix conversations start --request-rate apart (Poisson, from --seed): the
        # run lasts at least until the last one starts
        main(["bench", "serve", "--base-url", url, "--tokenizer", str(gguf_path), "--dataset", "shared-prefix",
              "--num-prompts", "3", "--num-turns", "2", "--shared-prefix-len", "16", "--turn-input-len", "4",
              "--random-output-len", "2", "--ignore-eos", "--request-rate", "1.5", "--seed", "7",
              "--output-json", str(out_json)])
        last_start = sum(_arrival_gaps(3, 1.5, 1.0, 7))
        assert last_start > 1.0
        assert json.loads(out_json.read_text())["results"]["duration_s"] >= last_start
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_stricter_slo_never_chooses_a_higher_rate_on_the_measured_points(tuned):
    _, _, _, report = tuned
    runs = [[Point(**p) for p in s["points"]] for s in report["settings"]]
    loose = SLO(**report["slo"])
    assert choose(runs, loose)[1].rate == 8.0
    ttfts = sorted({p.ttft_p99_ms for r in runs for p in r})
    rates = [(choose(runs, SLO(t, loose.tpot_p99_ms)) or (None, point(0.0, 0, 0)))[1].rate for t in reversed(ttfts)]
    assert rates == sorted(rates, reverse=True) and rates[0] == 8.0
    assert choose(runs, SLO(ttfts[0] - 1e-6, loose.tpot_p99_ms)) is None  # below every measured p99


def test_the_plots_hold_the_measured_points(tuned, tmp_path):
    from ember.bench.plots import plot_tune

    out, _, _, report = tuned
    fig = plot_tune(report, tmp_path / "again.png")
    assert (tmp_path / "again.png").read_bytes() == (out / "tune.png").read_bytes()  # the file is this figure
    throughput, ttft, tpot = fig.axes
    assert [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes] == \
        [("rate (req/s)", "tok/s"), ("rate (req/s)", "ms"), ("rate (req/s)", "ms")]
    for s in report["settings"]:
        rates = [p["rate"] for p in s["points"]]
        for ax, key, label in ((throughput, "output_throughput", s["label"]), (ttft, "ttft_p99_ms", s["label"]),
                               (ttft, "ttft_p50_ms", s["label"] + " p50"), (tpot, "tpot_p99_ms", s["label"]),
                               (tpot, "tpot_p50_ms", s["label"] + " p50")):
            (line,) = [line for line in ax.lines if line.get_label() == label]
            assert list(line.get_xdata()) == rates and list(line.get_ydata()) == [p[key] for p in s["points"]]
    slo_lines = [line for line in ttft.lines if line.get_label().startswith("SLO")]
    assert [list(line.get_ydata()) for line in slo_lines] == [[30000.0, 30000.0]]
    knee = report["best"]["knee"]
    (star,) = [c for c in throughput.collections if c.get_label().startswith("chosen: ")]
    assert star.get_offsets().tolist() == [[knee["rate"], knee["output_throughput"]]]


def test_the_latency_distribution_plot_draws_each_request(tmp_path):
    from ember.bench.plots import plot_latency_distribution

    fig = plot_latency_distribution([30.0, 10.0, 20.0, 40.0], [5.0, 7.0, 6.0, 8.0], tmp_path / "d.png", "run")
    assert (tmp_path / "d.png").stat().st_size > 0
    (ttft_cdf,) = [line for line in fig.axes[0].lines if line.get_label() == "TTFT"]
    assert list(ttft_cdf.get_xdata()) == [10.0, 20.0, 30.0, 40.0]
    assert list(ttft_cdf.get_ydata()) == [0.25, 0.5, 0.75, 1.0]
    (tpot_p50,) = [line for line in fig.axes[1].lines if line.get_label() == "p50"]
    assert list(tpot_p50.get_xdata()) == [6.5, 6.5]


def test_a_run_cut_short_by_its_budget_reports_what_it_measured(gguf_path, tmp_path):
    """20 s: the starting setting, its saturated rate and the ladder planned from it, then
    the budget ends the run where it is; every knob of the CPU's list is left unmeasured."""
    budget_s = 20
    done, wall = ember("tune", str(gguf_path), "--slo-ttft-p99", "30000", "--slo-tpot-p99", "5000",
                       "--budget-minutes", str(budget_s / 60), "--num-prompts", "3", "--random-input-len", "16",
                       "--random-output-len", "6", "--out", str(tmp_path))
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["elapsed_s"] <= budget_s and wall <= budget_s + 15
    assert (tmp_path / "results.csv").exists() and (tmp_path / "tune.png").exists()
    assert any("budget" in note for note in report["notes"] + [s["note"] for s in report["settings"]])
    first = report["settings"][0]
    if report["calibration"] is not None:  # the server started in time
        c = report["calibration"]
        assert [p["rate"] for p in first["points"]] == ladder(c["saturated_request_rate"], c["rungs"])[:len(first["points"])]
    assert done.returncode == (0 if report["best"] else 1)
    assert (tmp_path / "config.yaml").exists() == (report["best"] is not None)
