"""`ember tune MODEL --slo-ttft-p99 MS --slo-tpot-p99 MS`: the serving configuration that
sustains the highest request rate within a latency SLO, written as a `--config` file.

Each setting of the engine's knobs gets its own `ember serve --config setting.yaml`; the
`ember bench serve` client (ember/bench/serve.py) then sends the workload at each rate of a
ladder, lowest first, and stops climbing at the first rate that misses an SLO. A setting's
knee is the highest rate at which it, and every rate below, met both p99 SLOs with no
failed request. Knobs are swept one at a time, in the order of KNOBS: each knob's values
on top of the best setting so far, the best of them kept for the next knob.

The budget plans the work: the starting setting is measured first at once (all requests
at once: its saturated request rate sets the ladder, from 0.24x to 1.2x of it), then the
ladder's length is the longest (5 down to 2 rates) that lets every setting run in the
time left. Every server start and benchmark is cut at the deadline; what was measured by
then is reported, the rest named as skipped.

Written to --out: results.json (everything), results.csv (one row per measured point),
tune.png (ember/bench/plots.py), config.yaml (the best setting), settings/ and logs/ (each
server's config and log).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

KNOBS = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_dtype", "block_size", "scheduling_policy")
_RESERVE_S = 5.0  # kept back from the budget to stop the last server and write the results


# ---- selection: pure functions of measured points ------------------------------------------


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float
    tpot_p99_ms: float


@dataclass(frozen=True)
class Point:
    """One benchmark run of one setting at one request rate (latencies in ms)."""

    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float

    @classmethod
    def from_summary(cls, rate: float, s: dict[str, Any]) -> Point:
        """From ember.bench.serve.summarize's dict."""
        return cls(rate, s["completed"], s["failed"], s["duration_s"], s["request_throughput"],
                   s["output_throughput"], s["median_ttft_ms"], s["p99_ttft_ms"], s["median_tpot_ms"],
                   s["p99_tpot_ms"])


def meets(point: Point, slo: SLO) -> bool:
    return (point.failed == 0 and point.completed > 0 and point.ttft_p99_ms <= slo.ttft_p99_ms
            and point.tpot_p99_ms <= slo.tpot_p99_ms)


def knee(points: Sequence[Point], slo: SLO) -> Point | None:
    """The highest-rate point that meets the SLOs with every lower-rate point meeting them too."""
    best = None
    for point in sorted(points, key=lambda p: p.rate):
        if not meets(point, slo):
            break
        best = point
    return best


def choose(settings: Sequence[Sequence[Point]], slo: SLO) -> tuple[int, Point] | None:
    """The index of the setting with the highest-rate knee, and that knee; a tie goes to the
    higher output throughput there, then to the earlier setting. None if no setting meets
    the SLOs at its lowest rate. A stricter SLO keeps a subset of each setting's passing
    prefix, so the chosen rate never rises."""
    best: tuple[int, Point] | None = None
    for i, points in enumerate(settings):
        k = knee(points, slo)
        if k is not None and (best is None or (k.rate, k.output_throughput) > (best[1].rate, best[1].output_throughput)):
            best = (i, k)
    return best


def ladder(saturated_rate: float, rungs: int) -> list[float]:
    """`rungs` request rates from 1.2 / rungs to 1.2 times the saturated rate (3 digits)."""
    return [float(f"{saturated_rate * 1.2 * k / rungs:.3g}") for k in range(1, rungs + 1)]


def ladder_seconds(rates: Sequence[float], saturated_s: float, num_prompts: int) -> float:
    """The time one setting's ladder takes at most: each rate's arrivals, or the saturated run."""
    return sum(max(num_prompts / r, saturated_s) + 1.0 for r in rates)


def plan_rungs(left_s: float, startup_s: float, saturated_s: float, saturated_rate: float, num_prompts: int,
               other_settings: int) -> int:
    """The most rates (5 down to 2) at which the starting setting (running already) and
    `other_settings` more (each started anew) all fit in `left_s`."""
    for rungs in (5, 4, 3):
        per_setting = ladder_seconds(ladder(saturated_rate, rungs), saturated_s, num_prompts)
        if per_setting + other_settings * (startup_s + per_setting) <= left_s:
            return rungs
    return 2


