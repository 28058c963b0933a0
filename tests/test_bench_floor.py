"""bench/floor.py's bytes floor against the same count made token by token here, on the workloads'
own request draws: the weights once a step for max(output_len) steps, each decoded token's K/V
within each layer's window, a shared prefix once a step on full-attention layers."""
import pytest

from tinyvllm.bench.floor import floor_output_tok_s
from tinyvllm.bench.workloads import WorkloadSpec, select_workloads
from tinyvllm.checkpoint.model_writer import preset_config

BANDWIDTH = 3.0e12


def counted_bytes(spec, seed, config, weight_bytes):
    """The floor's bytes, one decoded token and one layer at a time."""
    requests = spec.requests(seed)
    steps = max(r.max_tokens for r in requests)
    per_position = 2 * config.kv_size * 2
    total = steps * weight_bytes
    for r in requests:
        for t in range(1, r.max_tokens):
            context = len(r.prompt_token_ids) + t           # the positions this token attends to
            for layer in range(config.num_hidden_layers):
                window = config.layer_window(layer)
                first = max(spec.shared_prefix, context - window) if window else spec.shared_prefix
                total += (context - first) * per_position
    for layer in range(config.num_hidden_layers):           # the shared prefix, once a decode step
        if config.layer_window(layer) is None:
            total += spec.shared_prefix * per_position * (steps - 1)
    return total, sum(r.max_tokens for r in requests)


@pytest.mark.parametrize("preset, spec", [
    ("llama-3.2-1b", WorkloadSpec("ragged", 6, (3, 40), (2, 30))),
    ("gemma-3-1b", WorkloadSpec("ragged", 5, (3, 700), (2, 40))),          # 512-token windows, 5 of 6 layers
    ("llama-3.2-1b", WorkloadSpec("prefix", 4, (5, 9), (3, 3), shared_prefix=20)),
    ("gemma-3-1b", WorkloadSpec("prefix", 3, (400, 600), (2, 9), shared_prefix=100)),
])
def test_floor_counts_every_decoded_token_within_its_window(preset, spec):
    config = preset_config(preset)
    weight_bytes = 2 * config.decode_parameters
    total, tokens = counted_bytes(spec, 0, config, weight_bytes)
    assert floor_output_tok_s(spec, 0, config, weight_bytes, BANDWIDTH) == pytest.approx(tokens * BANDWIDTH / total,
                                                                                         rel=1e-12)


def test_throughput_floor_on_llama_1b_is_its_weight_and_kv_bytes():
    """The throughput workload on Llama-3.2-1B: ~1,021 steps of its 2.47 GB of weights and ~138 M
    context positions of 32 KB of K/V, about 7 TB: at 3 TB/s ~63 k output tok/s."""
    config = preset_config("llama-3.2-1b")
    assert config.kv_bytes_per_token == 32768
    (spec,) = select_workloads("throughput")
    rate = floor_output_tok_s(spec, 0, config, 2 * config.decode_parameters, BANDWIDTH)
    assert 55_000 < rate < 80_000


def test_decode_parameters_leave_out_an_untied_embedding_only():
    tied, untied = preset_config("llama-3.2-1b"), preset_config("mistral-7b")
    assert tied.tie_word_embeddings and tied.decode_parameters == tied.num_parameters
    assert not untied.tie_word_embeddings
    assert untied.num_parameters - untied.decode_parameters == untied.vocab_size * untied.hidden_size
