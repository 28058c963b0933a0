"""User-facing errors. Anything raised as a TinyVLLMError is the user's problem stated in one line
(the CLI prints it without a traceback); anything else is a bug in tinyvllm."""


class TinyVLLMError(Exception):
    """Base class: a problem with the user's input, model files or environment."""


class ModelLoadError(TinyVLLMError):
    """The model directory, config.json, tokenizer or weight files are missing or invalid."""


class ConfigError(TinyVLLMError):
    """An engine option that cannot be honoured (for this model, or on this machine)."""


class InvalidRequestError(TinyVLLMError, ValueError):
    """A request that can never be served: bad sampling values, empty or too-long prompt."""


class RequestValueError(InvalidRequestError):
    """An InvalidRequestError that knows which request field is at fault (the server's error
    body names it as `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class GPUUnavailableError(TinyVLLMError):
    """No CUDA driver, no GPU, PyCUDA or cuBLAS missing."""


class EngineDeadError(RuntimeError):
    """The engine hit a failure it cannot pin on one request (a CUDA error: the context and
    whatever was on the device are gone). Every request in flight is lost and the engine refuses
    all further work: the process should exit so that a supervisor restarts it. Not a
    TinyVLLMError: it is not the user's input that is wrong."""
