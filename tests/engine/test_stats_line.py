"""The periodic stats line: throughput and state, with the prefix-cache hit rate over the window."""

import logging
import time

from ember.engine.stats import EngineStats, IterationStats, LoggingStatLogger


def test_the_stats_line_gives_the_prefix_cache_hit_rate_of_its_window(caplog):
    stat_logger = LoggingStatLogger(interval=0.2)
    stats = EngineStats(num_running=3, num_waiting=1, num_kv_blocks=100, num_kv_blocks_in_use=25)
    with caplog.at_level(logging.INFO, logger="ember.stats"):
        for _ in range(8):  # 8 steps 0.04 s apart: one window of >= 0.2 s, then a line
            stat_logger.record(stats, IterationStats(num_generation_tokens=3, prefix_cache_queries=100,
                                                     prefix_cache_hits=75))
            time.sleep(0.04)
            if caplog.records:
                break
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "running: 3, waiting: 1, KV cache: 25.0%, prefix cache hit rate: 75.0%, preemptions: 0" in line
