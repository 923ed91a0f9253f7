"""Fetching a model from the Hugging Face hub into the HF cache, resumably.

huggingface_hub finds what to fetch: the file list with sizes and hashes (model_info), each
file's address, ETag and commit (get_hf_file_metadata), and the cache's layout (blobs named
by ETag, snapshots linking to them). The bodies are fetched here, because since 2.x its own
download writes each attempt to a file of a random name and deletes it on failure, so a
download that was killed or lost its network started again from zero. Here a file arrives
as `blobs/<etag>.incomplete`, a later run continues it with a Range request, and:
- one progress figure covers the whole model (bytes done of the total the hub lists);
- 5xx, 408 and 429 answers, and stalls past HF_HUB_DOWNLOAD_TIMEOUT, are retried with
  backoff, keeping what arrived, then named in one line;
- every file is checked against the hash the hub lists (sha256 for LFS files, the git blob
  hash for the rest): a corrupt file is fetched once more from zero, then refused;
- a full disk is one line naming the cache, what is kept there, and the variable that moves it.

Files already in the cache are used in place and never fetched or hashed again."""
from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError, EngineError, ModelNotFound

# Config, tokenizer and safetensors: no pickles, no code.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
ATTEMPTS = 4          # per file, and for the file list
BACKOFF = 1.0         # seconds before the second attempt, doubled before each next one
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
LISTING = "its file list"

Progress = Callable[[int, int], None]      # (bytes done, bytes in all), whole model


class DownloadFailed(EngineError):
    """The hub could not be read, the disk filled, or a file did not match its hash."""


def wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in HUB_PATTERNS)


