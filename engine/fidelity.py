"""How close a target (quantized, another dtype) stays to the exact model, teacher-forced
on a held text: both read the same tokens, and at every position we compare what each
predicts next.

- top-1 agreement: the share of positions where both would pick the same greedy token;
- mean KL(exact || candidate) of the next-token distributions, in nats;
- perplexity of each on the text itself (exp of the mean negative log-likelihood of the
  token that really follows), so a change of quality shows next to a change of answers.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from importlib import resources

import torch


# The held texts shipped with the engine: public-domain prose and simple Python.
HELD_TEXTS = ("held_prose.txt", "held_code.py.txt")


def held_texts(tokenizer, limit: int | None = None) -> list[list[int]]:
    """The held texts as token ids (the first `limit` tokens of each)."""
    folder = resources.files("engine") / "data"
    return [tokenizer((folder / name).read_text(encoding="utf-8"))["input_ids"][:limit] for name in HELD_TEXTS]


@dataclass(frozen=True)
class Fidelity:
    tokens: int                 # positions compared (text length - 1)
    top1_agreement: float
    mean_kl: float
    ppl_reference: float
    ppl_candidate: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Sums:
    n: int = 0
    agree: int = 0
    kl: float = 0.0
    nll_ref: float = 0.0
    nll_cand: float = 0.0

    def add(self, ref: torch.Tensor, cand: torch.Tensor, nxt: torch.Tensor) -> None:
        lp = torch.log_softmax(ref.double(), -1)
        lq = torch.log_softmax(cand.double(), -1)
        rows = torch.arange(nxt.numel())
        self.n += nxt.numel()
        self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        self.kl += float((lp.exp() * (lp - lq)).sum())
        self.nll_ref -= float(lp[rows, nxt].sum())
        self.nll_cand -= float(lq[rows, nxt].sum())

    def result(self) -> Fidelity:
        n = max(1, self.n)
        return Fidelity(self.n, self.agree / n, self.kl / n, math.exp(self.nll_ref / n), math.exp(self.nll_cand / n))


def measure(reference, candidate, texts: list[list[int]], chunk: int = 256) -> Fidelity:
    """Teacher-force each token sequence through both targets (anything with forward(ids,
    all_logits) and a cache) and compare their next-token predictions."""
    return compare(reference, {"candidate": candidate}, texts, chunk)["candidate"]


def compare(reference, candidates: dict, texts: list[list[int]], chunk: int = 256) -> dict[str, Fidelity]:
    """measure() for several candidates against one reference pass. Each text starts
    from empty caches, fed `chunk` tokens a pass; the caches are left empty."""
    sums = {name: _Sums() for name in candidates}
    with contextlib.closing(_pieces([reference, *candidates.values()], texts, chunk)) as pieces:
        for piece, nxt in pieces:
            ref = reference.forward(piece, all_logits=True)[:nxt.numel()].float().cpu()
            for name, cand in candidates.items():
                sums[name].add(ref, cand.forward(piece, all_logits=True)[:nxt.numel()].float().cpu(), nxt)
    return {name: s.result() for name, s in sums.items()}


@dataclass(frozen=True)
class FileCheck:
    """A file's own logits on the held texts, with no reference to compare with: what a
    damaged file or a mis-mapped conversion shows (silent garbage rather than an error)."""
    tokens: int                 # positions read
    distinct_top1: int          # different greedy tokens over those positions
    ppl: float                  # perplexity on the texts (inf where a logit is not finite)
    vocab: int

    def problem(self) -> str:
        """'' when nothing looks wrong, else what does."""
        if not math.isfinite(self.ppl):
            return "its logits on the held texts are not finite (NaN or inf)"
        if self.tokens >= 64 and self.distinct_top1 <= 2:
            return (f"it predicts the same {'token' if self.distinct_top1 == 1 else 'two tokens'} at all "
                    f"{self.tokens} positions of the held texts (degenerate)")
        if self.ppl > self.vocab / 8:
            return (f"its perplexity on the held texts is {self.ppl:,.0f}, near a uniform guess over its "
                    f"{self.vocab:,}-token vocabulary")
        return ""

    def as_dict(self) -> dict:
        return asdict(self) | {"problem": self.problem()}


def check_file(target, texts: list[list[int]], chunk: int = 256) -> FileCheck:
    """Teacher-force the texts through one target and look at its predictions alone."""
    n, nll, tops, vocab = 0, 0.0, set(), 0
    with contextlib.closing(_pieces([target], texts, chunk)) as pieces:
        for piece, nxt in pieces:
            logits = target.forward(piece, all_logits=True)[:nxt.numel()].double().cpu()
            vocab = logits.shape[-1]
            n += nxt.numel()
            if not torch.isfinite(logits).all():
                return FileCheck(n, len(tops), math.inf, vocab)
            nll -= float(torch.log_softmax(logits, -1)[torch.arange(nxt.numel()), nxt].sum())
            tops.update(logits.argmax(-1).tolist())
    return FileCheck(n, len(tops), math.exp(nll / max(1, n)), vocab)


@dataclass(frozen=True)
class Against:
    """A converted file's predictions against the checkpoint it was made from."""
    reference: str              # the checkpoint's folder
    how: str                    # how it was found (named, or from the file's metadata)
    fidelity: Fidelity

    def problem(self) -> str:
        """'' when the file answers as its checkpoint does within what quantization moves
        (a 2-3 bit file stays far above these bounds), else what is wrong."""
        f = self.fidelity
        if f.top1_agreement < 0.5 or f.mean_kl > 1.0:
            return (f"it disagrees with {self.reference} ({self.how}): top-1 agreement {f.top1_agreement:.1%}, mean "
                    f"KL {f.mean_kl:.2f} nats on the held texts; a mis-mapped conversion, or not the same model "
                    "(a fine-tune differs from its base model)")
        return ""

    def as_dict(self) -> dict:
        return {"reference": self.reference, "how": self.how, **self.fidelity.as_dict(), "problem": self.problem()}


