"""benchmarks/scripts/profile_gpu_steps.py --images on the CPU: chat prompts of one random image
and text (ember bench serve's --dataset images) through LLM.chat on a tiny Qwen2.5-VL directory
(served_model.py --vl --tiny, dummy weights); a line for each step before the window and in it,
their tokens (the first step the prompts' prefills), then the window's summary and top ops."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks" / "scripts"


def test_images_mode_prints_each_steps_wall_and_kernel_time(tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    model = tmp_path / "vl"
    subprocess.run([sys.executable, str(SCRIPTS / "served_model.py"), "--vl", "--tiny", str(model)], check=True,
                   env=env)
    done = subprocess.run([sys.executable, str(SCRIPTS / "profile_gpu_steps.py"), str(model), "--images",
                           "--num-prompts", "2", "--image-size", "56x56", "--input-len", "8", "--output-len", "8",
                           "--skip", "1", "--steps", "3", "--top", "3", "--max-num-batched-tokens", "4096"],
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
