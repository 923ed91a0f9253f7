"""Turning logits into the next token: greedy, or sampling with temperature, top-k and
top-p. `probabilities` gives the distribution actually sampled from, which speculative
verification needs for its acceptance rule."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import BadRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise BadRequest(f"--temperature {self.temperature}: must be 0 (greedy) or more")
        if self.top_k < 0:
            raise BadRequest(f"--top-k {self.top_k}: must be 0 (off) or a positive count")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"--top-p {self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    logits = logits.reshape(-1)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=gen))
