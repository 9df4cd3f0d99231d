"""N streaming /v1/completions at RATE/s over 4 shared ~460-word prefixes, 64 tokens out."""
import asyncio
import random
import sys
import time

import httpx

N, RATE, PORT = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
random.seed(0)
words = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly above".split()
prefixes = [" ".join(random.choice(words) for _ in range(400)) for _ in range(4)]
async def one(client, i):
    prompt = prefixes[i % 4] + " " + " ".join(random.choice(words) for _ in range(60))
    body = {"model": "SmolLM2-135M-Instruct-Q4_1", "prompt": prompt, "max_tokens": 64,
            "stream": True, "ignore_eos": True, "temperature": 0}
    n = 0
    async with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
    return n
async def main():
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        t0 = time.perf_counter()
        for i in range(N):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(random.expovariate(RATE))
        chunks = await asyncio.gather(*tasks)
        print(f"{N} requests, {sum(chunks)} chunks, {time.perf_counter()-t0:.1f} s")
asyncio.run(main())
