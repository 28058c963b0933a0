"""Quantized weights: the numpy twins of every stored format and of the quantized linear.

    block_format.py   what GGUF's block formats share: BlockFormat, QuantizedWeight, linear()
    gguf_legacy.py    Q8_0, Q4_0, Q4_1 (32-weight blocks)
    gguf_kquants.py   Q4_K, Q6_K (256-weight super-blocks)
    gguf_file.py      a GGUF file's tensors as blocks (nothing dequantized)
    fp8.py            e4m3 codes with per-channel or per-tensor float32 scales, linear()
    quant_config.py   config.json's quantization_config -> QuantConfig
    fp8_checkpoint.py FP8 safetensors checkpoints: F8_E4M3 weights paired with their scales
"""
