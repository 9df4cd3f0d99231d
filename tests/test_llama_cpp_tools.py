"""tests/llama_cpp_tools.py finds llama.cpp where the peer script builds it on each CPU kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp_tools import VERSION, build_dir, tool

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama-cpp"


def test_the_build_folder_follows_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_PEERS", str(tmp_path))
    home = tmp_path / f"llama.cpp-{VERSION}"
    assert build_dir("flags\t\t: fpu avx2 avx512f avx512_vnni") == home / "build"
    assert build_dir("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8") == home / "build-noamx"
    assert build_dir("flags\t\t: fpu amx_tiles") == home / "build"  # a whole flag, not a prefix
    monkeypatch.setenv("EMBER_LLAMA_SERVER", "/opt/llama-server")
    assert tool("llama-server", "EMBER_LLAMA_SERVER") == Path("/opt/llama-server")
    monkeypatch.delenv("EMBER_LLAMA_SERVER")
    assert tool("llama-server", "EMBER_LLAMA_SERVER") == build_dir() / "bin" / "llama-server"


def test_the_rule_is_the_peer_script_s():
    """The script chooses build-noamx on a CPU that lists amx_tile: the same rule as build_dir."""
    if not PEER_SCRIPT.is_file():
        pytest.skip(f"no peer script at {PEER_SCRIPT} (a user's clone has none)")
    text = PEER_SCRIPT.read_text()
    assert "grep -qw amx_tile /proc/cpuinfo" in text and "BUILD=build-noamx" in text and "BIN=$HOME_DIR/$BUILD/bin" in text
