"""Record transformers' greedy tokens on small random-weight models of the families served beside
Llama (Qwen2, Qwen3 and Qwen3 with YaRN, SmolLM3, Phi-3, Mistral, Gemma 3 text, and Gemma 3's and
Mistral Small 3's multimodal models run on text): the golden fixtures tests/test_golden_families.py
holds the engine to.

    python benchmarks/hf_family_golden.py [--out tests/fixtures/families] [--family qwen3 ...]

Needs torch, transformers 5.x, tokenizers and safetensors (nothing from tinyvllm); runs on the
CPU. For each family it writes <out>/<family>/:

  the checkpoint  a model built from the family's own transformers config class at a reduced
                  size (FAMILIES below: a few layers, hidden 128 or 256, 512 words), its weights
                  drawn from a seeded normal at the scales of init_weights, saved in bf16 with
                  save_pretrained, beside a word-level tokenizer (tokenizers' WordLevel) that
                  PreTrainedTokenizerFast saves;
  golden.json     on fixed token-id prompts (most longer than the sliding windows, and all of them
                  by the end): transformers' greedy ids (the bf16 weights upcast to fp32, eager
                  attention, KV cache, no EOS stop) and their text (skip_special_tokens), and per
                  step the top-2 ids, their fp32 logit gap, the gap between the same two ids in a
                  float64 run (teacher-forced: prompt and golden ids as one sequence, no cache; its
                  RoPE in float64 too, see float64_rope), so that the fixture says how far fp32
                  rounding moved each gap, and how far a bf16 run moved it (teacher-forced too:
                  for a bf16 bound, as tests/test_golden.py's).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import sys
from pathlib import Path

VOCAB, PAD, EOS, BOS, UNK = 512, 0, 1, 2, 3
MAX_NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 11, 20, 37)        # windows are 8 and 12: most prompts outgrow them
SEED = 1234
# Head dims are ones the GPU kernels are built for (64; 256 is Gemma 3's own), so that the same
# fixtures can hold the CUDA backend to transformers too.
SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=320, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
             bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
GEMMA3_TEXT = dict(
    SMALL, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
    query_pre_attn_scalar=64, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# family -> (transformers config class, its arguments): each exercises what its family changes
FAMILIES = {
    # q/k/v biases (always on in Qwen2Attention), tied embeddings as on Qwen2.5-0.5B; 4 query
    # heads per kv head
    "qwen2": ("Qwen2Config", dict(SMALL, num_hidden_layers=3, hidden_size=256, num_key_value_heads=1,
                                  tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # q_norm / k_norm; head_dim 64 while hidden / heads is 32; untied lm_head
    "qwen3": ("Qwen3Config", dict(SMALL, num_hidden_layers=3, head_dim=64, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # RoPE on layers 0 and 2 only (SmolLM3's no_rope_layers, 1 = RoPE; every 4th layer by default)
    "smollm3": ("SmolLM3Config", dict(SMALL, num_hidden_layers=4, num_attention_heads=2, no_rope_layers=[1, 0, 1, 0],
                                      rope_parameters={"rope_type": "default", "rope_theta": 2e6})),
    # Qwen3 with YaRN (the long-context scaling its model cards give): frequencies blended between
    # kept and / factor, scores times the attention factor squared
    "qwen3_yarn": ("Qwen3Config", dict(SMALL, num_hidden_layers=3, head_dim=64, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                        "original_max_position_embeddings": 256})),
    # Mistral Small 3.1's multimodal model (a tiny Pixtral tower) run on text: a Mistral, untied
    "mistral3_mm": ("Mistral3Config", dict(tie_word_embeddings=False, text_config=dict(
        SMALL, model_type="mistral", num_hidden_layers=3, head_dim=64, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))),
    # Qwen2.5-VL run on text: a Qwen2 (q/k/v biases) whose multimodal RoPE's three position streams
    # are the same position; its tensors saved as model.* beside visual.*
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(text_config=dict(
        SMALL, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                           patch_size=14, window_size=56, fullatt_block_indexes=[0]), tie_word_embeddings=False)),
    # Qwen3-VL run on text: a Qwen3 (q/k norms) with interleaved multimodal RoPE
    "qwen3_vl": ("Qwen3VLConfig", dict(text_config=dict(
        SMALL, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [12, 10, 10],
                         "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                           patch_size=14, deepstack_visual_indexes=[0]), tie_word_embeddings=False)),
    # q/k/v and gate/up stored fused; a window on every layer (Phi-3-mini's 2047, shrunk)
    "phi3": ("Phi3Config", dict(SMALL, num_hidden_layers=3, num_attention_heads=2, sliding_window=12,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # every layer a sliding-window layer (v0.1's 4096, shrunk)
    "mistral": ("MistralConfig", dict(SMALL, num_hidden_layers=3, hidden_size=256, sliding_window=12,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # sliding and full layers, each with its RoPE (linear scaling on the full ones, as on the 4B),
    # Gemma 3's head_dim 256, a query scale other than head_dim^-1/2, sqrt(128) not a bf16 number
    "gemma3": ("Gemma3TextConfig", GEMMA3_TEXT),
    # the multimodal Gemma 3 (4B-27B's Gemma3ForConditionalGeneration) with a tiny vision tower,
    # run on text: its language model is the text model above, saved under language_model.model.
    "gemma3_mm": ("Gemma3Config", dict(text_config=GEMMA3_TEXT, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14), mm_tokens_per_image=4)),
}
NOT_CAUSAL_LM = {"Mistral3Config": "Mistral3ForConditionalGeneration",
                 "Qwen2_5_VLConfig": "Qwen2_5_VLForConditionalGeneration",
                 "Qwen3VLConfig": "Qwen3VLForConditionalGeneration"}
ONE_PLUS_W_NORMS = {"gemma3", "gemma3_mm"}          # Gemma3RMSNorm multiplies by (1 + weight)
FINAL_NORMS = ("model.norm.weight", "model.language_model.norm.weight")
VISION_PARTS = ("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")   # transformers init


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def init_weights(torch, model, family: str, seed: int) -> None:
    """Overwrite every parameter with seeded normal values at scales that keep greedy decoding
    varied (not one token repeated) and not chaotic (transformers' own bf16 run moves a logit
    gap by ~0.1 logits, as on SmolLM2-135M): the embedding is small (std 0.02) beside what the
    layers add, so that a tied lm_head does not echo the input token back; the final norm's gain
    of 18 then gives logits of std ~4; q/k norms (gain 1.5) and q/k projections (std 1.5 /
    sqrt(fan_in)) sharpen attention a little. Other projections have std 1/sqrt(fan_in), other
    norms a gain of 1; every norm weight varies by +- 0.1, so that a kernel dropping it is caught."""
    offset = 1.0 if family in ONE_PLUS_W_NORMS else 0.0     # 1 + w: the same gains, w one less
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith(VISION_PARTS):             # a text run never reads them
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                gain = 18.0 if name in FINAL_NORMS else \
                    1.5 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
                p.copy_(gain - offset + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.02 * noise)
            else:
                gain = 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(gain * noise / p.shape[1] ** 0.5)


def write_tokenizer(transformers, folder: Path) -> object:
    """A word-level tokenizer: <pad> <eos> <bos> <unk>, then the words w4 .. w511."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                               unk_token="<unk>", pad_token="<pad>")
    tok.save_pretrained(folder)
    return tok


