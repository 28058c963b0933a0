"""From StructuredOutputsParams to one grammar matcher per sequence, with llguidance.

The library: llguidance (Rust, numpy bitmasks, no torch). Measured on this project's two
vocabularies (x86-64 CPU, 2026-12-07, means over the tokens; benchmarks/structured_mask_bench.py
--compare), one JSON schema with an enum, an integer range, a string array and a nested object,
walked token by token (mask computed, then the token consumed):

                                 Llama 3 (128,256 tokens)    SmolLM2 (49,152 tokens)
    llguidance 1.9.1             compile 1 ms, 241 us/token  compile 1 ms, 103 us/token
    outlines-core 0.2.14         compile 1,581 ms, 1,408 us  compile 363 ms, 306 us/token
    xgrammar 0.2.9               not installable without torch (it imports torch at import time)

llguidance computes masks lazily over a token trie, so a new schema costs about a millisecond
where outlines-core builds a whole regex index over the vocabulary first (seconds per schema on
Llama 3), and its masks are several times cheaper per token too.

GrammarCompiler is one engine's bridge: the engine's tokenizer as llguidance's LLTokenizer
(made on first use: ~0.2 s for SmolLM2's vocabulary, ~0.7 s for Llama 3's), the model's
vocabulary size (the mask covers every logit; ids past the tokenizer's are never allowed), the
engine's EOS ids (allowed exactly when the grammar is complete), and compiled grammars cached by
their text. A constraint the library cannot compile is one InvalidRequestError naming the
library's complaint; the server sends it as a 400.
"""
from __future__ import annotations

import functools
import json
import threading

from tinyvllm.engine.sequence import SequenceStatus
from tinyvllm.errors import InvalidRequestError
from tinyvllm.structured.params import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256      # distinct compiled constraints kept per engine


class Constraint:
    """One sequence's place in its grammar (Sequence.constraint): the engine computes its mask
    before each step that samples it (structured/mask.py) and advances it with each token."""
    __slots__ = ("matcher", "mask_words")

    def __init__(self, matcher, mask_words: int):
        self.matcher, self.mask_words = matcher, mask_words

    def advance(self, seq, token: int) -> SequenceStatus | None:
        """Consume the token just appended to seq -> FINISHED_STOPPED once the grammar is
        complete (nothing but EOS could follow), FINISHED_ERROR (with seq.error) for a token the
        grammar refuses (the mask makes that impossible: it means a bug), else None."""
        if not self.matcher.consume_token(int(token)):
            seq.error = (f"token {int(token)} is outside the request's grammar: "
                         f"{self.matcher.get_error() or 'refused'}")
            return SequenceStatus.FINISHED_ERROR
        return SequenceStatus.FINISHED_STOPPED if self.matcher.is_stopped() else None


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.mask_words = (self.vocab_size + 31) // 32
        self._lock = threading.Lock()        # the server compiles in worker threads
        self._ll_tokenizer = None
        self._compile = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile_uncached)

    @property
    def ll_tokenizer(self):
        """The engine's tokenizer as llguidance sees it (made once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def grammar(self, so: StructuredOutputsParams) -> str:
        """The constraint as an llguidance grammar, checked against the tokenizer (cached by its
        text). Raises InvalidRequestError when the library cannot compile it."""
        return self._compile(so.kind, _key(so), so.disable_any_whitespace)

    def attach(self, params, seqs) -> None:
        """Give each sequence of a request its own matcher at the grammar's start (a request
        without structured_outputs: nothing)."""
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return
        import llguidance
        first = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(so), log_level=0)
        if first.is_error():
            raise InvalidRequestError(f"structured_outputs.{so.kind} cannot be compiled: {first.get_error()}")
        for i, seq in enumerate(seqs):
            seq.constraint = Constraint(first if i == 0 else first.deep_copy(), self.mask_words)

    def _compile_uncached(self, kind: str, key: str, compact: bool) -> str:
        import llguidance
        from llguidance import LLMatcher
        try:
            if kind in ("json", "json_object"):
                schema = json.loads(key)
                if schema is False:
                    raise ValueError("the schema `false` matches nothing")
                grammar = LLMatcher.grammar_from_json_schema({} if schema is True else schema,
                                                             defaults={"whitespace_flexible": not compact})
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(key)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in json.loads(key)))
            else:
                grammar = llguidance.grammar_from("grammar", key)    # Lark, or GBNF made Lark
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        except ValueError as e:
            is_error, messages = True, [str(e)]
        if is_error:
            raise InvalidRequestError(f"structured_outputs.{kind} cannot be compiled: "
                                      f"{(messages or ['invalid'])[0].strip()}")
        return grammar


def _key(so: StructuredOutputsParams) -> str:
    if so.kind in ("json", "json_object"):
        return json.dumps(so.schema)      # key order kept: the output follows it
    if so.kind == "choice":
        return json.dumps(list(so.choice))
    return so.regex if so.kind == "regex" else so.grammar
