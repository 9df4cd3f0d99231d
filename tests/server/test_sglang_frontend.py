"""The real `sglang` frontend (`sgl.RuntimeEndpoint`) against `ember serve`'s native API:
SGLang's own frontend test programs and a few-shot QA, decode_int and parallel decoding
(sglang_frontend_programs.py, in a process of its own), checked for shape and validity on
the 135M model (whose answers need not be right), and the few-shot answers against
ember.lang's on the same server.

Skipped unless `sglang` is installed. Its wheel lists torch and CUDA packages as
dependencies; the frontend needs none of them beyond this environment's torch, so install it
without: `pip install --no-deps sglang==0.5.23 pybase64 msgspec IPython traitlets`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import KEY
from sglang_frontend_programs import few_shot_qa

import ember.lang as lang

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("pybase64") is None:
    pytest.skip("the sglang frontend is not installed (see the module docstring)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("still_serving")


def test_sglangs_frontend_runs_its_programs_on_ember(server):
    script = Path(__file__).with_name("sglang_frontend_programs.py")
    done = subprocess.run([sys.executable, str(script), server.url, KEY], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ran"] == ["test_select", "test_mt_bench", "test_decode_json_regex", "test_regex", "test_dtype_gen",
                          "test_stream"]
    assert len(out["answers"]) == 3 and all("\n" not in a for a in out["answers"])
    int(out["hours"]), int(out["days"])
    assert len(out["details"]) == 3 and isinstance(out["summary"], str)
    # ember.lang's frontend on the same server: the same text tokenized once by each, the same answers
    questions = [{"question": f"What is the capital of {c}?"} for c in ("Japan", "Spain", "Egypt")]
    ours = few_shot_qa(lang).run_batch(questions, backend=lang.RuntimeEndpoint(server.url, api_key=KEY))
    assert [s["answer"] for s in ours] == out["answers"]
