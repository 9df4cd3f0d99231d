"""Property-based requests from the server's own OpenAPI schema (schemathesis): for every
route, generated bodies that follow the schema and bodies that break it. No response may be
a server error, every status and body must be one the schema documents, and a body that
breaks the schema must be refused. Seeded (derandomized) and bounded: about a minute.

The server is small on purpose (max_model_len 64, n and prompts at most 2): a schema-valid
request may ask for max_tokens in the billions, and it must finish.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from servers import KEY, Server, running  # noqa: E402

pytestmark = pytest.mark.slow

# the operations routes change the server (sleep, reset the cache, profile): test_operations.py tests them
STATEFUL = ("/sleep", "/wake_up", "/start_profile", "/stop_profile", "/reset_prefix_cache", "/flush_cache")
NO_INPUT = ("/ping", "/classify", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")
EXAMPLES = 30  # a route and a mode: with the server's start, under a minute in all
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def small_server(gguf_path, tmp_path_factory):
    s = Server(gguf_path, tmp_path_factory.mktemp("schemathesis") / "server.log", "--api-key", KEY,
               "--max-model-len", "64", "--max-n", "2", "--max-prompts-per-request", "2", "--max-stop-strings", "4",
               "--max-choices", "8", "--max-logit-bias", "8")
    yield from running(s)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_generated_requests_get_documented_answers_and_never_a_server_error(small_server, mode):
    api = schemathesis.openapi.from_url(f"{small_server.url}/openapi.json")
    failures = []
    for result in api.get_all_operations():
        operation = result.ok()
        if operation.path in STATEFUL:
            continue
        if mode is GenerationMode.NEGATIVE and (operation.method.upper() == "GET" or operation.path in NO_INPUT):
            continue  # nothing to break: the route takes no input (or any string, as an id in its path)

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def check(case):
            case.call_and_validate(base_url=small_server.url, headers={"Authorization": f"Bearer {KEY}"},
                                   checks=CHECKS, timeout=60)

        try:
            check()
        except Exception as e:  # noqa: BLE001 - every operation is tried, then all failures reported
            failures.append(f"{operation.label}: {e}")
    assert not failures, "\n\n".join(failures)