def model_class(transformers, config_class: str):
    """The class a config builds: AutoModelForCausalLM's, or a multimodal model it does not map."""
    return getattr(transformers, NOT_CAUSAL_LM[config_class]) if config_class in NOT_CAUSAL_LM \
        else transformers.AutoModelForCausalLM


def load(torch, transformers, folder: Path, dtype, config_class: str):
    model = model_class(transformers, config_class).from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    if dtype == torch.float64:
        float64_rope(torch, model)
    return model.eval()


def float64_rope(torch, model) -> None:
    """transformers computes RoPE's frequencies and angles in float32 even in a float64 model
    (the rotary embedding builds inv_freq in float32 and its forward casts to float): give the
    float64 model a float64 RoPE (default and linear types), so that its gaps are exact to ~1e-13
    and measure the fp32 run's RoPE rounding too."""
    text_model = getattr(model.model, "language_model", model.model)      # a multimodal model's
    rotary, config = text_model.rotary_emb, model.config.get_text_config()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theirs = rotary.forward

    def inv_freq(params: dict):
        assert params["rope_type"] in ("default", "linear", "yarn"), params
        freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if params["rope_type"] == "yarn":          # _compute_yarn_parameters' blend, in float64
            assert not set(params) & {"beta_fast", "beta_slow", "truncate", "attention_factor", "mscale"}, params
            def turning(rotations):
                return dim * math.log(params["original_max_position_embeddings"] / (rotations * 2 * math.pi)) \
                    / (2 * math.log(params["rope_theta"]))
            low, high = max(math.floor(turning(32)), 0), min(math.ceil(turning(1)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            return freq / params["factor"] * ramp + freq * (1 - ramp)
        return freq / params.get("factor", 1.0) if params["rope_type"] == "linear" else freq

    def forward(x, position_ids, layer_type=None):
        params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
        if position_ids.dim() == 3:            # multimodal RoPE's three streams: on text, one position
            assert (position_ids == position_ids[0]).all()
            position_ids = position_ids[0]
        angles = position_ids[..., None].to(torch.float64) * inv_freq(params)
        both = torch.cat((angles, angles), dim=-1)
        scale = 0.1 * math.log(params["factor"]) + 1 if params["rope_type"] == "yarn" else 1.0   # attention factor
        return (both.cos() * scale).to(x.dtype), (both.sin() * scale).to(x.dtype)

    positions = torch.arange(128)[None]              # the same angles as transformers', to fp32's error
    probe = torch.zeros(1, dtype=torch.float64)
    for layer_type in sorted(set(getattr(config, "layer_types", None) or [None])):
        args = (layer_type,) if "sliding_attention" in config.rope_parameters else ()
        for ours, want in zip(forward(probe, positions, *args), theirs(probe, positions, *args)):
            assert (ours - want).abs().max() < 1e-4, "float64 RoPE differs from transformers'"
    rotary.forward = forward


def greedy(torch, model, prompt: list[int], steps: int):
    """Greedy decoding through the KV cache, no EOS stop: ids, top-2 ids, fp32 top-2 gaps."""
    ids, top2, gaps = [], [], []
    with torch.no_grad():
        step_input, cache = torch.tensor([prompt]), None
        for _ in range(steps):
            out = model(step_input, cache=cache, use_cache=True)
            cache = out.cache
            values, indices = torch.topk(out.logits[0, -1].float(), 2)
            ids.append(int(indices[0]))
            top2.append([int(indices[0]), int(indices[1])])
            gaps.append(float(values[0] - values[1]))
            step_input = indices[:1].view(1, 1)
    return ids, top2, gaps


def teacher_forced_gaps(torch, model, prompt: list[int], generated: list[int], top2) -> list[float]:
    """The logit gap between the same two ids at every step, prompt and golden ids run whole."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated[:-1]]), use_cache=False).logits[0, len(prompt) - 1:]
    return [float(logits[i, a].double() - logits[i, b].double()) for i, (a, b) in enumerate(top2)]


def record(torch, transformers, family: str, out_dir: Path) -> dict:
    class_name, kwargs = FAMILIES[family]
    folder = out_dir / family
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(SEED)
    cls = model_class(transformers, class_name)
    model = cls.from_config(config, dtype=torch.float32) if cls is transformers.AutoModelForCausalLM \
        else cls(config).to(torch.float32)
    init_weights(torch, model, family, SEED)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok = write_tokenizer(transformers, folder)

    fp32, fp64, bf16 = (load(torch, transformers, folder, d, class_name)
                        for d in (torch.float32, torch.float64, torch.bfloat16))
    gen = torch.Generator().manual_seed(SEED + 1)
    cases = []
    for n, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(4, VOCAB, (length,), generator=gen).tolist()
        ids, top2, gaps = greedy(torch, fp32, prompt, MAX_NEW_TOKENS)
        exact = teacher_forced_gaps(torch, fp64, prompt, ids, top2)
        full32 = teacher_forced_gaps(torch, fp32, prompt, ids, top2)
        half = teacher_forced_gaps(torch, bf16, prompt, ids, top2)
        cases.append({"name": f"{family}-{n}", "prompt_ids": prompt, "generated_ids": ids, "top2_ids": top2,
                      "top2_gap": gaps, "fp64_gap": exact,
                      "bf16_gap_error": [abs(h - g) for h, g in zip(half, gaps)],
                      "text": tok.decode(ids, skip_special_tokens=True)})
        # transformers' own consistency: the cached run and the whole-sequence run in fp32
        drift = max(abs(a - b) for a, b in zip(gaps, full32))
        print(f"{family}-{n}: prompt {length}, min gap {min(gaps):.4f}, fp32 error max "
              f"{max(abs(g - e) for g, e in zip(gaps, exact)):.2e}, cache vs whole {drift:.2e}, bf16 error max "
              f"{max(cases[-1]['bf16_gap_error']):.3f}, distinct ids {len(set(ids))}", file=sys.stderr)
    files = sorted(p.name for p in folder.iterdir() if p.name != "golden.json")
    golden = {
        "how_it_was_made": {
            "command": " ".join(["python", *sys.argv]), "transformers_version": transformers.__version__,
            "torch_version": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": "cpu", "config_class": class_name, "seed": SEED,
            "dtype": "bf16 checkpoint; golden run in float32 (weights upcast), eager attention, "
                     "greedy with KV cache, no EOS stop; float64 and bf16 runs teacher-forced",
        },
        "files_sha256": {name: sha256(folder / name) for name in files},
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": cases,
    }
    (folder / "golden.json").write_text(json.dumps(golden, indent=1) + "\n", encoding="utf-8")
    return golden


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="tests/fixtures/families")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES),
                   help="one family (repeatable); default: all")
    args = p.parse_args(argv)
    import torch
    import transformers
    torch.set_num_threads(1)            # one summation order, whatever the machine
    for family in args.family or sorted(FAMILIES):
        record(torch, transformers, family, Path(args.out))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
