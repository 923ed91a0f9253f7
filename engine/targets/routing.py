"""How often a mixture's router picks each expert, measured on the engine's held texts and
kept per model: which experts a CPU keeps in memory when not all of them fit (the most used
first; the rest stay memory-mapped in the quantized cache), and what the plan expects a
token to read from disk then.

Why measured: routing is far from uniform in trained mixtures, so the experts most tokens
pick are worth their place in RAM, and a plan from uniform routing over-counts the disk.
On random weights routing is near uniform, and the plan comes out the same as without.

The counts are a file per model under `<cache>/routing/`, named by a digest of what the
weights derive from (qcache.source_identity): a re-downloaded or changed model is measured
again, an unreadable or mismatched file is ignored and replaced."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import moe
from .qcache import source_identity

VERSION = 1
TOKENS = 256          # of each held text: enough for every expert's count to mean something at E = 256, k = 8


@dataclass(frozen=True)
class Routing:
    """counts[b][e]: how many times sparse block b (in model order) routed a token to expert
    e, over `tokens` tokens."""
    counts: tuple[tuple[int, ...], ...]
    tokens: int

    @property
    def experts(self) -> int:
        """Experts over all the sparse blocks."""
        return sum(len(c) for c in self.counts)

    def ranked(self) -> list[tuple[int, int]]:
        """(block, expert), most used first; ties by block, then expert, so one count gives
        one order."""
        pairs = [(b, e) for b, row in enumerate(self.counts) for e in range(len(row))]
        return sorted(pairs, key=lambda p: (-self.counts[p[0]][p[1]], p))

    def mapped_share(self, kept: int) -> float:
        """The share of routed reads that land on experts outside the `kept` most used: a
        token's share of its routed experts read from disk when only those are in memory."""
        total = sum(map(sum, self.counts))
        if not total:
            return 1.0 - min(kept, self.experts) / max(1, self.experts)
        hits = sum(self.counts[b][e] for b, e in self.ranked()[:max(0, kept)])
        return 1.0 - hits / total


def _file(cache_root: Path, model: Path, source: str | None = None) -> Path:
    key = hashlib.sha256((source or source_identity(model)).encode()).hexdigest()[:24]
    return cache_root / "routing" / f"{key}.json"


def cached(cache_root: Path, model: Path) -> Routing | None:
    """The counts measured for this model's weights, or None (never measured, another
    version of the weights, an unreadable file)."""
    try:
        source = source_identity(model)
        data = json.loads(_file(cache_root, model, source).read_text())
        if data.get("version") != VERSION or data.get("source") != source:
            return None
        counts = tuple(tuple(int(c) for c in row) for row in data["counts"])
        return Routing(counts, int(data["tokens"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(cache_root: Path, model: Path, routing: Routing) -> None:
    """Written whole or not at all; a cache that cannot be written only costs a measurement
    next time."""
    path = _file(cache_root, model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": VERSION, "source": source_identity(model), "tokens": routing.tokens,
                       "counts": [list(r) for r in routing.counts]}, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def measure(model: torch.nn.Module, texts: list[list[int]]) -> Routing:
    """The routers' picks over `texts` (token ids), each text one forward of the model's own
    modules without a cache."""
    blocks = moe.blocks(model)
    counts = [torch.zeros(gate.weight.shape[0], dtype=torch.int64) for gate, _ in blocks]

    def hook(b):
        def count(module, args, out):
            index = out[2].reshape(-1)
            counts[b].add_(torch.bincount(index[(index >= 0) & (index < counts[b].numel())],
                                          minlength=counts[b].numel()))
        return count
    handles = [gate.register_forward_hook(hook(b)) for b, (gate, _) in enumerate(blocks)]
    tokens = 0
    try:
        with torch.no_grad():
            for ids in texts:
                if ids:
                    model(input_ids=torch.tensor([ids]), use_cache=False)
                    tokens += len(ids)
    finally:
        for h in handles:
            h.remove()
    return Routing(tuple(tuple(c.tolist()) for c in counts), tokens)


def keep_in_memory(model: torch.nn.Module, routing: Routing, n: int) -> list[tuple[int, int]]:
    """Copy the `n` most used experts' weights out of their memory mapping into memory (the
    rest stay mapped, read from disk when routed to); returns the (block, expert) kept."""
    blocks = moe.blocks(model)
    kept = routing.ranked()[:max(0, n)]
    for b, e in kept:
        blocks[b][1].keep_in_memory(e)
    return kept
