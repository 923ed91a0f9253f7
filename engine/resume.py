"""Conversations that resume warm: a chat's KV cache and recurrent state kept on disk, so
reopening it (the chat UI, `--continue`, a server request with the same prefix) prefills
only the new tokens instead of the whole conversation.

One safetensors file per entry (tensors only, nothing a load could execute). It holds the
token ids the cache holds, their keys and values, a hybrid's recurrent states (now and at
the turn checkpoint, engine/cache.py), and the last turn's text and ids: a generated answer
need not re-tokenize to the ids the model produced, so a resumed chat continues from the
same ids the chat that never closed would.

An entry's name says what it may be used for, `<model>-<how>-<n>-<prefix>.safetensors`:
- model: the checkpoint's identity (its config and its weight files' names, sizes and
  mtimes): weights changed since, and the entry never matches (`localchat models prune`
  removes it);
- how: how the cache was computed (profile, weights format, dtype, device, kernel build,
  cache layout);
- n and prefix: the number of tokens and a hash of exactly those ids.
A prompt takes the entry of the same model and how that shares the longest prefix with it,
as far as the cache can go back (keys and values anywhere, a recurrent state to its turn
checkpoint): what a cache kept in memory would give the next turn. It is used only when
every tensor's crc32 is the one written with it. Anything else (an older format, a truncated or altered file, another layout) is
deleted and the prompt prefilled as if there had been none.

The store holds at most `budget` bytes and never more than a quarter of the free disk;
the entries used least recently go first. An entry superseded by a longer one of the same
conversation (its ids a prefix of the new one's) is removed when that one is written."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .cache import common_prefix

VERSION = 1
MIN_TOKENS = 64         # shorter prefixes prefill in a moment: not worth a file


@dataclass(frozen=True)
class Entry:
    path: Path
    tokens: int
    prefix: str          # the hash of its ids


def ids_hash(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:24]


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


class ResumeStore:
    def __init__(self, root: str | Path, budget: int, min_tokens: int = MIN_TOKENS):
        self.root = Path(root)
        self.budget = int(budget)
        self.min_tokens = min_tokens
        self.problem = ""        # why the last write failed (a full or read-only disk), for the UI to show
        self._read_last: tuple[Path, dict] | None = None

    # -- what is there
    def entries(self, key: tuple[str, str] | None = None) -> list[Entry]:
        """Entries, newest use first; `key` (model, how): only those."""
        out = []
        try:
            files = list(self.root.glob("*.safetensors"))
        except OSError:
            return []
        for p in files:
            parts = p.stem.split("-")
            if len(parts) != 4 or not parts[2].isdigit():
                continue
            if key is not None and (parts[0], parts[1]) != key:
                continue
            out.append((p, int(parts[2]), parts[3]))
        out.sort(key=lambda e: _mtime(e[0]), reverse=True)
        return [Entry(p, n, h) for p, n, h in out]

    def total_bytes(self) -> int:
        return sum(_size(e.path) for e in self.entries())

    def forget(self, model: str | None = None) -> int:
        """Remove every entry (of one model's identity, `model`); the bytes freed."""
        freed = 0
        for e in self.entries():
            if model is None or e.path.name.startswith(model + "-"):
                freed += _size(e.path)
                _remove(e.path)
        return freed

    # -- writing
    def save(self, key: tuple[str, str], cache, ids: list[int], turn_text: str, turn_ids: list[int]) -> Path | None:
        """Keep what `cache` holds (the tokens `ids`) and the turn that produced it. None
        where it is too short to be worth it, larger than the budget, or cannot be written
        (`problem` says why)."""
        n = len(ids)
        if n < self.min_tokens or self.budget <= 0 or cache.length != n:
            return None
        prefix = ids_hash(ids)
        path = self.root / f"{key[0]}-{key[1]}-{n:08d}-{prefix}.safetensors"
        if path.is_file():
            _touch(path)            # the same tokens were kept before: the same bits
            return path
        tensors = cache.export()
        tensors["ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors["turn_ids"] = torch.tensor(turn_ids, dtype=torch.int64)
        tensors["turn_text"] = torch.frombuffer(bytearray(turn_text.encode()) or bytearray(1), dtype=torch.uint8)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        recurrent = any(name.startswith("state.") for name in tensors)
        rewind = "any" if not recurrent else str(int(tensors["checkpoint"][0])) if "checkpoint" in tensors else ""
        meta = {"version": str(VERSION), "tokens": str(n), "rewind": rewind, "text_chars": str(len(turn_text)),
                "text_bytes": str(len(turn_text.encode())), "text_hash": text_hash(turn_text),
                "crc32": json.dumps({name: _crc(t) for name, t in tensors.items()})}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not self._make_room(size):
                return None
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                from safetensors.torch import save_file
                save_file(tensors, str(tmp), metadata=meta)
                os.replace(tmp, path)
            finally:
                _remove(tmp)
        except OSError as exc:
            self.problem = f"{self.root}: could not keep the conversation's cache ({exc.strerror or exc})"
            return None
        self.problem = ""
        for e in self.entries(key):          # the same conversation, shorter: superseded
            if e.tokens < n and e.prefix == ids_hash(ids[:e.tokens]):
                _remove(e.path)
        return path

    def _make_room(self, size: int) -> bool:
        for tmp in self.root.glob(".*.tmp"):        # a write a killed process left half done
            if time.time() - _mtime(tmp) > 3600:
                _remove(tmp)
        free = shutil.disk_usage(self.root).free
        limit = min(self.budget, (free + self.total_bytes()) // 4)
        if size > limit:
            self.problem = (f"{self.root}: a conversation's cache of {size >> 20} MiB is more than the resume "
                            f"store may hold ({limit >> 20} MiB: its budget, or a quarter of the free disk)")
            return False
        entries = self.entries()
        total = sum(_size(e.path) for e in entries)
        while entries and total + size > limit:
            oldest = entries.pop()
            total -= _size(oldest.path)
            _remove(oldest.path)
        return True

    # -- reading
    def turn(self, key: tuple[str, str], text: str) -> tuple[str, list[int]] | None:
        """The longest kept turn whose text starts `text` (a conversation rendered for its
        next answer), as (its text, its ids); None where none does."""
        best = None
        for e in self.entries(key):
            try:
                meta = _metadata(e.path)
                chars = int(meta["text_chars"])
            except (ValueError, KeyError):
                _remove(e.path)             # not an entry any more (written whole, then damaged)
                continue
            except OSError:
                continue
            if not 0 < chars <= len(text) or (best and chars <= len(best[0])):
                continue
            if text_hash(text[:chars]) != meta.get("text_hash"):
                continue
            try:
                # the whole entry checked now: a damaged one is not used at all, not even its ids
                t = _read(e.path)
            except ValueError:
                _remove(e.path)
                continue
            self._read_last = (e.path, t)        # restore() loads it next: read once
            best = (bytes(t["turn_text"].numpy()[:int(meta["text_bytes"])]).decode(), t["turn_ids"].tolist())
        return best

    def restore(self, key: tuple[str, str], cache, prompt: list[int], longer_than: int) -> int:
        """Load into `cache` the longest kept prefix of `prompt` longer than `longer_than`
        tokens that leaves at least one token to run; its length, or 0 where there is none
        (the cache untouched). As a cache in memory does for the next turn: an entry that
        shares only part of its tokens with the prompt gives that part where its cache can go
        back to it (keys and values anywhere; a recurrent state to its turn checkpoint)."""
        last, self._read_last = self._read_last, None
        best: tuple[int, Entry] | None = None
        for e in self.entries(key):              # newest use first: it wins a tie
            try:
                meta = _metadata(e.path)
                ids = (last[1] if last is not None and last[0] == e.path else _read(e.path, ("ids",)))["ids"]
            except (ValueError, KeyError):
                _remove(e.path)
                continue
            except OSError:
                continue
            shared = min(common_prefix(ids.tolist(), prompt), len(prompt) - 1)
            usable = _usable(meta.get("rewind", ""), e.tokens, shared)
            # worth reading: a gain of a few tokens (a template's first line) is quicker to prefill,
            # and a small part of a large entry not worth its whole file
            worth = usable >= longer_than + self.min_tokens // 2 and usable * 4 >= e.tokens
            if worth and (best is None or usable > best[0]):
                best = (usable, e)
        if best is None:
            return 0
        usable, e = best
        try:
            tensors = last[1] if last is not None and last[0] == e.path else _read(e.path)
            cache.load(tensors, e.tokens)
            cache.rollback(usable)
        except (ValueError, KeyError, RuntimeError):
            _remove(e.path)             # damaged, or not this cache's: never used, and not tried again
            return 0
        _touch(e.path)
        return usable


def _usable(rewind: str, tokens: int, shared: int) -> int:
    """How many of an entry's `tokens` a prompt sharing `shared` of them can use: `rewind`
    "any" (keys and values go back anywhere), else the recurrent state's turn checkpoint
    (or "" for none): all of them, or back to the checkpoint."""
    if shared >= tokens:
        return tokens
    if rewind == "any":
        return shared
    return int(rewind) if rewind.isdigit() and int(rewind) <= shared else 0


def _read(path: Path, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The entry's tensors (`names`: only those), each checked against its crc32; ValueError
    where the file is not a whole entry of this version."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("version") != str(VERSION):
                raise ValueError(f"format {meta.get('version')!r}, not {VERSION}")
            crcs = json.loads(meta["crc32"])
            if set(crcs) != set(f.keys()):
                raise ValueError("its tensors are not the ones written")
            out = {}
            for name in names or f.keys():
                t = f.get_tensor(name)
                if _crc(t) != crcs[name]:
                    raise ValueError(f"{name}: crc32 does not match")
                out[name] = t
            return out
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def _metadata(path: Path) -> dict:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