def cached(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` if every wanted file is in the HF cache, else None."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                      local_files_only=True))
    except Exception:              # not cached, or cached in part: any reason means "fetch it"
        return None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def cache_root() -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def _repo_dir(repo_id: str) -> Path:
    """The repo's folder in the HF cache (huggingface_hub's layout)."""
    return cache_root() / ("models--" + repo_id.replace("/", "--"))


def download(repo_id: str, revision: str | None = None, progress: Progress | None = None,
             attempts: int = ATTEMPTS, backoff: float = BACKOFF) -> Path:
    """The snapshot folder of `repo_id` with its config, tokenizer and safetensors, fetched
    as needed. Raises ModelNotFound, DownloadFailed or CheckpointError with one line."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import OfflineModeIsEnabled
    try:
        if constants.HF_HUB_OFFLINE or _truthy(os.environ.get("HF_HUB_OFFLINE")):   # set after import, too
            raise OfflineModeIsEnabled()
        info = _retrying(lambda: HfApi().model_info(repo_id, revision=revision, files_metadata=True),
                         repo_id, LISTING, attempts, backoff)
    except OfflineModeIsEnabled:
        hit = cached(repo_id, revision)
        if hit is None:
            raise ModelNotFound(f"{repo_id}: not in the local cache and HF_HUB_OFFLINE is set (offline); "
                                "download it when online, or give a local path") from None
        return hit
    files = [s for s in info.siblings or [] if wanted(s.rfilename)]
    if not any(s.rfilename.endswith(".safetensors") for s in files):
        if any(s.rfilename.lower().endswith(".gguf") for s in info.siblings or []):
            raise ModelNotFound(f"{repo_id}: a repo of GGUF files; name one quant as {repo_id}:QUANT "
                                f"(for example {repo_id}:Q4_K_M)")
        raise ModelNotFound(f"{repo_id}: the hub lists no .safetensors weights for it (localchat reads "
                            "safetensors and GGUF only); pick a repo that has them, or a local .gguf")
    return _fetch(repo_id, revision, info, files, progress, attempts, backoff)


def _fetch(repo_id: str, revision: str | None, info, files: list, progress: Progress | None, attempts: int,
           backoff: float) -> Path:
    """`files` (hub siblings) into the cache at the listed commit; the snapshot folder."""
    total = sum(s.size or 0 for s in files)
    done, fetched = 0, False
    snapshot = None
    for s in files:
        path, got = _one_file(repo_id, info.sha, s, done, total, progress, attempts, backoff)
        done += s.size or 0
        fetched |= got
        if progress and fetched:        # a model that is all in the cache shows no progress at all
            progress(done, total)
        snapshot = Path(str(path)[:-len(s.rfilename)])
    _remember_revision(repo_id, revision or "main", info.sha)
    return snapshot


# a split GGUF's parts: name-00001-of-00003.gguf (llama.cpp's gguf-split)
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def quant_files(repo_id: str, names: list[str], quant: str) -> list[str]:
    """The file or split parts of one quant of a GGUF repo (llama.cpp's `repo:quant`): the
    .gguf names holding `quant` as a whole tag, any case (Q4_K matches neither Q4_K_M nor
    Q4_K_S); a vision projector (mmproj) is not a quant. One line where none or several match."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower())
    tag = re.compile(rf"(^|[-_./ ]){re.escape(quant.upper())}([-./ ]|$)")
    hit = [n for n in ggufs if tag.search(n.upper())]
    groups = sorted({SPLIT.sub(".gguf", n) for n in hit})
    if not hit:
        held = ", ".join(sorted({SPLIT.sub(".gguf", n) for n in ggufs})[:12]) or "no .gguf file"
        raise ModelNotFound(f"{repo_id}: no {quant} file in it (it holds {held}); name one of its quants")
    if len(groups) > 1:
        raise ModelNotFound(f"{repo_id}: {quant} names {len(groups)} files ({', '.join(groups)}); "
                            "name the quant as its file spells it")
    m = SPLIT.search(hit[0])
    if m and len(hit) != int(m.group(2)):
        raise ModelNotFound(f"{repo_id}: {groups[0]} is split in {int(m.group(2))} parts but the repo holds "
                            f"{len(hit)}; the repo is incomplete")
    return hit


def download_gguf(repo_id: str, quant: str, revision: str | None = None, progress: Progress | None = None,
                  attempts: int = ATTEMPTS, backoff: float = BACKOFF) -> Path:
    """The path of one quant of a GGUF repo (its first part where split), fetched as download()
    fetches: from the cache when there, else resumably, each file checked against its hash."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import OfflineModeIsEnabled
    try:
        if constants.HF_HUB_OFFLINE or _truthy(os.environ.get("HF_HUB_OFFLINE")):
            raise OfflineModeIsEnabled()
        info = _retrying(lambda: HfApi().model_info(repo_id, revision=revision, files_metadata=True),
                         repo_id, LISTING, attempts, backoff)
    except OfflineModeIsEnabled:
        hit = cached_gguf(repo_id, quant, revision)
        if hit is None:
            raise ModelNotFound(f"{repo_id}:{quant}: not in the local cache and HF_HUB_OFFLINE is set (offline); "
                                "download it when online, or give a local path") from None
        return hit
    names = quant_files(repo_id, [s.rfilename for s in info.siblings or []], quant)
    files = [s for s in info.siblings if s.rfilename in names]
    return _fetch(repo_id, revision, info, files, progress, attempts, backoff) / names[0]


def cached_gguf(repo_id: str, quant: str, revision: str | None = None) -> Path | None:
    """One quant of a GGUF repo where the cache holds all of it (every part), else None."""
    ref = _repo_dir(repo_id) / "refs" / (revision or "main")
    try:
        sha = ref.read_text().strip() if ref.is_file() else revision
        snap = _repo_dir(repo_id) / "snapshots" / (sha or "")
        if not sha or not snap.is_dir():
            return None
        names = quant_files(repo_id, [p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf")], quant)
    except (OSError, ModelNotFound):
        return None
    return snap / names[0] if all((snap / n).is_file() for n in names) else None


def _remember_revision(repo_id: str, revision: str, sha: str) -> None:
    """Files are fetched by commit, so that a push mid-download cannot mix two versions;
    the cache's ref file then says which commit `revision` names, for offline use."""
    if revision == sha:
        return
    refs = _repo_dir(repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / revision).write_text(sha)


def _one_file(repo_id: str, sha: str, sibling, before: int, total: int, progress: Progress | None,
              attempts: int, backoff: float) -> tuple[Path, bool]:
    """(the file in the cache, whether it was fetched now)."""
    name = sibling.rfilename
    hit = _cached_file(repo_id, sha, name)
    if hit is not None:
        return hit, False
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    meta = _retrying(lambda: get_hf_file_metadata(hf_hub_url(repo_id, name, revision=sha)),
                     repo_id, name, attempts, backoff)
    repo_dir = _repo_dir(repo_id)
    blob = repo_dir / "blobs" / meta.etag
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(blob.name + ".incomplete")
    bad = None
    # huggingface_hub's own lock for this blob: its downloads and ours wait for each other
    with _locked(cache_root() / ".locks" / repo_dir.name / f"{meta.etag}.lock"):
        if not blob.exists():
            for tries in range(2):          # a file that fails its hash is fetched once more, from zero
                _retrying(lambda: _transfer(meta.location, part, sibling.size, before, total, progress),
                          repo_id, name, attempts, backoff)
                bad = _mismatch(part, sibling)
                if bad is None:
                    os.replace(part, blob)
                    break
                part.unlink()
            else:
                raise CheckpointError(f"{repo_id}: {name} does not match the hub's {bad} after two downloads "
                                      f"(it was removed from {cache_root()}); try again later, or report it "
                                      "to the repo")
    link = repo_dir / "snapshots" / sha / name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    try:
        link.symlink_to(os.path.relpath(blob, link.parent))
    except OSError:                         # no symlinks here (some Windows setups): a copy
        import shutil
        shutil.copyfile(blob, link)
    return link, True


def _cached_file(repo_id: str, sha: str, name: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    hit = try_to_load_from_cache(repo_id, name, revision=sha)
    return Path(hit) if isinstance(hit, str) else None


class _locked:
    """An exclusive lock on `path` (two fetching one file: the second waits, then finds it
    in place). The file stays, as huggingface_hub's do: removing it would race a waiter."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()
        return False


def _transfer(url: str, part: Path, size: int | None, before: int, total: int, progress: Progress | None) -> None:
    """Append the rest of `url` to `part`, from the bytes it already holds (a Range request);
    a server that ignores the range sends the whole file, which replaces them."""
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if size is not None and have == size:
        return
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        hf_raise_for_status(response)
        mode = "ab" if have and response.status_code == 206 else "wb"
        if mode == "wb":
            have = 0
        with open(part, mode) as fh:
            for chunk in response.iter_bytes():         # as it arrives, not in buffered megabytes
                fh.write(chunk)
                fh.flush()              # on disk as it arrives: a kill loses only what is in flight
                have += len(chunk)
                if progress:
                    progress(before + have, total)
    if size is not None and have != size:
        raise OSError(f"Consistency check failed: {have} of {size} bytes arrived")


def _mismatch(path: Path, sibling) -> str | None:
    """None if the file is what the hub lists; else which check it failed."""
    size = path.stat().st_size
    if sibling.size is not None and size != sibling.size:
        return f"size ({size:,} bytes, listed {sibling.size:,})"
    if sibling.lfs is not None and sibling.lfs.sha256:
        h = hashlib.sha256()
        want, what = sibling.lfs.sha256, "sha256"
    elif sibling.blob_id:
        h = hashlib.sha1()
        h.update(f"blob {size}\0".encode())
        want, what = sibling.blob_id, "git blob hash"
    else:
        return None
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return None if h.hexdigest() == want else what


def _retrying(call, repo_id: str, what: str, attempts: int, backoff: float):
    """`call()`, again after backoff on a transient failure; one line when it keeps failing."""
    httpx = _httpx()
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)
    wait = backoff
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except GatedRepoError:
            raise ModelNotFound(f"{repo_id}: gated on the hub; accept its licence on huggingface.co "
                                "and log in with `hf auth login`") from None
        except RepositoryNotFoundError:
            raise ModelNotFound(f"{repo_id}: no such model on the Hugging Face hub (or it is private); "
                                "check the name, or give a local path") from None
        except RevisionNotFoundError:
            raise ModelNotFound(f"{repo_id}: that revision is not on the hub") from None
        except OfflineModeIsEnabled:
            raise
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status not in RETRY_STATUS:
                raise DownloadFailed(f"{repo_id}: the hub refused {what} (HTTP {status}); "
                                     "check the name and your access (`hf auth login`)") from None
            reason = f"HTTP {status}"
        except (httpx.TimeoutException, httpx.TransportError, LocalEntryNotFoundError) as exc:
            reason = _why_unreachable(exc)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DownloadFailed(
                    f"{repo_id}: no space left in {cache_root()} while fetching {what} ({_kept(repo_id)} kept "
                    "there; the next try resumes it); free some space, or set HF_HUB_CACHE to a folder "
                    "on a larger disk") from None
            if "Consistency check failed" not in str(exc):     # a short body: resumed on the next try
                raise DownloadFailed(f"{repo_id}: fetching {what} failed ({exc})") from None
            reason = "the file arrived short"
        if attempt == attempts:
            kept = (f"; what arrived is kept in {cache_root()} and the next try resumes it"
                    if what != LISTING else "")
            raise DownloadFailed(f"{repo_id}: fetching {what} failed {attempts} times ({reason}){kept}; "
                                 "check the network (or HF_ENDPOINT, for a mirror)") from None
        time.sleep(wait)
        wait *= 2


def _httpx():
    """The HTTP library huggingface_hub is built on: httpx2 in its 2.x releases, httpx before."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


def _why_unreachable(exc: BaseException) -> str:
    """A few words on why the hub gave nothing: the timeout, or the first sentence of the
    underlying error (huggingface_hub wraps it in "cannot find the requested files")."""
    httpx = _httpx()
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, httpx.TimeoutException):
        return f"no data for {os.environ.get('HF_HUB_DOWNLOAD_TIMEOUT', '10')} s"
    if isinstance(cause, httpx.ConnectError):
        return "the hub cannot be reached"
    first = str(cause).split(". ")[0].strip().rstrip(".")
    return first[:160] or type(cause).__name__


def _kept(repo_id: str) -> str:
    """How many bytes of this repo are in the cache, complete or partial, as text."""
    folder = _repo_dir(repo_id) / "blobs"
    n = sum(p.stat().st_size for p in folder.glob("*")) if folder.is_dir() else 0
    return f"{n / 1e6:,.1f} MB"
