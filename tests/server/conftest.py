"""The main server (servers.py), for the modules that do not start their own: `server`, one
`ember serve` on the default model with the API key for the whole run, and `client`, the official
`openai` client on it. `still_serving` is not autouse: a module opts in with
`pytestmark = pytest.mark.usefixtures("still_serving")`.

servers.py is imported inside the fixtures, not here: it skips without openai, httpx,
fastapi or uvicorn, and a skip at import here would skip (or, for a file named on the
command line, fail) every module in this directory, those that need none of them too."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def traces(tmp_path_factory):
    """Where the main server's profiler writes (--profiler-dir: test_operations.py)."""
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="session")
def server(gguf_path, tmp_path_factory, traces):
    """One server for the whole run (each start costs seconds): a test leaves it as it found
    it (no block held, it still answers: `still_serving`), and reads counters as deltas."""
    from servers import serving

    yield from serving(gguf_path, tmp_path_factory, "--profiler-dir", str(traces))


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture
def still_serving(request):
    """After every test that used the main server: it still answers, and holds no block."""
    yield
    if "server" in request.fixturenames:
        from servers import FRANCE, MODEL

        server = request.getfixturevalue("server")
        if server.proc.poll() is None:
            out = server.client().completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0)
            assert out.choices[0].text == " Paris."
            server.wait_idle()
