"""Low-priority long requests fill a tight KV pool, then high-priority ones arrive: how long
each class takes, and how many preemptions the server made.  Usage: priority_load.py ADDRESS"""

import asyncio
import json
import statistics
import sys
import time

from ringleader.ipc.client.async_client import AsyncClient

N_LOW, N_HIGH, PROMPT, NEW = 16, 8, 64, 300


async def one(client, k, priority):
    start = time.perf_counter()
    stream = await client.generate(
        prompt_ids=[3 + (7 * k + i) % 240 for i in range(PROMPT)],
        max_tokens=NEW,
        temperature=0.0,
        ignore_eos=True,
        priority=priority,
    )
    first = None
    async for _ in stream:
        first = first or time.perf_counter()
    done = await stream.wait()
    assert done.finish_reason == "length" and done.completion_tokens == NEW, done
    return first - start, time.perf_counter() - start


async def main(address):
    async with AsyncClient(address, timeout=600) as client:
        before = (await client.stats())["device"]["preemptions"]
        low = [asyncio.create_task(one(client, k, 0)) for k in range(N_LOW)]
        await asyncio.sleep(1.0)  # the low ones hold the pool
        high = [asyncio.create_task(one(client, 100 + k, 10)) for k in range(N_HIGH)]
        high_t, low_t = await asyncio.gather(*high), await asyncio.gather(*low)
        after = (await client.stats())["device"]["preemptions"]

    def summary(times):
        return {
            "ttft_s_p50": round(statistics.median(t for t, _ in times), 3),
            "e2e_s_p50": round(statistics.median(e for _, e in times), 3),
            "e2e_s_max": round(max(e for _, e in times), 3),
        }

    print(json.dumps({"high": summary(high_t), "low": summary(low_t), "preemptions": after - before}))


asyncio.run(main(sys.argv[1]))
