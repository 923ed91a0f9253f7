"""Drafters propose the next k tokens cheaply; the target then checks them in one pass.

    propose(history, k, params, gen) -> (tokens, q)

`history` is every token the target has committed plus the last sampled one (the whole
conversation, so prompt lookup sees the user's text). `q` is [len(tokens), vocab], the
distribution each token was drawn from, or None when proposals are deterministic
(one-hot), as with the n-gram drafter.

Kinds: `ngram` (prompt lookup: no model, no memory), `model` (any causal LM sharing the
target's tokenizer, with its own KV cache), `mtp` (the checkpoint's own multi-token-prediction
layer, reading the target's hidden states), `none` (plain decoding through the same loop).
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
                # all logits: a pass of two tokens (a fully accepted round's last draft and the
                # target's own) is then a verify pass, every row of it a lone row, so the
                # drafter's state is what one-token steps would have made it (a prefill's
                # products may round rows apart, and a drafter that drifts from its target's
                # numbers proposes what the target rejects)
                logits = self.target.forward(feed, all_logits=len(feed) > 1)[-1]
                self.ids.extend(feed)
                tok = _draw(_fit_vocab(logits, self.vocab), params, gen, dists)
                tokens.append(tok)
                feed = [tok]
        return tokens, (torch.stack(dists) if dists else None)


class MtpDrafter:
    """Drafts with the target checkpoint's multi-token-prediction layer (models/mtp.py).

    The layer's pair at position i is (token i + 1, the target's final hidden state at i),
    so it reads what the target computed: a hook on the target's text model keeps the
    hidden state of every position its passes run (prefill, steps, verify rows; a rejected
    row is overwritten when its position runs again). Its own cache holds the pairs of the
    committed tokens only: before each proposal it is cut back to the prefix the history
    still shares and fed the pairs the target has committed since; the drafted steps (which
    read the layer's own output in place of the target's) are dropped after the proposal."""
    kind = "mtp"
    catch_up_seconds = 0.0

    def __init__(self, target, layer, name: str):
        from transformers.cache_utils import DynamicCache
        self.target, self.layer, self.name = target, layer, name
        self.vocab = target.vocab_size
        self._new_cache = lambda: DynamicCache(config=layer.config)
        self.cache = self._new_cache()
        self.ids: list[int] = []        # history[:m + 1]: the cache holds the pairs of positions < m
        self.hidden: torch.Tensor | None = None
        self._hook = target.impl.model.model.register_forward_hook(self._record, with_kwargs=True)

    def close(self) -> None:
        self._hook.remove()

    def _record(self, module, args, kwargs, out) -> None:
        h = out.last_hidden_state[0]
        pos = kwargs.get("position_ids")
        p0 = int(pos.reshape(-1)[0]) if pos is not None else 0
        need = p0 + h.shape[0]
        with torch.inference_mode():
            if self.hidden is None or self.hidden.shape[0] < need:
                grown = torch.zeros(max(need, 2 * (0 if self.hidden is None else self.hidden.shape[0]), 64),
                                    h.shape[-1], dtype=h.dtype, device=h.device)
                if self.hidden is not None:
                    grown[:self.hidden.shape[0]] = self.hidden
                self.hidden = grown
            self.hidden[p0:need] = h

    def _embed(self, ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids, device=self.target.device)
        if hasattr(self.target, "embed_rows"):                # a streamed target keeps its own table
            return self.target.embed_rows(t)
        return self.target.impl.model.get_input_embeddings()(t)

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        if hasattr(self.target, "embed_rows"):                # and its own head
            return self.target.head(g, False)[-1].float()
        return self.target.impl.model.lm_head(g)[-1].float()

    def reset(self) -> None:
        self.ids = []
        self.cache = self._new_cache()

    def _cut(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)

    def propose(self, history, k, params: SamplingParams, gen):
        n = len(history) - 1                       # the target has run positions 0 .. n-1
        if k <= 0 or n < 1 or self.hidden is None or self.hidden.shape[0] < n:
            return [], None
        keep = max(0, min(len(self.ids) - 1, common_prefix(self.ids, history) - 1, n - 1,
                          self.cache.get_seq_length()))
        self._cut(keep)
        tokens, dists = [], []
        t0 = time.perf_counter()
        with torch.inference_mode():
            g = self.layer(self._embed(history[keep + 1:n + 1]), self.hidden[keep:n],
                           torch.arange(keep, n, device=self.target.device), self.cache)[-1:]
            self.ids = list(history)
            self.catch_up_seconds = time.perf_counter() - t0 if n - keep > 2 else 0.0
            for j in range(k):
                tok = _draw(_fit_vocab(self._logits(g), self.vocab), params, gen, dists)
                tokens.append(tok)
                if j + 1 < k:
                    g = self.layer(self._embed([tok]), g, torch.tensor([n + j], device=self.target.device),
                                   self.cache)
            self._cut(n)                           # the drafted steps read the layer's own output
        return tokens, (torch.stack(dists) if dists else None)


def _draw(logits: torch.Tensor, params: SamplingParams, gen, dists: list) -> int:
    """A drafted token: the argmax, or a sample whose distribution is kept in `dists`."""
    if params.greedy:
        return int(torch.argmax(logits))
    q = probabilities(logits, params)
    dists.append(q)
    return int(torch.multinomial(q, 1, generator=gen))


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
