"""GpuOps: one typed launcher per CUDA kernel, what the model, the GPU tests and the benchmarks
call. The launchers live by kernel family, beside the .cu files they launch:

    kernel (cuda/)                         launcher (gpu/ops/)             numpy twin (reference/)         GPU test (tests/)
    embedding.cu  embedding_gather         rowwise  embedding()            kernels.embedding               test_gpu_kernels::test_embedding_gather
    embedding.cu  embedding_gather_scaled  rowwise  embedding(scale=)      kernels.embedding * scale, rms_norm_operand(offset)
                                                                                                           test_gpu_families::test_embedding_gather_scaled
    rmsnorm.cu    rms_norm                 rowwise  rms_norm()             kernels.rms_norm                test_gpu_kernels::test_rms_norm
    rmsnorm.cu    rms_norm_offset          rowwise  rms_norm(weight_offset=)  kernels.rms_norm(offset)    test_gpu_families::test_rms_norm_offset
    rmsnorm.cu    rms_norm_residual_add    rowwise  rms_norm_residual_add()  kernels.rms_norm(offset) + add, rms_norm_operand(offset)
                                                                                                           test_gpu_families::test_rms_norm_residual_add
    rope_kv.cu    rope_write_kv            rowwise  rope_write_kv()        kernels.apply_rope, write_kv    test_gpu_kernels::test_rope_write_kv
    rope_kv.cu    rope_write_kv_bias       rowwise  rope_write_kv(bias=)   kernels.bf16_round(qkv + bias), apply_rope
                                                                                                           test_gpu_families::test_rope_write_kv_bias
    rope_kv.cu    rope_write_kv_qk_norm    rowwise  rope_write_kv(qk_norm=)  kernels.rms_norm(offset), apply_rope
                                                                                                           test_gpu_families::test_rope_write_kv_qk_norm
    activation.cu silu_mul                 rowwise  silu_mul()             kernels.silu_mul                test_gpu_kernels::test_silu_mul
    activation.cu gelu_tanh_mul            rowwise  silu_mul(gelu_tanh=)   kernels.gelu_tanh_mul           test_gpu_families::test_gelu_tanh_mul
    attention_prefill.cu  attention_prefill_d{64,128,256}
                                           attention attention_prefill()   kernels.paged_attention         test_gpu_kernels::test_attention_prefill
                                                                                                           (d256: test_gpu_attention_families)
    attention_prefill.cu  attention_prefill_window_d{64,128,256}
                                           attention attention_prefill(window=)  kernels.paged_attention(window)
                                                                                                           test_gpu_attention_families::test_attention_prefill_families
    attention_decode.cu   attention_decode_d{64,128}_g{1..8}, d256_g{1,2,4,8}
                                           attention attention_decode()    kernels.paged_attention         test_gpu_kernels::test_attention_decode
                                                                                                           (d256, g5-7: test_gpu_attention_families)
    attention_decode.cu   attention_decode_window_d*_g* (the same shapes)
                                           attention attention_decode(window=)  kernels.paged_attention(window)
                                                                                                           test_gpu_attention_families::test_attention_decode_families
    attention_decode.cu   attention_decode_d*_g* as cascade's suffix (first_position=, lse_out=)
                                           attention attention_decode(first_position=, lse_out=)  cascade.attention_partial (its o / l, m + log l)
                                                                                                           test_gpu_cascade::test_decode_suffix_and_lse
    attention_cascade.cu  attention_cascade_prefix_d{64,128,256}
                                           attention attention_cascade_prefix()  cascade.cascade_paged_attention, kernels.paged_attention
                                                                                                           test_gpu_cascade::test_cascade_decode,
                                                                                                           test_cascade_prefix_splits
    gemv.cu       gemv_bf16                gemv     gemv(), via linear()   kernels.linear                  test_gpu_gemv
    gemv.cu       gemv_residual_norm_bf16  gemv     gemv_residual_norm()   kernels.linear, rms_norm_operand  test_gpu_fused::test_handed_over_norm
    gemv.cu       gemv_prenormed_rope_kv_bf16
                                           gemv     gemv_rope_kv()         kernels.rms_norm_linear, apply_rope, write_kv
                                                                                                           test_gpu_fused::test_handed_over_norm
    gemv.cu       gemv_prenormed_rope_kv_bias_bf16
                                           gemv     gemv_rope_kv(bias=)    its chain: gemv(prenormed=), rope_write_kv(bias=)
                                                                                                           test_gpu_families::test_gemv_rope_kv_bias_equals_its_chain
    gemv.cu       gemv_prenormed_silu_mul_bf16
                                           gemv     gemv_silu_mul()        kernels.rms_norm_linear, silu_mul  test_gpu_fused::test_handed_over_norm
    gemv.cu       gemv_prenormed_gelu_mul_bf16
                                           gemv     gemv_silu_mul(gelu_tanh=)  its chain: gemv(prenormed=), gelu_tanh_mul
                                                                                                           test_gpu_families::test_gemv_gelu_mul_equals_its_chain
    gemv.cu       gemv_prenormed_bf16      gemv     gemv(prenormed=...)    kernels.rms_norm_linear, sampling.head_argmax_keys
                                                                                                           test_gpu_fused::test_prenormed_head
    sampling.cu   sample_tokens            sampling sample()               sampling.sample                 test_gpu_sampling
    sampling.cu   apply_logit_edits        sampling apply_logit_edits()    sampling.apply_edits            test_gpu_logit_processing
    sampling.cu   step_logprobs            sampling step_logprobs()        sampling.step_logprobs          test_gpu_logit_processing
    token_mask.cu apply_token_mask         sampling apply_token_mask()     sampling.apply_token_mask       test_gpu_token_mask
    gemv_quant.cu gemv_quant_{fp8,q8_0,q4_0,q4_1,q4_k,q6_k,expanded}
                                           gemv     gemv(w=QuantMatrix), via linear()  quant.fp8.linear, quant.block_format.linear
                                                    (expanded: a mixed group, quant.weight_kinds.linear on its parts)
                                                                                                           test_gpu_quant::test_gemv_quant
    gemv_quant.cu gemv_quant_residual_norm_<kind>, gemv_quant_prenormed_<kind>, ..._rope_kv[_bias]_<kind>,
                  ..._silu_mul_<kind>, ..._gelu_mul_<kind> (gemv.cu's namesakes, quant_gemv.QuantGemvOps.KERNELS)
                                           gemv     their gemv.cu namesakes' launchers on a QuantMatrix
                                                    the twins above, rms_norm_linear's formula, their chains
                                                                                                           test_gpu_quant::test_quant_residual_norm,
                                                                                                           test_quant_prenormed_head,
                                                                                                           test_quant_fused_epilogues_equal_their_chains
    gemv_quant.cu dequant_{fp8,q8_0,q4_0,q4_1,q4_k,q6_k,expanded}
                                           quant_gemv dequantize(), via linear() at m > 8  gpu.quant_weights.planes_dequantize_bf16 / fp8_scaled_bf16
                                                                                                           test_gpu_quant::test_dequantize
    tensor_parallel.cu  embedding_gather_shard  tensor_parallel  embedding_shard()  kernels.embedding(ids - vocab_start) * scale
                                                                                                           test_gpu_tensor_parallel_kernels
    tensor_parallel.cu  residual_add       tensor_parallel  residual_add()  kernels.bf16_round(hidden + x), rms_norm_operand
                                                                                                           test_gpu_tensor_parallel_kernels
    tensor_parallel.cu  shift_argmax_keys  tensor_parallel  shift_argmax_keys()  vocab_parallel.shard_argmax_keys
                                                                                                           test_gpu_tensor_parallel_kernels
    tensor_parallel.cu  place_vocab_slice  tensor_parallel  place_vocab_slice()  vocab_parallel.gather_vocab
                                                                                                           test_gpu_tensor_parallel_kernels
    (cuBLAS)      cublasGemmEx             gemv     linear()               kernels.linear                  test_gpu_kernels::test_linear

Each launcher owns its kernel's launch geometry, computed from the constants its .cu file
defines (read by gpu/kernels.py, never copied), and passes the arguments in the kernel's own
order; the argument types come from the kernel's C signature. Every launch goes through
`_launch` (gpu/ops/launch.py) and every projection through `linear()` (gpu/ops/gemv.py); the
fused decode layer's GEMVs are launches of their own kernels.
"""
from __future__ import annotations

