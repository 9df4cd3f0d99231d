"""Models named by a Hugging Face Hub id, fetched with huggingface_hub into its cache.

    org/name               an HF model repo: config, tokenizer, generation config and weights
                           (the shards the safetensors index names; pytorch_model*.bin only
                           where the repo has no safetensors)
    org/name-GGUF:Q4_K_M   one .gguf file of a GGUF repo, picked by its quant tag (llama.cpp's
                           convention); a GGUF-only repo with one .gguf needs no tag

Only the files ember reads are fetched. huggingface_hub reads its own settings: the cache
(HF_HOME, HF_HUB_CACHE), HF_TOKEN, HF_ENDPOINT, progress bars; `download_dir` replaces the
cache folder. With HF_HUB_OFFLINE=1 (read when a model is resolved), or when the hub
cannot be reached, the repo is taken from the cache as it is; nothing is listed online.
Every failure is a ValueError that says what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from ember.loader.safetensors import PT_INDEX, PT_PATTERN, SAFETENSORS_INDEX

logger = logging.getLogger(__name__)

# org/name with HF's characters, then an optional :TAG
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?")
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)

# what ember reads besides the weights (config, tokenizer, chat template, sampling defaults, a
# vision-language model's processor)
METADATA_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "chat_template.json", "chat_template.jinja", "processor_config.json",
    "preprocessor_config.json",
)


@dataclass(frozen=True)
class HubId:
    repo_id: str
    tag: str | None = None  # a GGUF quant tag, as in org/name-GGUF:Q4_K_M


def parse_hub_id(model: str) -> HubId | None:
    """`org/name` or `org/name:TAG` as a HubId; None for anything else (a path, say)."""
    m = _HUB_ID.fullmatch(model)
    if m is None or ".." in m["repo"] or m["repo"].endswith((".", "-")):
        return None
    return HubId(m["repo"], m["tag"])


def resolve_hub_model(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local HF model directory or .gguf file for the hub id `model`, fetched if needed."""
    hub = _parse_or_raise(model)
    with _hub_errors(model, revision, download_dir):
        repo = _Repo.open(hub.repo_id, revision, download_dir)
        if hub.tag is not None:
            return repo.fetch([repo.pick_gguf(hub.tag)])[0]
        if "config.json" not in repo.files and _gguf_files(repo.files):
            return repo.fetch([_only_gguf(repo.files, hub.repo_id)])[0]
        if "config.json" not in repo.files:
            raise ValueError(f"{hub.repo_id} has no config.json{repo.where}: it is not a model ember can load "
                             "(an HF model repo needs config.json and *.safetensors)")
        weights = choose_weight_files(repo.files, repo.read_json)
        if not weights:
            raise ValueError(f"{hub.repo_id} holds no weights ember reads{repo.where}: ember loads *.safetensors "
                             "or pytorch_model*.bin; for a GGUF repo add the quant, as in org/name-GGUF:Q4_K_M")
        repo.fetch([f for f in METADATA_FILES if f in repo.files] + weights)
        return repo.folder


def resolve_hub_tokenizer(tokenizer: str, download_dir: str | None = None) -> Path:
    """A local tokenizer directory or .gguf file for the hub id `tokenizer` (no weights fetched)."""
    hub = _parse_or_raise(tokenizer)
    with _hub_errors(tokenizer, None, download_dir):
        repo = _Repo.open(hub.repo_id, None, download_dir)
        if hub.tag is not None:
            return repo.fetch([repo.pick_gguf(hub.tag)])[0]
        if "tokenizer.json" not in repo.files and "tokenizer.model" not in repo.files:
            if _gguf_files(repo.files):
                return repo.fetch([_only_gguf(repo.files, hub.repo_id)])[0]
            raise ValueError(f"{hub.repo_id} has no tokenizer.json or tokenizer.model{repo.where}: "
                             "pass a repo, directory or .gguf file that holds the tokenizer")
        repo.fetch([f for f in METADATA_FILES if f in repo.files])
        return repo.folder


