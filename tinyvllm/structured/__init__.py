"""Structured outputs: constraints on what a request may generate, enforced in the sampler.

    params.py      StructuredOutputsParams (json schema, regex, choice, grammar, json_object)
    grammar.py     the library (llguidance) and why; GrammarCompiler: tokenizer bridge, compiled
                   grammars, a matcher per sequence (Constraint)
    mask.py        each step's token bitmask of the constrained rows (TokenMask)
    tool_calls.py  OpenAI tools: the tool-call format of a model family, the grammar that
                   enforces tool_choice "required" / a named function, and the parser that
                   turns output text back into tool calls

The engine's side (docs/engine.md, "Structured outputs"): add_request gives each sequence of a
constrained request a Constraint (GrammarCompiler.attach); every step that samples such a row
builds a TokenMask on the host, and the sampler sets each refused token's logit to -inf before
the sampling rule (numpy: reference/sampling.py; CUDA: cuda/token_mask.cu, launched only
for steps with a mask); each sampled token advances the row's matcher (output_processor.py), and
the request finishes with "stop" once the grammar is complete.
"""
from tinyvllm.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