# ---- the knobs ------------------------------------------------------------------------------


def knob_values(device: str, fp8_kv_cache: bool, cpu_bfloat16: bool) -> dict[str, list[Any]]:
    """The values swept per knob when --sweep does not name them: a GPU's token budgets and
    seat counts as vLLM's benchmarks use them; on the CPU (compute-bound, ~2-16 cores) small."""
    if device == "cuda":
        return {"max_num_batched_tokens": [2048, 4096, 8192, 16384], "max_num_seqs": [128, 256, 512],
                "kv_cache_dtype": ["auto", "fp8"] if fp8_kv_cache else ["auto"], "block_size": [64, 128],
                "scheduling_policy": ["fcfs", "lpm"]}
    return {"max_num_batched_tokens": [256, 512, 1024], "max_num_seqs": [16, 64, 256],
            "kv_cache_dtype": ["float16", "float32"] + (["bfloat16"] if cpu_bfloat16 else []),
            "block_size": [16, 32], "scheduling_policy": ["fcfs", "lpm"]}


def parse_sweep(items: Sequence[str]) -> dict[str, list[Any]]:
    """--sweep KNOB=V1,V2,...: the knobs to sweep, in the order given, with their values."""
    sweep: dict[str, list[Any]] = {}
    for item in items:
        name, _, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in KNOBS or not values:
            raise ValueError(f"--sweep {item!r}: expected KNOB=V1,V2,... with KNOB one of {', '.join(KNOBS)}")
        kind = str if name in ("kv_cache_dtype", "scheduling_policy") else int
        try:
            sweep[name] = [kind(v.strip()) for v in values.split(",") if v.strip()]
        except ValueError as e:
            raise ValueError(f"--sweep {item!r}: {name} takes integers") from e
    return sweep


# ---- running the benchmarks ------------------------------------------------------------------


@dataclass
class SettingRun:
    label: str  # the knobs that differ from the starting setting, or "defaults"
    knob: str | None  # the knob this setting varies (None: the starting setting)
    values: dict[str, Any]
    points: list[Point] = field(default_factory=list)
    startup_s: float | None = None
    note: str = ""  # why it stopped short of the ladder's top (other than an SLO miss)


class _Budget:
    def __init__(self, minutes: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + minutes * 60

    def left(self) -> float:
        return self.deadline - time.monotonic() - _RESERVE_S

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class LocalServer:
    """`ember serve --config FILE` on a free local port, until stop()."""

    def __init__(self, config: Path, log: Path) -> None:
        from ember.distributed.parallel_state import free_port
        from ember.server.data_parallel import die_with_parent

        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.server.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port), "--shutdown-timeout", "1", "--uvicorn-log-level", "warning"],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                raise RuntimeError(f"the server exited with code {self.proc.returncode}: {tail[0]} ({self.log})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the budget ran out while the server started")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def _label(values: dict[str, Any], start: dict[str, Any]) -> str:
    changed = [f"{k}={values[k]}" for k in KNOBS if values[k] != start[k]]
    return ", ".join(changed) or "defaults"