def choose_weight_files(files: Sequence[str], read_json: Any) -> list[str]:
    """The weight files to fetch from a repo's file list: the safetensors index and the shards
    it names (a consolidated.safetensors beside them is left out), else every top-level
    .safetensors, else pytorch_model*.bin (through its index where there is one).
    `read_json(name)` gives a listed JSON file's content."""
    top = {f for f in files if "/" not in f}
    for index, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (PT_INDEX, PT_PATTERN)):
        if index in top:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map: the repo's index is broken")
            return [index, *sorted(set(weight_map.values()))]
        matched = sorted(f for f in top if fnmatchcase(f, pattern))
        if matched:
            return matched
    return []


def pick_gguf(files: Sequence[str], tag: str, repo_id: str) -> str:
    """The one .gguf file whose name carries the quant tag `tag` (any case), or the file
    named `tag`; ValueError listing the .gguf files when none or several match."""
    ggufs = _gguf_files(files)
    if not ggufs:
        raise ValueError(f"{repo_id} holds no .gguf file: drop ':{tag}' to load it as an HF model repo")
    matches = [f for f in ggufs if _carries_tag(f, tag)]
    whole = [f for f in matches if not _SPLIT_GGUF.search(f)]
    if len(whole) == 1:
        return whole[0]
    if not matches:
        raise ValueError(f"no .gguf file in {repo_id} matches the tag {tag!r}; its .gguf files: "
                         f"{', '.join(ggufs)}: pass one of their quant tags (as in {repo_id}:Q4_K_M)")
    if not whole:
        raise ValueError(f"{tag!r} in {repo_id} is a GGUF split into {len(matches)} files ({', '.join(matches)}): "
                         "ember loads one .gguf file; merge them with llama.cpp's `llama-gguf-split --merge` "
                         "and pass the merged file's path, or pick another quant")
    raise ValueError(f"the tag {tag!r} matches {len(whole)} .gguf files in {repo_id}: {', '.join(whole)}: "
                     "pass a longer tag or the full file name")


def _carries_tag(path: str, tag: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    if name.lower() == tag.lower():
        return True
    stem = _SPLIT_GGUF.sub("", name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    # the tag stands alone: Q4_K matches neither Q4_K_M nor IQ4_K
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", stem, re.IGNORECASE) is not None


def _gguf_files(files: Sequence[str]) -> list[str]:
    """The repo's model .gguf files (multimodal projectors, mmproj-*.gguf, left out)."""
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and not f.rsplit("/", 1)[-1].lower().startswith("mmproj"))


def _only_gguf(files: Sequence[str], repo_id: str) -> str:
    ggufs = _gguf_files(files)
    if len(ggufs) == 1 and not _SPLIT_GGUF.search(ggufs[0]):
        return ggufs[0]
    raise ValueError(f"{repo_id} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}): pick one by its quant tag, "
                     f"as in {repo_id}:Q4_K_M")


def _parse_or_raise(model: str) -> HubId:
    hub = parse_hub_id(model)
    if hub is None:
        raise ValueError(f"{model!r} is not a Hugging Face Hub id: pass org/name or org/name-GGUF:QUANT")
    return hub


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, as set now (huggingface_hub itself reads it once, at import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return env in {"1", "ON", "YES", "TRUE"} or constants.HF_HUB_OFFLINE


class _Repo:
    """One repo at one revision: its file list, read online, or from the cached snapshot
    when offline; `fetch` brings files into the cache (online) or checks they are there."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str | None, files: list[str],
                 cached: Path | None, files_cached_only: bool = False) -> None:
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, cache_dir
        self.files = files
        self.offline = cached is not None  # taken from the cache, as it is
        self.files_cached_only = files_cached_only  # the list is the cached folder's, not the repo's
        self._folder = cached

    @property
    def where(self) -> str:
        return " (in the local cache; offline)" if self.offline else ""

    @classmethod
    def open(cls, repo_id: str, revision: str | None, cache_dir: str | None) -> _Repo:
        from huggingface_hub import HfApi, errors

        if not hub_offline():
            try:
                files = HfApi().list_repo_files(repo_id, revision=revision)
                return cls(repo_id, revision, cache_dir, list(files), None)
            except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError):
                raise
            except Exception as e:  # the hub cannot be reached: what the cache holds may do
                logger.warning("the Hugging Face Hub cannot be reached (%s: %s): looking for %s in the local cache",
                               type(e).__name__, e, repo_id)
        # no pattern: huggingface_hub checks no file; ember checks those it picks, in fetch()
        folder = Path(cls._snapshot(repo_id, revision, cache_dir, local_files_only=True, allow_patterns=[]))
        files = _cached_file_list(repo_id, revision, cache_dir)
        if files is not None:
            return cls(repo_id, revision, cache_dir, files, folder)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        return cls(repo_id, revision, cache_dir, files, folder, files_cached_only=True)

    def pick_gguf(self, tag: str) -> str:
        try:
            return pick_gguf(self.files, tag, self.repo_id)
        except ValueError as e:
            if not self.files_cached_only:
                raise
            raise ValueError(f"{e} (offline: the files listed are those in the local cache)") from None

    @property
    def folder(self) -> Path:
        """The snapshot folder (online: once fetch() has run)."""
        assert self._folder is not None, "fetch() first"
        return self._folder

    def fetch(self, names: list[str]) -> list[Path]:
        """The local paths of `names` (files of this repo), downloaded where needed."""
        if not self.offline:
            logger.info("fetching %d file(s) of %s from the Hugging Face Hub", len(names), self.repo_id)
            self._folder = Path(self._snapshot(self.repo_id, self.revision, self.cache_dir,
                                               allow_patterns=[_literal(n) for n in names]))
        paths = [self.folder / n for n in names]
        missing = [n for n, p in zip(names, paths) if not p.is_file()]
        if missing:
            raise ValueError(f"{self.repo_id} is in the local cache without {', '.join(missing)}: unset "
                             "HF_HUB_OFFLINE and connect to the Hugging Face Hub once to fetch them")
        return paths

    def read_json(self, name: str) -> dict[str, Any]:
        path = self.folder / name if self.offline else self._download(name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{name} of {self.repo_id} is not readable JSON ({e})") from None

    def _download(self, name: str) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, name, revision=self.revision, cache_dir=self.cache_dir))

    @staticmethod
    def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, **kwargs: Any) -> str:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, **kwargs)


def _cached_file_list(repo_id: str, revision: str | None, cache_dir: str | None) -> list[str] | None:
    """The repo's files at this revision as listed when it was last fetched online (the tree
    listing huggingface_hub caches), so that offline the same files are picked as online;
    None where there is no such listing (older huggingface_hub, or files placed by hand)."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:
        return None
    try:
        return sorted(f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir))
    except Exception:  # CachedRepoTreeNotFoundError, or a listing it cannot read
        return None


