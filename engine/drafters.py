"""Drafters propose the next k tokens cheaply; the target then checks them in one pass.

    propose(history, k, params, gen) -> (tokens, q)

`history` is every token the target has committed plus the last sampled one (the whole
conversation, so prompt lookup sees the user's text). `q` is [len(tokens), vocab], the
distribution each token was drawn from, or None when proposals are deterministic
(one-hot), as with the n-gram drafter.

Kinds: `ngram` (prompt lookup: no model, no memory), `model` (any causal LM sharing the
target's tokenizer, with its own KV cache), `none` (plain decoding through the same loop).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .errors import BadRequest
from .sampling import SamplingParams, probabilities
from .cache import common_prefix


class NoDrafter:
    kind = "none"

    def propose(self, history, k, params, gen):
        return [], None


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it — up to n of
    them for a short match, up to k for a match of 3 or more. Code edits, summaries and
    quotes repeat long runs of the conversation; this finds them for free."""
    kind = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, history, k, params=None, gen=None):
        if k <= 0 or len(history) < 2:
            return [], None
        arr = np.asarray(history, dtype=np.int64)
        L = len(arr)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = arr[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)   # excludes the suffix itself
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n          # the most recent occurrence
                # A short match is weak evidence: propose as many tokens as it matched
                # (a 1-token match proposes 1), a match of 3 or more the full k. Measured
                # on the bench workloads: acceptance 0.2-0.4 -> 0.4-0.6, fewer wasted
                # verify positions, a larger k chosen where it pays.
                follow = arr[start:start + (k if n >= 3 else min(k, n))]
                if follow.size:
                    return follow.tolist(), None
        return [], None


class ModelDrafter:
    """A small causal LM with its own KV cache. Before each proposal its cache is rolled
    back to the longest prefix it shares with the target's history, so rejected drafts
    are forgotten without copying anything."""
    kind = "model"
    catch_up_seconds = 0.0              # of the last proposal: see propose

    def __init__(self, target, name: str, target_vocab: int):
        self.target = target            # a ResidentTarget of the drafter model
        self.name = name
        self.vocab = target_vocab
        self.ids: list[int] = []        # what the drafter's cache holds

    def reset(self) -> None:
        self.ids = []
        self.target.cache.rollback(0)

    def propose(self, history, k, params: SamplingParams, gen):
        if k <= 0:
            return [], None
        keep = common_prefix(self.ids, history)
        if keep == len(history):
            keep -= 1                    # one token must run to get the next logits
        # a hybrid drafter's recurrent state goes back only to what it recorded (or the start)
        keep = self.target.cache.restorable(keep)
        self.target.cache.rollback(keep)
        del self.ids[keep:]
        feed = list(history[keep:])
        # Catching up on a stretch the target committed without drafts (a new prompt,
        # rounds that drafted nothing) is a prefill paid once, not a cost per drafted
        # token: timed apart, so the controller's per-token draft cost is what drafting
        # costs (it once took a whole prompt's prefill for one draft step, and never
        # drafted again). The two tokens a fully accepted round leaves (the last draft
        # and the target's own) are every round's cost and stay in it.
        self.catch_up_seconds = 0.0
        if len(feed) > 2:
            t0 = time.perf_counter()
            self.target.forward(feed[:-1])
            self.ids.extend(feed[:-1])
            feed = feed[-1:]
            self.catch_up_seconds = time.perf_counter() - t0
        tokens, dists = [], []
        # A hybrid drafter records its steps (its recurrent state cannot be cropped): the
        # next proposal's rollback to what the target accepted replays only those.
        with self.target.cache.record():
            for _ in range(k):
                logits = self.target.forward(feed)[-1]
                self.ids.extend(feed)
                logits = _fit_vocab(logits, self.vocab)
                if params.greedy:
                    tok = int(torch.argmax(logits))
                else:
                    q = probabilities(logits, params)
                    tok = int(torch.multinomial(q, 1, generator=gen))
                    dists.append(q)
                tokens.append(tok)
                feed = [tok]
        return tokens, (torch.stack(dists) if dists else None)


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Drafter and target may pad their vocabularies differently: ids past the shared
    range get no probability."""
    if logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    pad = torch.full((vocab - logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
    return torch.cat([logits, pad])


def check_compatible(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """A drafter must speak the target's tokens: the same id for every token they share
    and the same special tokens. Anything else drafts garbage, so refuse it by name."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    by_id_t = {i: s for s, i in tv.items()}
    mismatched = [s for s, i in dv.items() if i in by_id_t and by_id_t[i] != s]
    if mismatched or len(set(tv) & set(dv)) < 0.9 * min(len(tv), len(dv)):
        example = f" (e.g. {mismatched[0]!r})" if mismatched else ""
        raise BadRequest(f"--draft-model {draft_name}: does not share the tokenizer of {target_name}{example}; "
                         "pick a drafter from the same model family")
    for attr in ("eos_token_id", "bos_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a is not None and b is not None and a != b:
            raise BadRequest(f"--draft-model {draft_name}: has {attr}={b} but {target_name} has {a}; "
                             "pick a drafter from the same model family")
