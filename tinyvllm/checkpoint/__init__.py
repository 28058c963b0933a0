"""A model directory: weights, tokenizer, chat template; writing and converting models."""