class _Tuner:
    def __init__(self, ns: argparse.Namespace, flags: dict[str, Any], tokenizer, budget: _Budget) -> None:
        from ember.bench.serve import add_serve_bench_args

        self.ns, self.flags, self.tok = ns, flags, tokenizer
        self.out = Path(ns.out)
        self.slo = SLO(ns.slo_ttft_p99, ns.slo_tpot_p99)
        self.budget = budget
        parser = argparse.ArgumentParser()
        add_serve_bench_args(parser)
        self.bench = parser.parse_args([])
        for name in ("num_prompts", "shared_prefix_len", "num_turns", "turn_input_len", "random_input_len",
                     "random_output_len", "random_range_ratio", "seed"):
            setattr(self.bench, name, getattr(ns, name))
        self.bench.dataset = ns.workload
        self.bench.ignore_eos = True  # every request runs to its length: the same work at every setting
        self.runs: list[SettingRun] = []
        self.notes: list[str] = []
        self.calibration: dict[str, Any] | None = None

    def config_for(self, values: dict[str, Any]) -> dict[str, Any]:
        return self.flags | {k.replace("_", "-"): v for k, v in values.items()}

    def _bench(self, url: str, rate: float, **override: Any) -> dict[str, Any]:
        """One benchmark run (TimeoutError at the budget's end); summarize()'s dict."""
        from ember.bench.serve import run_workload, server_model, summarize

        ns = argparse.Namespace(**(vars(self.bench) | {"base_url": url, "request_rate": rate} | override))
        results, duration = run_workload(ns, self.tok, server_model(url, None), timeout=max(self.budget.left(), 0.1))
        return summarize(results, duration)

    def measure(self, run: SettingRun, rates: Sequence[float] | None) -> list[float]:
        """Start run's server and climb the ladder (`rates`; None: calibrate first, then plan
        it); returns the rates used."""
        import httpx

        index = len(self.runs)
        self.runs.append(run)
        config = self.out / "settings" / f"{index:02d}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(config_yaml(self.config_for(run.values), f"setting {index}: {run.label}"))
        started = time.monotonic()
        server = LocalServer(config, self.out / "logs" / f"{index:02d}.log")
        try:
            server.wait_ready(max(self.budget.left(), 0.1))
            run.startup_s = time.monotonic() - started
            warmup = {"dataset": "random", "num_prompts": min(2, self.ns.num_prompts)}
            self._bench(server.url, float("inf"), **warmup)  # lazy first-use work stays out of the numbers
            if rates is None:
                rates = self._calibrate(server.url, run.startup_s)
            for rate in rates:
                point = Point.from_summary(rate, self._bench(server.url, rate))
                run.points.append(point)
                print(f"[{self.budget.elapsed():4.0f} s] {run.label} @ {rate:g}: p99 TTFT {point.ttft_p99_ms:.0f} ms, "
                      f"p99 TPOT {point.tpot_p99_ms:.1f} ms, {point.output_throughput:.0f} tok/s"
                      + ("" if meets(point, self.slo) else ": misses the SLOs"), flush=True)
                if not meets(point, self.slo):
                    break
        except TimeoutError as e:
            run.note = str(e) or "the budget ran out during a benchmark"
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            run.note = str(e)
        finally:
            server.stop()
        return list(rates or [])

    def _calibrate(self, url: str, startup_s: float) -> list[float]:
        s = self._bench(url, float("inf"))
        if s["completed"] == 0:
            raise RuntimeError(f"no request completed at the starting setting: {s['errors']}")
        units = self.ns.num_prompts if self.ns.workload == "shared-prefix" else s["completed"] + s["failed"]
        saturated_rate = units / s["duration_s"]
        others = sum(value != self.start[knob] for knob, values in self.sweep.items() for value in values)
        rungs = plan_rungs(self.budget.left(), startup_s, s["duration_s"], saturated_rate, units, others)
        self.calibration = {"saturated_request_rate": saturated_rate, "duration_s": s["duration_s"],
                            "output_throughput": s["output_throughput"], "rungs": rungs}
        self.units = units
        return ladder(saturated_rate, rungs)

    def tune(self, start: dict[str, Any], sweep: dict[str, list[Any]], rates: list[float] | None) -> None:
        self.sweep, self.start = sweep, start
        self.units = self.ns.num_prompts
        current = SettingRun("defaults", None, dict(start))
        rates = self.measure(current, rates)
        if not current.points:
            self.notes.append(f"the starting setting measured nothing: {current.note}")
            return
        knobs = list(sweep)
        for i, (knob, values) in enumerate(sweep.items()):
            candidates = [current]
            for value in values:
                if value == current.values[knob]:
                    continue
                values_now = current.values | {knob: value}
                label = _label(values_now, start)
                first_point = max(self.units / rates[0], (self.calibration or {}).get("duration_s", 0.0))
                if self.budget.left() < (current.startup_s or 0.0) + first_point:
                    later = f"; not swept: {', '.join(knobs[i + 1:])}" if knobs[i + 1:] else ""
                    self.notes.append(f"the budget ran out before {label}{later}")
                    return
                run = SettingRun(label, knob, values_now)
                self.measure(run, rates)
                candidates.append(run)
            chosen = choose([c.points for c in candidates], self.slo)
            if chosen is not None:
                current = candidates[chosen[0]]

    def report(self, model: str, device: str, config_path: Path | None) -> dict[str, Any]:
        chosen = choose([r.points for r in self.runs], self.slo)
        settings = []
        for r in self.runs:
            k = knee(r.points, self.slo)
            settings.append({"label": r.label, "knob": r.knob, "values": r.values, "startup_s": r.startup_s,
                             "note": r.note, "points": [dataclasses.asdict(p) for p in r.points],
                             "knee": dataclasses.asdict(k) if k else None})
        best = None
        if chosen is not None:
            run = self.runs[chosen[0]]
            best = {"label": run.label, "values": run.values, "knee": dataclasses.asdict(chosen[1]),
                    "config": str(config_path) if config_path else None}
        return {"model": model, "device": device, "workload": self.ns.workload,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "slo": dataclasses.asdict(self.slo), "budget_minutes": self.ns.budget_minutes,
                "elapsed_s": self.budget.elapsed(), "flags": self.flags, "calibration": self.calibration,
                "notes": self.notes, "settings": settings, "best": best}