def against_checkpoint(target, texts: list[list[int]], path, how: str) -> Against:
    """`target` (a converted file, its held texts `texts` in its own tokens) teacher-forced
    beside the safetensors checkpoint at `path`, run in its own dtype. The checkpoint must
    read the texts as the same tokens and predict over the same vocabulary."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from . import kernels
    from .errors import CheckpointError
    from .targets.resident import checkpoint_dtype, load_resident
    path = Path(path)
    try:
        theirs = held_texts(AutoTokenizer.from_pretrained(path, trust_remote_code=False), max(map(len, texts)))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot load the reference's tokenizer ({exc})") from None
    if theirs != texts:
        raise CheckpointError(f"{path}: its tokenizer reads the held texts as other tokens than the file's does: "
                              "not the same model; give the checkpoint the file was made from")
    cpu = torch.device("cpu")           # where a file's blocks run
    reference = load_resident(path, cpu, kernels.default_dtype(cpu, checkpoint_dtype(path)))
    probe = [texts[0][:2]]
    with contextlib.closing(_pieces([reference, target], probe, 2)) as pieces:
        for piece, _ in pieces:
            a, b = reference.forward(piece, all_logits=True), target.forward(piece, all_logits=True)
            if a.shape[-1] != b.shape[-1]:
                raise CheckpointError(f"{path}: it predicts over {a.shape[-1]:,} tokens and the file over "
                                      f"{b.shape[-1]:,}: not the same model")
    return Against(str(path), how, measure(reference, target, texts))


def _pieces(targets: list, texts: list[list[int]], chunk: int):
    """Each text from empty caches, `chunk` tokens a pass: (the pass's tokens, the token that
    follows each); the caches are left empty, also when the caller stops early."""
    try:
        for ids in texts:
            for t in targets:
                t.cache.rollback(0)
            for a in range(0, len(ids) - 1, chunk):
                piece = ids[a:a + chunk]
                yield piece, torch.tensor(ids[a + 1:a + 1 + len(piece)])
    finally:
        for t in targets:
            t.cache.rollback(0)


def measure_formats(path, device, formats=("int8", "int4"), limit: int = 512, cache_dir=None,
                    tokenizer=None) -> dict[str, Fidelity]:
    """Fidelity of each quantized format of the checkpoint at `path` against its exact
    weights, on the first `limit` tokens of each held text. The figures are kept under the
    cache dir, keyed by the source files, so `localchat doctor` shows them without
    measuring again (a changed checkpoint measures afresh)."""
    import json
    from pathlib import Path

    from .targets.quantized import load_quantized
    from .targets.resident import checkpoint_dtype, load_resident
    from . import kernels

    path = Path(path)
    store = _store(path, limit, cache_dir)
    known = cached_formats(path, limit, cache_dir)
    todo = [f for f in formats if f not in known]
    if todo:
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        texts = held_texts(tokenizer, limit)
        exact = load_resident(path, device, kernels.default_dtype(device, checkpoint_dtype(path)))
        for fmt in todo:      # one candidate at a time: a large model need not fit three times
            cand = load_quantized(path, device, fmt, cache_dir=cache_dir)
            known[fmt] = measure(exact, cand, texts)
            del cand
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: v.as_dict() for k, v in known.items()}, indent=1))
        tmp.replace(store)
    return {f: known[f] for f in formats}


def cached_formats(path, limit: int = 512, cache_dir=None) -> dict[str, Fidelity]:
    """Figures measure_formats() stored for this checkpoint, if any (never measures)."""
    import json
    try:
        return {k: Fidelity(**v) for k, v in json.loads(_store(path, limit, cache_dir).read_text()).items()}
    except (OSError, ValueError, TypeError):
        return {}


def _store(path, limit: int, cache_dir=None):
    """Where measure_formats() keeps a checkpoint's figures: keyed by its source files."""
    from pathlib import Path

    from .checkpoint import default_cache_dir
    from .targets.qcache import source_identity
    return Path(cache_dir or default_cache_dir()) / "fidelity" / f"{source_identity(Path(path))[:32]}-{limit}.json"
