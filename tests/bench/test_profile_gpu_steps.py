"""benchmarks/scripts/profile_gpu_steps.py --images on the CPU: chat prompts of one random image
and text (ember bench serve's --dataset images) through LLM.chat on a tiny Qwen2.5-VL directory
(served_model.py --vl --tiny, dummy weights); a line for each step before the window and in it,
their tokens (the first step the prompts' prefills), then the window's summary and top ops; with
--gaps the same steps (the engine's phases marked pass their calls through). --gaps' charging of
the GPU's idle time to the host phases open meanwhile, on a trace of known events."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks" / "scripts"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("vl")
    subprocess.run([sys.executable, str(SCRIPTS / "served_model.py"), "--vl", "--tiny", str(model)], check=True,
                   env=os.environ | {"PYTHONPATH": str(ROOT)})
    return model


@pytest.mark.parametrize("gaps", [False, True])
def test_images_mode_prints_each_steps_wall_and_kernel_time(tiny_vl, gaps):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    model = tiny_vl
    done = subprocess.run([sys.executable, str(SCRIPTS / "profile_gpu_steps.py"), str(model), "--images",
                           "--num-prompts", "2", "--image-size", "56x56", "--input-len", "8", "--output-len", "8",
                           "--skip", "1", "--steps", "3", "--top", "3", "--max-num-batched-tokens", "4096",
                           *(["--gaps"] if gaps else [])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    before = [ln for ln in lines if ln.startswith("  steps before the window: ")]
    assert len(before) == 1
    pairs = re.findall(r"(\d+\.\d) \((\d+)\)", before[0])
    assert len(pairs) == 3  # --skip 1, then the profiler's 2 warm-up steps
    # the first step prefills both prompts (what the warm-up request's prefix cache left), each
    # later step decodes one token of each
    assert int(pairs[0][1]) > 2 and [int(n) for _, n in pairs[1:]] == [2, 2]
    steps = [re.fullmatch(r"  step +(\d+): wall +(\d+\.\d+) ms  kernels +(\d+\.\d+) ms  tokens (\d+)", ln)
             for ln in lines if ln.startswith("  step ")]
    assert all(steps) and [int(m[1]) for m in steps] == [3, 4, 5] and all(m[4] == "2" for m in steps)
    assert all(float(m[3]) > 0 for m in steps)
    head = [ln for ln in lines if ln.startswith("== ")]
    assert len(head) == 1 and "x2 in images 56x56 + 8 out 8" in head[0] and "ms/step" in head[0]
    top = lines.index(head[0])
    assert len([ln for ln in lines[top + 1:top + 4] if re.match(r" +\d+\.\d us +\d+\.\d%", ln)]) == 3


def _event(name: str, start: float, end: float, cuda: bool = False) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))


def test_gaps_charge_the_gpus_idle_time_to_the_host_phases_open_meanwhile(capsys):
    spec = importlib.util.spec_from_file_location("profile_gpu_steps", SCRIPTS / "profile_gpu_steps.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    events = [_event("ProfilerStep#1", 0, 1000), _event("ProfilerStep#2", 1000, 2000),
              _event("host:launch", 0, 600), _event("host:prepare", 200, 450), _event("host:update", 1950, 2100),
              _event("gemm", 0, 300, cuda=True), _event("norm", 280, 320, cuda=True),  # overlapping: one busy stretch
              _event("gemm", 500, 1000, cuda=True), _event("gemm", 1000, 1900, cuda=True),
              _event("sample", 1930, 1960, cuda=True),
              _event("gemm", 2500, 2600, cuda=True),  # after the window: not counted
              # the ranges' annotations on the GPU's timeline, over the kernels launched inside them: not busy
              _event("host:launch", 0, 1000, cuda=True), _event("ProfilerStep#2", 1000, 2050, cuda=True)]
    script.idle_by_phase(events, 2)
    lines = capsys.readouterr().out.splitlines()
    # idle: 320-500 (mid 410: launch > prepare), 1900-1930 (mid 1915: no phase), 1960-2000 (mid 1980: update)
    assert lines == ["  GPU idle 0.125 ms a step of 1.000 (2 gaps a step); the host meanwhile:",
                     "      0.090 ms     0.5 gaps/step  launch > prepare",
                     "      0.020 ms     0.5 gaps/step  update",
                     "      0.015 ms     0.5 gaps/step  (in a step, no phase)",
                     "  each phase's host time a step (nested phases inside their outer ones' too): "
                     "launch 0.300, prepare 0.125, update 0.075"]
