"""The bytes floor of a workload: a lower bound on any engine's wall time for it on this card,
from the bytes the run cannot avoid reading, at the copy bandwidth measured there
(bench/machine.py). The report shows each engine's output tok/s as a fraction of the floor's, so
a ratio to a peer can be read against what is left above both.

What the floor counts (ModelConfig's shapes, the workload's own requests):
  * the weights, once a step: a request's tokens come one a step, so a run takes at least
    max(output_len) steps, and each step streams every weight it multiplies (weight_bytes);
  * the K/V cache, once a decoded token: the token after position c - 1 attends to c positions
    (its own included), per layer within that layer's sliding window; the positions of a shared
    prefix (the prefix workload's system prompt) once a step for all sequences together, as
    cascade attention reads them, and only on full-attention layers.
What it leaves out, so that it stays a lower bound: the prompts' weight reads (a mixed step
shares its decode rows' reads), K/V writes, activations, and all compute — prefill is
compute-bound, so a workload with long prompts sits further above its bytes floor than a
decode-heavy one. batch 1 keeps its own floor (tokens a second at one step a weight read:
BenchReport's floor_tok_s)."""
from __future__ import annotations

import numpy as np

from tinyvllm.bench.workloads import WorkloadSpec
from tinyvllm.config import ModelConfig


def kv_bytes_a_position(config: ModelConfig) -> int:
    """One layer's K and V of one position, bf16."""
    return config.kv_bytes_per_token // config.num_hidden_layers


def kv_bytes_read(config: ModelConfig, contexts: np.ndarray, shared: int = 0) -> int:
    """Bytes of K/V that decoding at these context lengths reads, the first `shared` positions
    left out (floor_output_tok_s counts them once a step); contexts > shared."""
    own, positions = contexts - shared, 0
    for layer in range(config.num_hidden_layers):
        window = config.layer_window(layer)
        positions += int(np.minimum(own, window).sum()) if window else int(own.sum())
    return positions * kv_bytes_a_position(config)


def floor_output_tok_s(spec: WorkloadSpec, seed: int, config: ModelConfig, weight_bytes: int,
                       bandwidth_Bps: float) -> float:
    """Output tok/s at the bytes floor of `spec`'s requests drawn with `seed` (module docstring):
    every request's tokens over the least time the bytes allow."""
    requests = spec.requests(seed)
    steps = max(r.max_tokens for r in requests)
    contexts = np.concatenate([len(r.prompt_token_ids) + np.arange(1, r.max_tokens, dtype=np.int64)
                               for r in requests])      # decoded tokens: all after each first
    shared_layers = sum(config.layer_window(n) is None for n in range(config.num_hidden_layers))
    shared_bytes = spec.shared_prefix * shared_layers * kv_bytes_a_position(config) * (steps - 1)
    total = steps * weight_bytes + kv_bytes_read(config, contexts, spec.shared_prefix) + shared_bytes
    return sum(r.max_tokens for r in requests) / (total / bandwidth_Bps)