from tinyvllm.gpu.ops.attention import (
    CASCADE,
    CASCADE_HEAD_DIMS,
    DECODE,
    DECODE_SHAPES,
    MAX_CASCADE_SPLITS,
    MAX_DECODE_SPLITS,
    PREFILL,
    PREFILL_HEAD_DIMS,
    AttentionOps,
    attention_kernels_missing,
    cascade_tiles,
)
from tinyvllm.gpu.ops.gemv import GEMV, GEMV_MAX_ROWS, GemvOps
from tinyvllm.gpu.ops.quant_gemv import QGEMV, QuantGemvOps
from tinyvllm.gpu.ops.rowwise import EMBEDDING, RMS_NORM, ROPE, SILU, RowwiseOps
from tinyvllm.gpu.ops.sampling import MAX_ARGMAX_SLICES, SAMPLING, SamplingOps
from tinyvllm.gpu.ops.tensor_parallel import TENSOR_PARALLEL, TensorParallelOps

__all__ = ["GpuOps", "EMBEDDING", "RMS_NORM", "ROPE", "SILU", "PREFILL", "DECODE", "CASCADE", "GEMV", "SAMPLING",
           "QGEMV", "TENSOR_PARALLEL", "DECODE_SHAPES", "PREFILL_HEAD_DIMS", "CASCADE_HEAD_DIMS", "MAX_DECODE_SPLITS",
           "MAX_CASCADE_SPLITS", "MAX_ARGMAX_SLICES", "GEMV_MAX_ROWS", "attention_kernels_missing", "cascade_tiles"]


class GpuOps(RowwiseOps, AttentionOps, GemvOps, QuantGemvOps, SamplingOps, TensorParallelOps):
    """Every launcher, bound to one kernel library, stream, cuBLAS handle and SM count
    (OpsBase's arguments, with EngineConfig's fused_decode and pdl)."""