# ---- files -------------------------------------------------------------------------------


def config_yaml(flags: dict[str, Any], comment: str) -> str:
    """A `--config` file (ember/server/config_file.py): flag names to values."""
    import yaml

    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(flags, sort_keys=False)


def engine_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine flags `ns` sets to other than their defaults, as a `--config` file's keys
    (the model made absolute where it is a local path)."""
    from ember.engine_args import add_engine_args, model_arg

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags: dict[str, Any] = {}
    model = model_arg(ns)
    if model is not None:
        flags["model"] = str(Path(model).resolve()) if Path(model).exists() else model
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config", "model_flag"):
            continue
        value = getattr(ns, action.dest)
        if value != action.default:
            if isinstance(action, argparse._StoreFalseAction):
                value = not value  # `no-jump-forward: true`
            flags[action.option_strings[0].lstrip("-")] = value
    return flags


def write_csv(report: dict[str, Any], path: Path) -> None:
    fields = [f.name for f in dataclasses.fields(Point)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "knob", *KNOBS, *fields, "meets_slo"])
        slo = SLO(**report["slo"])
        for s in report["settings"]:
            for p in s["points"]:
                writer.writerow([s["label"], s["knob"] or "", *(s["values"][k] for k in KNOBS),
                                 *(p[name] for name in fields), meets(Point(**p), slo)])


def rate_unit(workload: str) -> str:
    return "conversations/s" if workload == "shared-prefix" else "req/s"


def format_report(report: dict[str, Any]) -> str:
    slo, unit = report["slo"], rate_unit(report["workload"])
    lines = [f"ember tune: SLO p99 TTFT <= {slo['ttft_p99_ms']:g} ms, p99 TPOT <= {slo['tpot_p99_ms']:g} ms; "
             f"{len(report['settings'])} settings in {report['elapsed_s']:.0f} s "
             f"(budget {report['budget_minutes']:g} min)"]
    for s in report["settings"]:
        k = s["knee"]
        rates = ", ".join(f"{p['rate']:g}" for p in s["points"])
        lines.append(f"  {s['label']:<48} rates [{rates}] -> "
                     + (f"knee {k['rate']:g} {unit}, {k['output_throughput']:.1f} tok/s" if k else "no rate meets the SLOs")
                     + (f"  ({s['note']})" if s["note"] else ""))
    lines += [f"  note: {n}" for n in report["notes"]]
    best = report["best"]
    if best:
        lines.append(f"best: {best['label']} at {best['knee']['rate']:g} {unit} -> {best['config']}")
    elif any(s["points"] for s in report["settings"]):
        lines.append("no setting meets the SLOs at its lowest rate: loosen the SLOs or give lower --request-rates")
    else:
        lines.append("nothing was measured within the budget: raise --budget-minutes")
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------------------


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    from ember.bench.serve import add_workload_args

    parser.add_argument("--slo-ttft-p99", type=float, required=True, metavar="MS", help="p99 time to first token")
    parser.add_argument("--slo-tpot-p99", type=float, required=True, metavar="MS",
                        help="p99 time per output token after the first")
    parser.add_argument("--workload", default="random", metavar="random|shared-prefix|FILE.jsonl",
                        help="what `ember bench serve --dataset` sends (FILE.jsonl: one "
                             '{"prompt": text or [ids], "max_tokens": N} a line)')
    parser.add_argument("--budget-minutes", type=float, default=30.0,
                        help="the whole run, server starts included, ends within this")
    parser.add_argument("--out", default="ember-tune", metavar="DIR",
                        help="results.json, results.csv, tune.png and config.yaml go here")
    parser.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2",
                        help=f"sweep these knobs only, with these values, in this order ({', '.join(KNOBS)}); "
                             "default: every knob not given as a flag, with values for the device")
    parser.add_argument("--request-rates", default=None, metavar="R1,R2,...",
                        help="the rate ladder in requests/s (default: planned from the starting setting's "
                             "saturated rate and the budget)")
    add_workload_args(parser)


def run_tune(ns: argparse.Namespace) -> dict[str, Any]:
    """Tune, write the files, print the summary; the report (results.json's content)."""
    budget = _Budget(ns.budget_minutes)
    import torch

    from ember.bench.plots import plot_tune, require_matplotlib
    from ember.config import EngineConfig, cpu_computes_bfloat16
    from ember.engine_args import engine_args
    from ember.loader.tokenizer_files import load_tokenizer

    require_matplotlib()
    if ns.slo_ttft_p99 <= 0 or ns.slo_tpot_p99 <= 0 or ns.budget_minutes <= 0:
        raise ValueError("--slo-ttft-p99, --slo-tpot-p99 and --budget-minutes must be > 0")
    if ns.workload not in ("random", "shared-prefix") and not Path(ns.workload).is_file():
        raise ValueError(f"--workload {ns.workload!r}: give random, shared-prefix or an existing .jsonl file")
    rates = None
    if ns.request_rates:
        rates = sorted(float(r) for r in ns.request_rates.split(","))
        if not rates or rates[0] <= 0:
            raise ValueError(f"--request-rates {ns.request_rates!r}: give positive rates, e.g. 1,2,4")
    resolved = EngineConfig(**engine_args(ns), usage_context="serve").resolve()  # the servers it starts
    flags = engine_flags(ns)
    start = {k: getattr(resolved, k) for k in KNOBS}
    if ns.sweep:
        sweep = parse_sweep(ns.sweep)
    else:
        fp8 = resolved.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        fixed = {k for k in KNOBS if k.replace("_", "-") in flags}  # a knob given as a flag stays as given
        sweep = {k: v for k, v in knob_values(resolved.device, fp8, cpu_computes_bfloat16()).items() if k not in fixed}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(resolved.tokenizer or resolved.model)
    tuner = _Tuner(ns, flags, tok, budget)
    tuner.tune(start, sweep, rates)

    report = tuner.report(resolved.model, resolved.device, None)
    if report["best"] is not None:
        path = out / "config.yaml"
        best = report["best"]
        path.write_text(config_yaml(
            tuner.config_for(best["values"]),
            f"ember tune: {best['label']}: {best['knee']['rate']:g} {rate_unit(ns.workload)} within p99 TTFT "
            f"{ns.slo_ttft_p99:g} ms, p99 TPOT {ns.slo_tpot_p99:g} ms ({ns.workload} workload, {report['date']})\n"
            f"ember serve --config {path.name}"))
        best["config"] = str(path)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    write_csv(report, out / "results.csv")
    plot_tune(report, out / "tune.png")
    print(format_report(report))
    return report
