"""Quantized weights: the numpy twins of every stored format and of the quantized linear.
(Reading them from files is checkpoint/'s: gguf_tensors.py, fp8_weights.py.)

    block_format.py    what GGUF's block formats share: BlockFormat, QuantizedWeight, linear()
    gguf_legacy.py     Q8_0, Q4_0, Q4_1 (32-weight blocks)
    gguf_kquants.py    Q4_K, Q6_K (256-weight super-blocks)
    fp8.py             e4m3 codes with per-channel or per-tensor float32 scales, linear()
    quant_config.py    config.json's quantization_config -> QuantConfig
    weight_kinds.py    the weight kinds a loaded model holds (and the GGUF block formats by type
                       name); linear / embedding rows / fused groups over any of them (what the
                       reference model calls)
    llama_cpp_twin.py  llama.cpp's 8-bit activation rounding and block dot products, and the
                       near-tie bound of a comparison with llama.cpp derived from them
"""
