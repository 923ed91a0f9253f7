"""The decode loop: draft, verify, accept, roll back, adapt k.

Each round feeds the target the last sampled token plus k drafted ones in ONE forward
pass over k+1 positions, keeps the longest prefix the target agrees with and adds one
token of the target's own (the correction, or a bonus when all k are kept). With k = 0
the round is a plain decoding step, so one loop serves every drafter, `none` included.

Greedy output is token for token what plain greedy decoding gives; sampled output has
exactly the target's distribution (see sampling.verify_sampled).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from .decode import decode_one_token
from .sampling import SamplingParams, next_token, verify_greedy, verify_sampled


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] with k drafts accepted independently with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class PassCosts:
    """What drafting and verifying cost on this machine: seconds per drafted token and of a
    target pass over n positions (moving means). They belong to the engine, not to one
    chat, so a new chat starts knowing them: it need not spend a probe to learn again that
    a drafter is too slow to pay."""

    def __init__(self, smoothing: float = 0.15):
        self.alpha = smoothing
        self.t_draft: float | None = None
        self.t_pass: dict[int, float] = {}      # positions -> moving mean seconds
        # Acceptance over every chat of this drafter: a new chat's starting guess. (A
        # fixed 0.5 made new chats on an easy-to-guess model decline to draft until
        # their own rate caught up.)
        self.acceptance: float | None = None

    def observe(self, drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        if drafted:
            per = draft_seconds / drafted
            self.t_draft = per if self.t_draft is None else self.t_draft + self.alpha * (per - self.t_draft)
        n = drafted + 1
        old = self.t_pass.get(n)
        self.t_pass[n] = verify_seconds if old is None else old + self.alpha * (verify_seconds - old)

    def new_drafter(self) -> None:
        """Another drafter: its cost and acceptance are unknown; the target's pass times still hold."""
        self.t_draft = None
        self.acceptance = None

    def observe_acceptance(self, rate: float) -> None:
        old = self.acceptance
        self.acceptance = rate if old is None else old + self.alpha * (rate - old)