def _literal(name: str) -> str:
    """An fnmatch pattern that matches `name` alone."""
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextlib.contextmanager
def _hub_errors(model: str, revision: str | None, cache_dir: str | None) -> Iterator[None]:
    """huggingface_hub's errors, as ValueErrors that say what to do."""
    try:
        from huggingface_hub import constants, errors
    except ImportError:
        raise ValueError(f"{model!r} looks like a Hugging Face Hub id, and fetching it needs huggingface_hub: "
                         "pip install huggingface_hub (or pass a local path)") from None
    at = f" at revision {revision!r}" if revision else ""
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        yield
    except errors.GatedRepoError:
        raise ValueError(f"{model!r} is a gated repo on the Hugging Face Hub: accept its terms on "
                         "https://huggingface.co, then log in (`hf auth login`) or set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"{model!r} is neither a local path nor a model repo on the Hugging Face Hub "
                         "(or it is private: log in with `hf auth login` or set HF_TOKEN): check the name") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{model!r} has no revision {revision!r} on the Hugging Face Hub: pass a branch, tag "
                         "or commit hash that exists") from None
    except errors.LocalEntryNotFoundError as e:
        offline = "HF_HUB_OFFLINE is set" if hub_offline() else "the Hugging Face Hub cannot be reached"
        detail = f" ({e})" if isinstance(e, getattr(errors, "IncompleteSnapshotError", ())) else ""
        raise ValueError(f"{model!r}{at} is not in the Hugging Face cache ({cache}) and {offline}{detail}: "
                         "connect once (unset HF_HUB_OFFLINE) to download it, point HF_HUB_CACHE or "
                         "download_dir at a cache that holds it, or pass a local path") from None
    except errors.HFValidationError as e:
        raise ValueError(f"{model!r}{at}: {e}") from None
    except errors.HfHubHTTPError as e:
        raise ValueError(f"fetching {model!r}{at} from the Hugging Face Hub failed: {e}") from None
