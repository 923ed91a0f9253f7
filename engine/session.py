"""A conversation: chat template, turns, and reuse of the cached prefix.

Each turn renders the whole conversation with the tokenizer's chat template and
compares it with the tokens already in the KV cache: the common prefix is kept, the
cache is rolled back to it, and only the rest is prefilled. So turn N costs the new
message, not the whole history (the last answer normally re-tokenizes to the tokens
that were generated)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from . import decode as decoding
from . import speculative
from .cache import common_prefix
from .detokenize import IncrementalDecoder
from .checkpoint import nonfinite_reason
from .errors import BadRequest, BadWeights, EngineError
from . import constrain, reasoning, tools as toolcalls
from .events import Done, Stats, TextDelta
from .sampling import SamplingParams, make_generator
from .stats import StatsTracker

_FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
SUMMARY_REQUEST = ("Summarise the conversation below in a few sentences. Keep every name, number, decision and "
                   "open question; write only the summary.\n\n")


def render_text(tokenizer, messages: list[dict], thinking: bool | None = None,
                tools: list | None = None) -> tuple[str, bool]:
    """The conversation as text, ending where the assistant's answer begins, and whether
    the tokenizer should add its own special tokens (only for the no-template fallback).
    `thinking`: the template's `enable_thinking` (None: the template's default).
    `tools`: engine.tools.Tool descriptions the template lists for the model."""
    if getattr(tokenizer, "chat_template", None):
        extra = {} if thinking is None else {"enable_thinking": thinking}
        if tools:
            extra["tools"] = [t.as_template() for t in tools]
        try:
            return tokenizer.apply_chat_template([_templated(m) for m in messages], tokenize=False,
                                                 add_generation_prompt=True, **extra), False
        except Exception as exc:
            if messages and messages[0]["role"] == "system":
                # Some templates refuse a system role: fold it into the first user message.
                system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
                if rest:
                    rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
                return render_text(tokenizer, rest, thinking, tools)
            raise BadRequest(f"the model's chat template failed: {exc}") from None
    # A base model without a template: a plain transcript it can continue.
    text = "".join(f"{_FALLBACK_ROLES.get(m['role'], m['role'])}: {m['content']}\n\n" for m in messages)
    return text + "Assistant:", True


def _templated(m: dict) -> dict:
    """A message as chat templates read it: tool calls in OpenAI's shape, arguments a mapping."""
    if not m.get("tool_calls"):
        return m
    calls = [{"type": "function", "id": c.get("id", ""), "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _deltas(splitter, watch, text: str, last: bool = False):
    """TextDelta events for newly decoded `text`: split into reasoning and answer where the
    model reasons, the answer's tool calls held back where it may call tools."""
    pieces = ([(False, text)] if text else []) if splitter is None else (splitter.push(text) if text else [])
    if last and splitter is not None:
        pieces += splitter.flush()
    for is_reasoning, piece in pieces:
        if not is_reasoning and watch is not None:
            piece = watch.push(piece)
        if piece:
            yield TextDelta(piece, is_reasoning)
    if last and watch is not None:
        tail = watch.flush()
        if tail:
            yield TextDelta(tail)


def encode(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation, ending where the assistant's answer begins."""
    text, special = render_text(tokenizer, messages)
    return encode(tokenizer, text, special)


class Messages:
    """A conversation's messages: what a chat holds, whoever writes its answers (the
    engine here, a server for localchat's --backend)."""

    def __init__(self, system: str | None = None):
        self.messages: list[dict] = []
        if system:
            self.messages.append({"role": "system", "content": system})

    def set_system(self, system: str | None) -> None:
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if system:
            self.messages.insert(0, {"role": "system", "content": system})

    def clear(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]

    def keep(self) -> bool:
        """Keep this conversation's cache to resume it warm (Chat.keep); where answers are
        written elsewhere there is none to keep."""
        return False

    def restore(self, messages: list[dict]) -> None:
        """Replace the conversation (a saved one resumed, or the turns before a retried
        answer). Not while an answer is being generated. The KV cache is not touched:
        the next turn keeps whatever prefix of it still matches, as any turn does.
        An assistant message may hold `tool_calls` ({name, arguments: dict, id?}), and a
        `tool` message a call's result (content, tool_call_id?)."""
        roles = ("system", "user", "assistant", "tool")
        out = []
        for i, m in enumerate(messages):
            if m.get("role") not in roles or not isinstance(m.get("content"), str):
                raise BadRequest(f"message {i}: needs a role ({', '.join(roles)}) and text content")
            kept = {"role": m["role"], "content": m["content"]}
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = m["tool_calls"]
                if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
                           for c in calls):
                    raise BadRequest(f"message {i}: each tool call needs a name and an arguments object")
                kept["tool_calls"] = [dict(c) for c in calls]
            if m["role"] == "tool" and m.get("tool_call_id"):
                kept["tool_call_id"] = str(m["tool_call_id"])
            out.append(kept)
        self.messages = out


class Chat(Messages):
    def __init__(self, engine, system: str | None = None):
        super().__init__(system)
        self.engine = engine
        self.cached_ids: list[int] = []      # the tokens the target's KV cache holds, in order
        # The conversation so far as rendered text and as the tokens the model actually
        # saw and produced: a generated answer need not re-tokenize to the same ids, so
        # the next turn appends to these ids instead of re-tokenizing the whole text.
        self._turn_text = ""
        self._turn_ids: list[int] = []
        self.last_stats: Stats | None = None
        self.last_done: Done | None = None
        # a thinking model's `enable_thinking` for its template; None: the template's default
        self.thinking: bool | None = None
        self._cancel = threading.Event()
        # Acceptance and pass costs are measured per chat: they depend on the text.
        self.controller = engine.new_controller()

    # -- control from other threads
    def cancel(self) -> None:
        """Stop the answer in progress between two steps; its text stays in the conversation."""
        self._cancel.set()

    def _prompt(self, tools=None) -> tuple[list[int], str]:
        """Token ids and text of the conversation up to the answer about to be written."""
        tok = self.engine.tokenizer
        text, special = render_text(tok, self.messages[:-1], self.thinking, tools)
        if self._turn_text and text.startswith(self._turn_text):
            return self._turn_ids + encode(tok, text[len(self._turn_text):]), text
        store = self.engine.resume
        kept = store.turn(self.engine.resume_key(), text) if store is not None else None
        if kept is not None:            # a conversation resumed: its ids as the chat that never closed had them
            return kept[1] + encode(tok, text[len(kept[0]):]), text
        return encode(tok, text, special), text

    def prompt_tokens(self, text: str) -> int:
        """How many tokens the conversation would be with `text` as the next user message,
        up to where the answer begins (nothing changes): to see whether a turn fits."""
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        try:
            return len(self._prompt()[0])
        finally:
            del self.messages[-2:]

    def summarise(self, messages: list[dict], max_new_tokens: int = 256) -> str:
        """`messages` in a few sentences the model writes (greedy, no reasoning), to stand for
        them where the context cannot hold them all. Runs a chat of its own on the engine
        (this one's cache is given up); `cancel()` on this chat stops it."""
        said = [f"{m['role']}: {m['content']}" for m in messages if m["role"] in ("user", "assistant")]
        room = self.engine.target.cache.max_positions
        max_new_tokens = max(1, min(max_new_tokens, room // 8))
        other = Chat(self.engine)
        other.thinking = False
        other._cancel = self._cancel
        self._cancel.clear()
        while True:
            other.messages = [{"role": "user", "content": SUMMARY_REQUEST + "\n\n".join(said)}]
            try:
                rendered = other._prompt_checked()
            except BadRequest:
                if len(said) <= 1:
                    raise
                said = said[1:]         # what the context holds of them, the latest
                continue
            if len(rendered[0]) + max_new_tokens <= room or len(said) <= 1:
                break
            said = said[1:]
        for _ in other._answer({"role": "assistant", "content": ""}, SamplingParams(), max_new_tokens, rendered):
            pass
        if other.last_done.reason == "error":
            raise BadRequest(f"the summary failed: {other.last_done.error}")
        return other.last_done.text.strip()

    def _prompt_checked(self) -> tuple[list[int], str]:
        self.messages.append({"role": "assistant", "content": ""})
        try:
            rendered = self._prompt()
        finally:
            del self.messages[-1]
        room = self.engine.target.cache.max_positions
        if len(rendered[0]) >= room:
            raise BadRequest(f"the conversation is {len(rendered[0])} tokens and the model's context holds {room}")
        return rendered

    def keep(self) -> bool:
        """Write what the KV cache holds for this chat to the engine's resume store, so the
        conversation resumes without prefilling it again (a chat UI closing or switching
        away, a one-shot answer). False where there is no store, the cache is another
        chat's, or the store did not take it (too short, over budget: `store.problem`)."""
        store = self.engine.resume
        if store is None or self.engine.cache_owner is not self or not self.cached_ids:
            return False
        return store.save(self.engine.resume_key(), self.engine.target.cache, self.cached_ids,
                          self._turn_text, self._turn_ids) is not None

    # -- a turn
    def send(self, text: str, max_new_tokens: int = 512, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             grammar: constrain.Grammar | None = None, tools: list | None = None,
             tool_choice: str = "auto", parallel_tool_calls: bool = True) -> Iterator:
        """Add a user message and stream the answer: TextDelta..., Stats..., Done.
        `grammar`: the answer (after any reasoning) must match it (engine.constrain).
        `tools` (engine.tools.Tool): the template lists them and the calls the model writes
        come in Done.tool_calls; `tool_choice` auto | none | required | a tool's name
        (required and a name are enforced by a grammar).
        Bad arguments raise BadRequest before anything changes; failures during the
        answer end it with Done('error') and keep what was written."""
        if not text or not text.strip():
            raise BadRequest("the prompt is empty; type a question")
        self.messages.append({"role": "user", "content": text})
        try:
            return self.reply(max_new_tokens, temperature, top_p, top_k, seed, grammar, tools, tool_choice,
                              parallel_tool_calls)
        except BadRequest:
            del self.messages[-1]
            raise

    def reply(self, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              seed: int | None = None, grammar: constrain.Grammar | None = None, tools: list | None = None,
              tool_choice: str = "auto", parallel_tool_calls: bool = True) -> Iterator:
        """The next answer to the conversation as it stands (its last message the user's, or
        a tool's result), streamed as send() streams it."""
        if not self.messages or self.messages[-1]["role"] not in ("user", "tool"):
            raise BadRequest("the conversation must end with a user message or a tool result to answer")
        if max_new_tokens <= 0:
            raise BadRequest(f"--max-tokens {max_new_tokens}: must be at least 1")
        params = SamplingParams(temperature, top_k, top_p, seed)
        fam, tools, grammar = self._tools(tools, tool_choice, parallel_tool_calls, grammar)
        answer = {"role": "assistant", "content": ""}
        self.messages.append(answer)
        try:
            rendered = self._prompt(tools)
            room = self.engine.target.cache.max_positions
            if len(rendered[0]) >= room:    # the answer needs at least one position more
                raise BadRequest(f"the conversation is {len(rendered[0])} tokens and the model's context holds "
                                 f"{room}; shorten the prompt or start a new chat")
            constraint = self._constraint(grammar, rendered[1], split=True)
        except BadRequest:
            del self.messages[-1]            # refused: the conversation is as it was
            raise
        self._cancel.clear()
        return self._answer(answer, params, max_new_tokens, rendered, constraint=constraint,
                            calls=(fam, tools) if tools else None)

    def _tools(self, tools, choice: str, parallel: bool, grammar):
        """The tool-call family, the tools the template lists, and the grammar the answer
        is held to (a required or named choice)."""
        if not tools or choice == "none":
            return None, None, grammar
        fam = toolcalls.family(self.engine.tokenizer)
        if fam is None:
            raise BadRequest("tools: this model's chat template has no tool-call format; serve it with a template "
                             "that has one (--chat-template FILE)")
        if choice == "auto":
            return fam, tools, grammar
        if grammar is not None:
            raise BadRequest("response_format: a required tool call and a response format cannot both hold; "
                             "drop one")
        if choice != "required":
            named = [t for t in tools if t.name == choice]
            if not named:
                raise BadRequest(f"tool_choice: no tool named {choice!r} among the tools")
            tools_called = named
        else:
            tools_called = tools
        return fam, tools, toolcalls.grammar(fam, tools_called, parallel and choice == "required")

    def _constraint(self, grammar, prompt_text: str, split: bool):
        if grammar is None:
            return None
        tok = self.engine.tokenizer
        phase = constrain.first_phase(tok, prompt_text, split and reasoning.thinks(tok))
        return constrain.Constraint(grammar, tok, self.engine.target.vocab_size, phase)

    def complete(self, prompt: str, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 grammar: constrain.Grammar | None = None) -> Iterator:
        """Continue `prompt` as plain text, without the chat template (a completions API):
        TextDelta..., Stats..., Done, as send() streams them. The text is tokenized as the
        model's tokenizer does a document (its BOS token where it adds one). It is not a
        turn: the conversation is emptied first and stays empty after; the KV cache keeps
        the longest prefix a later completion shares."""
        if not prompt:
            raise BadRequest("the prompt is empty")
        if max_new_tokens <= 0:
            raise BadRequest(f"max_tokens {max_new_tokens}: must be at least 1")
        params = SamplingParams(temperature, top_k, top_p, seed)
        ids = encode(self.engine.tokenizer, prompt, add_special_tokens=True)
        room = self.engine.target.cache.max_positions
        if len(ids) >= room:
            raise BadRequest(f"the prompt is {len(ids)} tokens and the model's context holds {room}; shorten it")
        constraint = self._constraint(grammar, prompt, split=False)
        self.messages = []
        self._cancel.clear()
        return self._completion(params, max_new_tokens, ids, prompt, constraint)

    def _completion(self, params, max_new_tokens: int, ids: list[int], prompt: str, constraint) -> Iterator:
        try:
            yield from self._answer({"role": "assistant", "content": ""}, params, max_new_tokens, (ids, prompt),
                                    split=False, constraint=constraint)
        finally:
            self._turn_text, self._turn_ids = "", []       # a chat turn after it renders afresh

    def _switch(self, prompt: list[int], keep: int) -> int:
        """Where the engine keeps caches: before a prompt that drops most of what the cache
        holds (another conversation), keep it; then load the longest kept prefix of the
        prompt if it is longer than what the cache shares. The tokens loaded, or 0."""
        store = self.engine.resume
        if store is None:
            return 0
        dropped = len(self.cached_ids) - keep
        if dropped >= store.min_tokens and dropped * 2 >= len(self.cached_ids):
            self.keep()
        if len(prompt) - keep <= store.min_tokens // 2:
            return 0                  # a few tokens to prefill: quicker than reading a file
        cache = self.engine.target.cache
        got = store.restore(self.engine.resume_key(), cache, prompt, keep)
        if got:
            self.cached_ids = list(prompt[:got])
        elif cache.length != len(self.cached_ids):       # an entry failed to load into it
            self.cached_ids = []
            cache.rollback(0)
        return got

    def _answer(self, answer: dict, params: SamplingParams, max_new_tokens: int,
                rendered: tuple[list[int], str], split: bool = True, constraint=None, calls=None) -> Iterator:
        eng, target = self.engine, self.engine.target
        detok = IncrementalDecoder(eng.tokenizer)
        # the conversation's content keeps the model's text whole (its template splits
        # reasoning off past turns); the deltas and Done carry the two apart
        splitter = (reasoning.Splitter(reasoning.open_at_end(rendered[1]))
                    if split and reasoning.thinks(eng.tokenizer) else None)
        watch = toolcalls.CallWatch(calls[0]) if calls else None
        generated: list[int] = []
        thought_tokens = 0
        reason, error, bad_weights = "length", "", False
        tracker = None
        try:
            prompt, prompt_text = rendered
            eng.claim_cache(self)
            keep = common_prefix(self.cached_ids, prompt)
            started = time.perf_counter()
            restored = self._switch(prompt, keep)
            restore_seconds = time.perf_counter() - started if restored else 0.0
            keep = common_prefix(self.cached_ids, prompt)     # what the cache holds now
            if keep == len(prompt):
                keep -= 1          # at least one token must run to get the next logits
            # A recurrent state goes back only to a kept checkpoint or to the start
            # (engine.cache.RecurrentCache); a position-indexed cache to any length.
            keep = target.cache.restorable(keep)
            target.cache.rollback(keep)
            self.cached_ids = self.cached_ids[:keep]
            tracker = StatsTracker(target, len(prompt), len(prompt) - keep, restored, restore_seconds)
            first = None
            # In chunks: Esc, Ctrl-C or a client gone stops a long prompt within one chunk,
            # and each chunk but the last reports progress.
            for done, first in decoding.prefill_chunks(target, prompt[keep:]):
                self.cached_ids = prompt[:keep + done]
                if first is None:
                    tracker.prefill_progress(done)
                    yield tracker.snapshot()
                    if self._cancel.is_set():
                        break
            if first is not None and not bool(torch.isfinite(first).all()):
                # at the latest here: weights no loader checked (streamed), or an overflow
                raise BadWeights(nonfinite_reason(eng.checkpoint.path, target.cache.dtype))
            if first is None:               # stopped within the prefill: no token to show yet
                reason = "cancelled"
            else:
                self.cached_ids = list(prompt)
                target.cache.checkpoint()      # the turn boundary a re-rendered next turn can restore
                tracker.prefill_done()
                gen = make_generator(params, target.device)
                passes = speculative.generate(target, eng.drafter, self.controller, self.cached_ids, first, params, gen,
                                              max_new_tokens, eng.stop_ids, self._cancel, tracker.rounds,
                                              constraint)
                for i, tokens in enumerate(passes):
                    tracker.pass_done(len(tokens), first=i == 0)
                    generated.extend(tokens)
                    if splitter is not None and splitter.inside:
                        thought_tokens += len(tokens)
                    shown = [t for t in tokens if t not in eng.stop_ids]
                    delta = detok.push(shown) if shown else ""
                    if delta:
                        answer["content"] += delta
                        if splitter is None and watch is None:    # the common case, per pass: no generator
                            yield TextDelta(delta)
                        else:
                            yield from _deltas(splitter, watch, delta)
                    if tokens[-1] in eng.stop_ids or (constraint is not None and constraint.done):
                        reason = "stop"
                    if tracker.due():
                        yield tracker.snapshot()
                if self._cancel.is_set():
                    reason = "cancelled"
                elif reason == "length" and len(generated) < max_new_tokens:
                    # never a silent cut: the answer filled what the context holds
                    error = (f"the context is full ({target.cache.max_positions:,} tokens); start a new chat, or "
                             "drop or summarise the oldest turns")
        except EngineError as exc:
            reason, error = "error", str(exc)
            bad_weights = isinstance(exc, BadWeights)
        except RuntimeError as exc:   # torch failures (out of memory, a read error) end the answer, not the app
            reason, error = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        except (GeneratorExit, KeyboardInterrupt):
            # The consumer stopped listening (closed the stream, Ctrl-C): what was
            # written stays in the conversation, as after cancel().
            reason = "cancelled"
            raise
        finally:
            tail = detok.flush()
            if tail:
                answer["content"] += tail
            tail_deltas = list(_deltas(splitter, watch, tail, last=True))
            if self.engine.cache_owner is self:
                # A pass that failed midway committed nothing: keep the bookkeeping honest.
                self.cached_ids = self.cached_ids[:target.cache.length]
                target.cache.rollback(len(self.cached_ids))
            if tracker is not None:
                self.last_stats = tracker.snapshot()
                kept = list(generated)
                if kept and kept[-1] in eng.stop_ids:
                    kept.pop()   # the template writes its own end-of-turn after the answer
                self._turn_text = prompt_text + answer["content"]
                self._turn_ids = prompt + kept
            text, thought = ((splitter.answer, splitter.reasoning.strip()) if splitter is not None
                             else (answer["content"], ""))
            found = toolcalls.Parsed(text)
            if calls:
                found = toolcalls.parse(calls[0], text, calls[1])
                if not found.calls and watch.in_call and watch.held:
                    tail_deltas.append(TextDelta(watch.held))    # held as a call, and not one: text after all
            self.last_done = Done(reason, tuple(generated), found.content, error, bad_weights, thought,
                                  found.calls, found.error, thought_tokens if thought else 0)
        yield from tail_deltas
        yield self.last_stats if self.last_stats else Stats()
        yield self.last_done
