"""Constrained decoding: a grammar (a JSON schema, a tool call) as a mask over the logits.

The grammar runs in llguidance (a maintained Rust library, the one vLLM, SGLang and
llama.cpp offer): from a parser state it computes which tokens may come next in tens of
microseconds, and it rolls back by a count of tokens. That rollback is what speculation
needs: a draft is checked token by token, every verified row gets the mask of the state
after the drafts before it, and the tokens the target rejects are taken back, so the
grammar's state always equals the committed tokens'. Greedy constrained output with a
drafter is then plain greedy constrained output, token for token.

A thinking model reasons first, unconstrained: the grammar starts after the reasoning
block closes. Where the prompt leaves the block open, it starts when the model closes it;
where the model may open one itself, its first position also allows the opening tag.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .errors import BadRequest
from .reasoning import CLOSE, OPEN

# A JSON answer on one line with the usual separators: a grammar that allows any
# whitespace lets a small model run on in newlines until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What the answer must match, checked when made (before a request runs). `what` names
    where it came from (a flag, a request field) for error messages."""
    source: str
    what: str = "grammar"
    schema: dict | None = None        # the JSON schema it was made from (sent on to a remote server)

    @classmethod
    def json_schema(cls, schema, what: str = "json_schema") -> "Grammar":
        if isinstance(schema, bool) or not isinstance(schema, dict):
            raise BadRequest(f"{what}: the schema must be a JSON object, got {type(schema).__name__}")
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(closed(schema), defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"{what}: not a JSON schema ({exc})") from None
        return cls._checked(source, what, schema)

    @classmethod
    def json_object(cls, what: str = "json_object") -> "Grammar":
        return cls.json_schema({"type": "object"}, what)

    @classmethod
    def lark(cls, text: str, what: str = "grammar") -> "Grammar":
        return cls._checked(_llguidance().LLMatcher.grammar_from_lark(text), what)

    @classmethod
    def _checked(cls, source: str, what: str, schema: dict | None = None) -> "Grammar":
        error = _llguidance().LLMatcher.validate_grammar(source)
        if error:
            raise BadRequest(f"{what}: constrained decoding cannot enforce this schema: {_first_line(error)}")
        return cls(source, what, schema)


def json_rule(schema) -> str:
    """A JSON value matching `schema` inside a lark grammar, written as a JSON answer is."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": _JSON_OPTIONS})


def closed(schema):
    """The schema with every object that lists its properties closed to others, unless it
    says otherwise (and unbounded integers bounded, below): JSON Schema's default admits any further key, and a small model then
    invents keys until max_tokens cuts the object off (OpenAI's strict mode requires
    additionalProperties: false for the same reason)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else closed(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    # An integer without bounds gets the range JSON parsers agree on (RFC 8259: IEEE
    # doubles hold integers exactly up to 2^53): a model repeating a digit ends there.
    if out.get("type") == "integer" and not ({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(out)):
        out["minimum"], out["maximum"] = -(2 ** 53 - 1), 2 ** 53 - 1
    return out


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401
    except ImportError:
        raise BadRequest("constrained decoding needs the llguidance package: pip install llguidance") from None
    return llguidance


# Per tokenizer, weakly: an engine unloaded (a server's model) takes its entry with it.
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab: int):
    """llguidance's view of the model's tokenizer (built once per tokenizer: about half a
    second for a 50k vocabulary). `vocab` is the logits' width: ids past the tokenizer's
    own are never allowed."""
    _llguidance()
    from llguidance import hf
    with _tokenizers_lock:
        entry = _tokenizers.get(tokenizer)
        if entry is None or entry[1] != vocab:
            entry = _tokenizers[tokenizer] = (hf.from_tokenizer(tokenizer, n_vocab=vocab), vocab)
    return entry[0]


# The phases of an answer under a constraint.
FREE_FIRST = 0      # the model may open a reasoning block at its first token
THINKING = 1        # inside the reasoning: nothing is masked
ACTIVE = 2          # the grammar applies


def first_phase(tokenizer, prompt_text: str, thinks: bool) -> int:
    """Where a constrained answer starts, from the rendered prompt: inside reasoning the
    prompt opened, free to open it, or in the grammar at once (no reasoning, or the
    template closed an empty block because thinking is off)."""
    if not thinks:
        return ACTIVE
    if prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE):
        return THINKING
    if prompt_text.rstrip().endswith(CLOSE) or _single_token(tokenizer, OPEN) is None:
        return ACTIVE
    return FREE_FIRST


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


