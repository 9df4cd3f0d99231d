"""The served path's image preprocessing on this CPU (issue #39): N chat requests, each one
1024 x 768 JPEG data: URL (ember bench serve's --dataset images, vLLM's random-mm) and text,
through InputProcessor.chat_prompt on a thread pool, as `ember serve`'s input pool runs them:
base64 and JPEG decoding, the chat template, the model's image processor, the placeholder
expansion, the hashes. Distinct images and the same image in every request, each with 1 and 2
threads (or --threads); requests per second, and wall and CPU (all threads') ms per request: on
a CPU other work shares, CPU time is the steadier measure of the work itself.

    python3 benchmarks/scripts/served_model.py --vl --tiny /tmp/vl     # the Qwen2.5-VL-7B processor files
    python3 benchmarks/scripts/image_preprocess.py /tmp/vl -n 64

Run it with PYTHONPATH at another checkout to time that one's code (before / after)."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import threading
import time

import numpy as np

from ember.bench.image_requests import random_image_url
from ember.config import EngineConfig
from ember.engine.input_processor import InputProcessor, load_engine_tokenizer


def messages(url: str, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def run(inputs: InputProcessor, urls: list[str], threads: int, text: str) -> tuple[float, float]:
    """Seconds of wall time and of this process's CPU time for all of `urls`' requests on a pool
    of `threads`, after each thread has done one request of its own image (what a served
    process's first requests pay once)."""
    import ember.multimodal.media as media

    for cache in (getattr(media, "DECODED", None), getattr(inputs.image_processor(), "cache", None)):
        if cache is not None:  # nothing carried over from the run before (a checkout without caches: none)
            cache.clear()
    rng = np.random.default_rng(threads * 1000 + len(urls))
    warm = [random_image_url(rng, 64, 48) for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def first(url: str) -> None:
        barrier.wait()  # one warm-up request on each thread
        inputs.chat_prompt(messages(url, text))

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(first, warm))
        start, cpu = time.perf_counter(), time.process_time()
        outs = list(pool.map(lambda u: inputs.chat_prompt(messages(u, text)), urls))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(o["mm_features"]) == 1 for o in outs)
    return seconds, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a Qwen2.5-VL directory (served_model.py --vl [--tiny] DIR)")
    ap.add_argument("-n", type=int, default=64, help="requests a run")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, load_format="dummy").resolve()
    inputs = InputProcessor(config, load_engine_tokenizer(config))
    text = "word " * 128
    import ember

    print(f"ember {os.path.dirname(ember.__file__)}; {platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.1f}; {args.n} requests of one "
          f"{args.width} x {args.height} JPEG")
    for shared in (False, True):
        for threads in args.threads:
            rng = np.random.default_rng([threads, int(shared)])
            one = random_image_url(rng, args.width, args.height) if shared else None
            urls = [one or random_image_url(rng, args.width, args.height) for _ in range(args.n)]
            seconds, cpu = run(inputs, urls, threads, text)
            print(f"{'same image' if shared else 'distinct images':16} threads {threads}: "
                  f"{args.n / seconds:7.1f} req/s  {seconds / args.n * 1e3:6.1f} ms/req  "
                  f"CPU {cpu / args.n * 1e3:6.1f} ms/req", flush=True)


if __name__ == "__main__":
    main()