class DraftController:
    """Chooses k before each round to maximise expected tokens per second:
    E[tokens](a, k) / (k * t_draft + t_verify(k + 1)), from measurements of this chat:
    a (moving acceptance rate), t_draft (seconds per drafted token) and t_verify(n)
    (seconds of a target pass over n positions). k = 0 wins whenever drafting does not
    pay, so speculation is never slower than plain decoding beyond noise."""

    def __init__(self, max_draft: int = 8, fixed: int | None = None, prior_acceptance: float = 0.5,
                 smoothing: float = 0.15, probe_every: int = 32, first_k: int = 2, margin: float = 1.03,
                 costs: PassCosts | None = None):
        self.max_draft = max_draft
        self.fixed = fixed
        self.a = prior_acceptance               # per chat: how guessable this conversation is
        self.alpha = smoothing
        self.costs = costs or PassCosts(smoothing)
        self.probe_every = probe_every
        self.first_k = first_k
        self.margin = margin
        self._plain_streak = 0
        self.k = fixed if fixed is not None else 0

    # -- measurements
    def observe(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if drafted:
            self.a += self.alpha * (accepted / drafted - self.a)
            self.costs.observe_acceptance(accepted / drafted)
        self.costs.observe(drafted, draft_seconds, verify_seconds)

    @property
    def t_draft(self) -> float | None:
        return self.costs.t_draft

    @t_draft.setter
    def t_draft(self, seconds: float | None) -> None:
        self.costs.t_draft = seconds

    @property
    def t_pass(self) -> dict[int, float]:
        return self.costs.t_pass

    @t_pass.setter
    def t_pass(self, seconds: dict[int, float]) -> None:
        self.costs.t_pass = seconds

    def t_verify(self, n: int) -> float:
        """Measured pass time over n positions; unmeasured n are interpolated linearly
        between measured ones (a pass is weight-bound: nearly flat in n until compute-bound)."""
        if n in self.t_pass:
            return self.t_pass[n]
        known = sorted(self.t_pass)
        if not known:
            return 1.0
        lo = max((m for m in known if m < n), default=None)
        hi = min((m for m in known if m > n), default=None)
        if lo is not None and hi is not None:
            w = (n - lo) / (hi - lo)
            return self.t_pass[lo] * (1 - w) + self.t_pass[hi] * w
        if lo is not None and len(known) >= 2:
            a, b = known[-2], known[-1]
            slope = max(0.0, (self.t_pass[b] - self.t_pass[a]) / (b - a))
            return self.t_pass[lo] + slope * (n - lo)
        # One point only: assume a wide pass costs 5% more per extra position until measured.
        base = self.t_pass[known[0]]
        return base * (1 + 0.05 * abs(n - known[0]))

    # -- decision
    def choose(self) -> int:
        if self.fixed is not None:
            self.k = self.fixed
            return self.k
        if self.t_draft is None or not self.t_pass:
            # Nothing measured yet: a short first draft measures the drafter's cost and
            # acceptance without betting a long one on a drafter that may be slow.
            self.k = min(self.first_k, self.max_draft)
            return self.k
        if 1 not in self.t_pass:
            # Every choice is measured against a plain step: measure one rather than
            # extrapolate it from wider passes, which can be far off.
            self.k = 0
            return 0
        t_draft = self.t_draft
        best_k, best = 0, expected_tokens(self.a, 0) / self.t_verify(1)
        for k in range(1, self.max_draft + 1):
            rate = expected_tokens(self.a, k) / (k * t_draft + self.t_verify(k + 1))
            # Drafting must promise a clear gain: the estimates are noisy, and a draft
            # that does not pay slows every round it is tried in.
            if rate > best * (self.margin if best_k == 0 else 1.001):
                best_k, best = k, rate
        if best_k == 0:
            # Keep measuring: the text may become easy to guess again. Unless a draft step
            # costs about as much as a target pass: then no acceptance rate can make
            # drafting pay, and a probe would only make the drafter catch up for nothing.
            self._plain_streak += 1
            if self._plain_streak >= self.probe_every and t_draft < 0.5 * self.t_verify(1):
                self._plain_streak = 0
                best_k = min(2, self.max_draft)
        else:
            self._plain_streak = 0
        self.k = best_k
        return best_k


class RoundStats:
    """Counts of one answer, read by the stats tracker."""

    def __init__(self):
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0
        self.k = 0
        self.drafted_hist: dict[int, int] = {}     # rounds by number of drafted tokens

    def expected_tokens_per_pass(self) -> float:
        """What the formula predicts for these rounds from their measured acceptance."""
        if not self.rounds:
            return 0.0
        a = self.accepted / self.drafted if self.drafted else 0.0
        return sum(n * expected_tokens(a, k) for k, n in self.drafted_hist.items()) / self.rounds


def generate(target, drafter, controller: DraftController, history: list[int], first_logits: torch.Tensor,
             params: SamplingParams, gen: torch.Generator | None, max_new_tokens: int,
             stop_ids: frozenset[int], cancel: threading.Event | None = None,
             counts: RoundStats | None = None, constraint=None) -> Iterator[list[int]]:
    """Yield the tokens of each target pass until a stop token, max_new_tokens or cancel,
    or until the `constraint` (engine.constrain.Constraint) is complete.

    `history` holds the tokens in the target's cache and is extended in place as tokens
    are committed; the last yielded token is never fed back (the next turn starts with it).
    Under a constraint every position's logits are masked as the grammar's state after the
    tokens before it allows, drafts included, so the tokens are those of constrained
    decoding without a drafter.
    """
    counts = counts or RoundStats()
    if constraint is not None:
        constraint.mask(first_logits)
    token = next_token(first_logits, params, gen)
    _commit(constraint, [token], stop_ids)
    yield [token]
    produced = 1
    while produced < max_new_tokens and token not in stop_ids and not (constraint is not None and constraint.done):
        if cancel is not None and cancel.is_set():
            return
        # tokens we may still emit: a pass writes the token and its drafts, and the context
        # holds only so many positions (full: the answer ends here, as at max_new_tokens)
        room = min(max_new_tokens - produced, target.cache.max_positions - target.cache.length)
        if room < 1:
            return
        k = min(controller.choose(), room - 1)
        # The token is committed by this round's pass whatever is accepted: put it in the
        # history now, so the drafter reads the history itself (no copy per round).
        start = target.cache.length
        history.append(token)
        t0 = time.perf_counter()
        drafts, q = drafter.propose(history, k, params, gen) if k > 0 else ([], None)
        after = None            # the drafter's distribution at a draft the grammar cut
        if constraint is not None and drafts:
            # cut at the first token the grammar forbids: the target would reject it anyway
            m = constraint.allowed_prefix(drafts)
            if m < len(drafts):
                after = q[m] if q is not None else None
                drafts, q = drafts[:m], (q[:m] if q is not None else None)
        t1 = time.perf_counter()
        if drafts:
            # a hybrid's recurrent layers record this pass instead of committing it
            # (engine/models/replay.py): the rollbacks below keep only accepted updates
            with target.cache.record():
                logits = target.forward([token] + drafts, all_logits=True)
            if constraint is not None:
                constraint.mask_rows(logits, drafts)
            if params.greedy:
                n, nxt = verify_greedy(logits, drafts)
            else:
                n, nxt = verify_sampled(logits, drafts, q, params, gen, after)
            target.cache.rollback(start + 1 + n)    # forget the rejected drafts
        else:
            logits = decode_one_token(target, token)
            if constraint is not None:
                constraint.mask(logits)
            n, nxt = 0, next_token(logits, params, gen)
        out = drafts[:n] + [nxt]
        for i, t in enumerate(out):
            if t in stop_ids:                       # an accepted draft may end the answer
                out = out[:i + 1]
                break
        out = _commit(constraint, out, stop_ids)
        history.extend(out[:-1])
        target.cache.rollback(len(history))
        # A hybrid replays the accepted updates now, so the pass's time includes it and the
        # adaptive k weighs it (drafting that does not pay then picks k = 0).
        target.cache.settle()
        t2 = time.perf_counter()
        # The drafter's catch-up (a prefill of what it missed) is not a per-token cost.
        catch_up = getattr(drafter, "catch_up_seconds", 0.0) if k > 0 else 0.0
        controller.observe(len(drafts), n, max(0.0, t1 - t0 - catch_up), t2 - t1)
        counts.rounds += 1
        counts.drafted += len(drafts)
        counts.accepted += n
        counts.k = k
        counts.drafted_hist[len(drafts)] = counts.drafted_hist.get(len(drafts), 0) + 1
        produced += len(out)
        token = out[-1]
        yield out


def _commit(constraint, tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """Advance the grammar over the committed tokens; the answer ends where it is complete.
    A stop token ends the answer anyway and is not the grammar's to read."""
    if constraint is None:
        return tokens
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens
        if not constraint.consume(t):
            raise AssertionError("a token the grammar forbids was committed")
        if constraint.done:
            return tokens[:i + 1]
    return tokens