class Constraint:
    """One answer's grammar state. consume() the tokens as they are committed, mask()
    the logits of the next position, rollback() what a verify pass rejected."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int, phase: int = ACTIVE):
        llg = _llguidance()
        self._torch = llg.torch
        self.tokenizer, self.vocab = tokenizer, vocab
        self.matcher = llg.LLMatcher(grammar_tokenizer(tokenizer, vocab), grammar.source)
        if self.matcher.is_error():
            raise BadRequest(f"{grammar.what}: {_first_line(self.matcher.get_error())}")
        self.what = grammar.what
        self.phase = phase
        self.open_id = _single_token(tokenizer, OPEN) if phase == FREE_FIRST else None
        # per consumed token: (phase before it, whether the matcher consumed it, reasoning text it added)
        self._steps: list[tuple[int, bool, str]] = []
        self._reasoning = ""                  # the reasoning's tail, to find the closing tag
        self._bits = self._torch.allocate_token_bitmask(1, vocab)

    # -- state
    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow."""
        return self.phase == ACTIVE and self.matcher.is_stopped()

    def error(self) -> str:
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else ""

    def consume(self, token: int) -> bool:
        """Commit one token; False (and nothing changes) when the grammar forbids it."""
        phase = self.phase
        if phase == ACTIVE:
            if self.matcher.validate_tokens([token]) != 1 or not self.matcher.consume_token(token):
                return False
            self._steps.append((phase, True, ""))
            return True
        if phase == FREE_FIRST:
            if token == self.open_id:
                self.phase = THINKING
                self._steps.append((phase, False, ""))
                return True
            self.phase = ACTIVE
            if self.consume(token):
                self._steps[-1] = (phase, True, "")
                return True
            self.phase = phase
            return False
        text = self.tokenizer.decode([token])
        self._steps.append((phase, False, text))
        self._reasoning = (self._reasoning + text)[-4 * len(CLOSE):]
        if CLOSE in self._reasoning:
            self.phase = ACTIVE
        return True

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from this state, the grammar allows in a row."""
        n = 0
        for t in tokens:
            if not self.consume(t):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Take back the last n consumed tokens."""
        if n <= 0:
            return
        taken, self._steps = self._steps[-n:], self._steps[:-n]
        grammar_tokens = sum(1 for _, used, _ in taken if used)
        if grammar_tokens:
            self.matcher.rollback(grammar_tokens)
        self.phase = taken[0][0]
        self._reasoning = "".join(text for _, _, text in self._steps[-8:])[-4 * len(CLOSE):]

    # -- masks
    def _fill(self, row: int) -> bool:
        """The allowed tokens of the next position as bits in self._bits[row]; False while
        reasoning (nothing masked)."""
        if self.phase == THINKING:
            return False
        self._torch.fill_next_token_bitmask(self.matcher, self._bits, row)
        if self.phase == FREE_FIRST and self.open_id is not None:
            word, bit = divmod(self.open_id, 32)
            self._bits[row, word] |= _bit(bit)
        return True

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Forbidden tokens of the next position set to -inf, in place ([vocab] or [1, vocab])."""
        if self._fill(0):
            self._apply(logits.view(1, -1), 0, 1)
        return logits

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Rows of a verify pass over [token] + drafts: row i masked as the state after
        drafts[:i] allows. The drafts must be allowed (allowed_prefix); the state is as before."""
        n = len(drafts) + 1
        if self._bits.shape[0] < n:
            self._bits = self._torch.allocate_token_bitmask(n, self.vocab)
        masked = []
        for i in range(n):
            if self._fill(i):
                masked.append(i)
            if i < len(drafts) and not self.consume(drafts[i]):
                raise AssertionError("a draft the grammar forbids reached verification")
        self.rollback(len(drafts))
        if masked:            # reasoning rows come first: the masked ones are a tail
            self._apply(logits[masked[0]:n], masked[0], n)
        return logits

    def _apply(self, logits: torch.Tensor, lo: int, hi: int) -> None:
        """-inf where self._bits[lo:hi] has no bit. Unpacked with numpy: llguidance's own
        helper is a torch.compile'd function (seconds to compile, and a C++ compiler)."""
        bits = self._bits[lo:hi].numpy()
        if not bits.any(axis=-1).all():
            raise BadRequest(f"{self.what}: no token can continue the answer "
                             f"({self.error() or 'the grammar has no way on'})")
        allowed = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[-1]]
        if logits.device.type == "cpu":
            np.putmask(logits.numpy(), allowed == 0, -np.inf)
        else:
            logits.masked_fill_(torch.from_numpy(allowed == 0).to(logits.device, non_blocking=True), float("-inf"))


def _bit(i: int) -> int:
    """Bit i of an int32 word (bit 31 is the sign)."""
    return (1 << i) if i < 31 else -(1 << 31)


def loads_schema(text: str, what: str):
    """A schema read from a file or a request: JSON, or one line saying what is wrong."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"{what}: not JSON ({exc})") from None
