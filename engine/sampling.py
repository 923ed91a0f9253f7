"""Turning logits into the next token: greedy, or sampling with temperature, top-k and
top-p. `probabilities` gives the distribution actually sampled from, which speculative
verification needs for its acceptance rule."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import BadRequest
from .kernels import layer_kernel


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int | None = None

    def __post_init__(self):
        problem = check(self.temperature, self.top_p, self.top_k, self.seed)
        if problem:
            raise BadRequest(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check(temperature: float, top_p: float, top_k: int, seed: int | None = None) -> str | None:
    """What is wrong with these sampling settings, as one line naming the flag, or None.
    NaN fails every comparison, so the ranges are written to reject it (not `x < 0`)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"--temperature {temperature}: must be 0 (greedy) or a finite positive number"
    if not 0 < top_p <= 1:
        return f"--top-p {top_p}: must be in (0, 1]"
    if top_k < 0:
        return f"--top-k {top_k}: must be 0 (off) or a positive count"
    if seed is not None and not 0 <= seed < 2 ** 63:
        return f"--seed {seed}: must be a whole number from 0 to 2^63 - 1"
    return None


def model_defaults(path) -> tuple[SamplingParams, str]:
    """The sampling a checkpoint's authors recommend, from its generation_config.json, and
    a note saying where it came from, or why it is greedy. The values the file writes count where it turns
    sampling on (`do_sample`, as transformers reads it): Qwen3 writes temperature 0.6,
    top-p 0.95, top-k 20 and warns that greedy decoding repeats itself endlessly. What the
    file leaves out stays off (vLLM reads it the same way); a file that does not sample,
    or is missing or malformed, recommends greedy."""
    file = Path(path) / "generation_config.json"
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return SamplingParams(), "the model has no generation_config.json"
    except (OSError, UnicodeDecodeError, ValueError):
        return SamplingParams(), "the model's generation_config.json cannot be read"
    if not isinstance(cfg, dict) or cfg.get("do_sample") is not True:
        return SamplingParams(), "the model's generation_config.json does not sample"
    t, p, k = (1.0 if cfg.get("temperature") is None else cfg["temperature"],
               1.0 if cfg.get("top_p") is None else cfg["top_p"], cfg.get("top_k") or 0)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (t, p, k))
    if not numbers or (isinstance(k, float) and not k.is_integer()) or check(float(t), float(p), int(k)):
        return SamplingParams(), "the model's generation_config.json has a sampling value out of range"
    return SamplingParams(float(t), int(k), float(p)), "the model's generation_config.json"


def describe(params: SamplingParams) -> str:
    """Sampling settings in words: "greedy", or "temperature 0.6, top-p 0.95, top-k 20"."""
    if params.greedy:
        return "greedy"
    return f"temperature {params.temperature:g}, top-p {params.top_p:g}, top-k {params.top_k or 'off'}"


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from, for logits [..., vocab] (float32)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass
        # before it is still below top_p (so the most likely token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from the logits of one position ([vocab] or [1, vocab])."""
    if params.greedy and logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous():
        got = layer_kernel.argmax(logits)         # one position: its numel is the vocabulary
        if got is not None:
            return got
    logits = logits.reshape(-1)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=gen))


# ---------------------------------------------------------------- speculative acceptance
#
# Leviathan et al. 2023: a drafted token x (drawn from q) is kept with probability
# min(1, p(x)/q(x)); after a rejection the replacement is drawn from norm(max(0, p - q)).
# The token emitted at that position then has exactly the distribution p. A one-hot q
# (the n-gram drafter) keeps x with probability p(x) and, after a rejection, draws from
# p with x removed.

def accept_probability(p_x: float, q_x: float) -> float:
    if q_x <= 0:
        return 0.0       # q never proposes x; reached only through rounding
    return min(1.0, p_x / q_x)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to sample after rejecting a draft from q."""
    r = (p - q).clamp_(min=0)
    total = r.sum()
    if total <= 0:       # p == q: a rejection has probability 0; fall back to p
        return p
    return r / total


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """Greedy verification over k+1 positions: how many drafts agree with the target's
    argmax, and the target's own token after them (the correction, or the bonus)."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sampled(target_logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                   params: SamplingParams, gen: torch.Generator | None,
                   after: torch.Tensor | None = None) -> tuple[int, int]:
    """Sampled verification: (number of drafts kept, the next token). q is [k, vocab]
    (the drafter's distributions after the same processing), or None for one-hot drafts.
    `after`: the drafter's distribution at the position after the last draft, where a
    grammar cut a draft it forbids. That draft counts as drawn and rejected (p gives it 0),
    so the position samples from the residual, as the rule says, not from p."""
    p = probabilities(target_logits, params)
    uniforms = torch.rand(len(drafts), generator=gen, device=p.device).tolist() if drafts else []
    for i, x in enumerate(drafts):
        q_i = one_hot(x, p[i]) if q is None else q[i]
        if uniforms[i] < accept_probability(float(p[i, x]), float(q_i[x])):
            continue
        return i, int(torch.multinomial(residual(p[i], q_i), 1, generator=gen))
    last = p[len(drafts)] if after is None else residual(p[len(drafts)], after)
    return len(drafts), int(torch.multinomial(last, 1, generator=gen))
