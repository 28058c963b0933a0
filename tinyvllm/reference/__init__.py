"""The numpy float32 twins of every GPU kernel, the sampler and the whole model."""
