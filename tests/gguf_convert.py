"""llama.cpp's own HF -> GGUF converter, for tests: GGUF files made the way llama.cpp users
make them, from tiny random HF models.

The converter (convert_hf_to_gguf.py, its conversion/ package and its own gguf-py) comes
from the llama-cpp-python source package on PyPI, fetched once into the cache folder:

    path = convert(hf_dir, tmp / "model.gguf", outtype="f32")   # or "f16", "q8_0"

The tests use it through the `gguf_convert` fixture (tests/conftest.py), which caches each
converted file for the session and skips the test where the converter cannot be fetched.
Each file the converter writes is also kept under ember's cache dir, named by a hash of what
the converter reads (the HF directory's name and every file in it, the flags) and of the
versions that write it: the same tiny seeded model is converted once, not again on each run
(a conversion is a process that imports torch: 3-6 s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ember.loader.default_model import PackageFetchError, cache_dir, pip_download

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")


class ConverterUnavailable(RuntimeError):
    """The converter could not be fetched (no package index, or an unexpected file)."""


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/, fetched the first time."""
    target = cache_dir() / f"llama.cpp-{VERSION}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            sdist = pip_download(f"llama-cpp-python=={VERSION}", SDIST, SDIST_SHA256, Path(tmp), source=True)
        except PackageFetchError as e:
            raise ConverterUnavailable(f"{e}; put convert_hf_to_gguf.py, conversion/ and gguf-py/ from llama.cpp "
                                       f"into {target} to run these tests offline") from None
        unpacked = Path(tmp) / "llama.cpp"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.removeprefix(_ROOT)
                if rel != m.name and rel.startswith(_WANTED):
                    m.name = rel
                    members.append(m)
            tar.extractall(unpacked, members=members, filter="data")
        unpacked.replace(target)  # atomic: a killed fetch never leaves half a converter
    return target


def convert(hf_dir: Path, outfile: Path, outtype: str = "f32", vocab_only: bool = False, mmproj: bool = False) -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py on `hf_dir` (config.json, safetensors, tokenizer
    files); return `outfile`. vocab_only: write the tokenizer and metadata, no tensors; mmproj:
    write the vision tower and projector of a vision-language model (--mmproj), not its text model."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    kept = cache_dir() / "converted" / f"{_conversion_key(Path(hf_dir), outtype, vocab_only, mmproj)}.gguf"
    if kept.is_file():
        shutil.copyfile(kept, outfile)  # a copy: a test may write its own file next to it, never this one
        return outfile
    script = converter_dir() / "convert_hf_to_gguf.py"
    cmd = [sys.executable, str(script), str(hf_dir), "--outfile", str(outfile), "--outtype", outtype]
    if vocab_only:
        cmd.append("--vocab-only")
    if mmproj:
        cmd.append("--mmproj")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not outfile.is_file():
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {done.returncode}):\n{tail}")
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=kept.parent, suffix=".part", delete=False) as tmp:  # written aside, renamed
        with open(outfile, "rb") as f:
            shutil.copyfileobj(f, tmp)
    os.replace(tmp.name, kept)
    return outfile


def _conversion_key(hf_dir: Path, outtype: str, vocab_only: bool, mmproj: bool) -> str:
    """A hash of all the converter reads and of what writes it: the directory's name (the GGUF's
    general.name comes from it), each file's path and bytes, the flags, the converter's version,
    and the versions of Python and of the libraries it computes with."""
    from importlib.metadata import version

    h = hashlib.sha256(repr((VERSION, outtype, vocab_only, mmproj, hf_dir.name, sys.version,
                             [version(p) for p in ("torch", "numpy", "transformers", "safetensors")])).encode())
    for f in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(hf_dir)).encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as data:
            for chunk in iter(lambda: data.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def rewrite_metadata(src: Path, dst: Path, **overrides: str) -> Path:
    """The GGUF file `src` written again by gguf-py as `dst`, with `overrides` of its metadata
    ({key: str value}): a file as a converter of other keys would write it."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in overrides:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, value in overrides.items():
        writer.add_string(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
