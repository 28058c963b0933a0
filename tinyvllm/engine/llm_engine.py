"""LLMEngine: requests in, one step at a time, RequestOutputs out (the offline API is engine/llm.py).

    engine = LLMEngine("path/to/model", device="cpu")
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.outputs[0].delta_text, end="")

A request with SamplingParams.n > 1 is n sequences (samples), reported together in one
RequestOutput. With prefix caching on (the default) sample 0 prefills alone; once its prompt's
full blocks are computed and published, the other n - 1 are queued ahead of every waiting
request and take those blocks from the prefix cache, computing only the prompt's last partial
block (a whole block when the prompt is a multiple of block_size: the last token must run for
logits) — n samples cost one prefill. With prefix caching off they prefill separately. Sample
j's random stream is seeded with sample_seed(seed, j) (engine/intake.py); aborting the request
aborts every sample.

Aborted requests: abort_request() frees the blocks at once; the next step() reports the request
one last time with finished=True, finish_reason="abort".

Async scheduling (engine/step_ahead.py): where the runner overlaps steps (cuda), a decode step
is launched before the one before it has been read back; step() still returns one step's outputs
per call.

Failures inside step() (docs/engine.md, "Failures"):
  one request's fault  building a step's batch rows raised for it (a value the arrays cannot
                       hold), or the model gave it non-finite logits (the sampler's id -1): that
                       request alone finishes with finish_reason "error" and RequestOutput.error
                       saying why; the rest of the step runs without it.
  nobody's fault       anything else raised by the scheduler, the runner (a CUDA error: the
                       context and the KV cache are gone) or the bookkeeping after it: the engine
                       is dead. This step() and every later call raise EngineDeadError; the
                       requests in flight are lost; the process should exit and be restarted.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.generation_config import default_sampling_fields
from tinyvllm.checkpoint.tokenizer import IncrementalDetokenizer
from tinyvllm.config import EngineConfig
from tinyvllm.engine.block_manager import BlockManager, PrefixCacheStats
from tinyvllm.engine.intake import TokenizedPrompt, check_prompt_fits, check_supported, prompt_ids, sample_seed
from tinyvllm.engine.limits import check_request, longest_token_bytes, max_prompt_bytes
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.outputs import RequestOutput
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.scheduler import ScheduledBatch, Scheduler
from tinyvllm.engine.sequence import Request, Sequence, SequenceStatus
from tinyvllm.engine.startup import load_model, make_engine_config
from tinyvllm.engine.stats import StatsCollector, StepStats
from tinyvllm.engine.step_ahead import StepAhead
from tinyvllm.errors import EngineDeadError, InvalidRequestError
from tinyvllm.structured.grammar import GrammarCompiler

log = logging.getLogger("tinyvllm.engine")


class LLMEngine:
    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None, *,
                 runner: ModelRunner | None = None, chat_template: str | Path | None = None,
                 **engine_options):
        """model: a Hugging Face model directory; None: the default model (checkpoint/default_model.py). runner: a ready
        ModelRunner to use instead of loading the weights into a new one (benchmarks and tests
        drive the real engine with a fake model this way). chat_template: a template file or
        text replacing the model directory's own."""
        start = time.perf_counter()
        loaded = load_model(model, make_engine_config(engine_config, engine_options), runner, chat_template)
        self.engine_config, self.model_config = loaded.engine_config, loaded.model_config
        self.tokenizer, self.runner = loaded.tokenizer, loaded.runner
        self.context_limit = self.engine_config.context_limit(self.model_config)
        longest = longest_token_bytes(self.tokenizer)
        self.max_prompt_bytes = None if longest is None else max_prompt_bytes(self.context_limit, longest)
        self.dead: str | None = None     # why the engine died (see the module docstring)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.engine_config.block_size,
                                          self.engine_config.enable_prefix_caching)
        self.output_processor = OutputProcessor(self.tokenizer, self.tokenizer.eos_token_ids,
                                                self.context_limit)
        self.scheduler = Scheduler(self.engine_config, self.block_manager, self.output_processor)
        self.default_sampling_fields = default_sampling_fields(loaded.model_dir, self.engine_config.generation_config,
                                                               check=SamplingParams)
        # structured outputs: grammars compiled for this tokenizer (llguidance's made on first use)
        self.structured = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids)
        self._seed_rng = np.random.default_rng(self.engine_config.seed)   # seeds for unseeded requests
        self._requests: dict[str, Request] = {}                           # unfinished, by id
        asked = self.engine_config.async_scheduling
        self.async_scheduling = self.runner.overlaps_steps if asked is None else asked
        self.step_ahead = StepAhead(self.runner, self.scheduler, self.block_manager,
                                    self.output_processor, self._requests)
        self.stats: StatsCollector | None = None       # enable_stats() turns it on
        self.last_step_stats: StepStats | None = None
        self._log_ready(loaded.model_dir, time.perf_counter() - start)

    def _log_ready(self, model_dir, seconds: float) -> None:
        kv_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        log.info("%s: %s parameters, engine ready in %.2f s", model_dir,
                 f"{self.model_config.num_parameters:,}", seconds)
        # vLLM's two lines: the KV cache in tokens, and how many full-context requests fit
        log.info("KV cache: %s blocks of %d tokens = %s tokens; maximum concurrency for %s "
                 "tokens per request: %.2fx", f"{self.block_manager.num_blocks:,}",
                 self.block_manager.block_size, f"{kv_tokens:,}", f"{self.context_limit:,}",
                 kv_tokens / self.context_limit)

    def enable_stats(self) -> None:
        """Make step() leave a StepStats in last_step_stats (engine/stats.py; the server's
        /metrics and stats log line read them)."""
        if self.stats is None:
            self.stats = StatsCollector(self.scheduler, self.block_manager)

    # -- requests ----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature,
        top_p, top_k, repetition_penalty, max_new_tokens -> max_tokens), as vLLM's
        generation_config="auto"; plain SamplingParams() with generation_config="vllm"."""
        return SamplingParams(**self.default_sampling_fields)

    def add_request(self, request_id: str, prompt: str | list[int] | TokenizedPrompt,
                    params: SamplingParams | None = None,
                    *, arrival_time: float | None = None) -> None:
        """Queue a request. Anything wrong with it raises InvalidRequestError before the engine
        changes at all."""
        if self.dead:
            raise EngineDeadError(f"the engine is dead ({self.dead}); restart it")
        params = (params or SamplingParams()).validate()
        check_request(params, self.model_config.vocab_size, self.engine_config.max_num_seqs)
        check_supported(params, self.runner, self.engine_config.device)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self.prompt_ids(prompt)
        check_prompt_fits(len(ids), self.context_limit, self.block_manager)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, text, ids, params, sample_seed(seed, i),
                         IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens), arrival, i)
                for i in range(params.n)]
        self.structured.attach(params, seqs)       # structured outputs: a grammar matcher each
        request = Request(request_id, text, ids, params, seqs)
        if params.prompt_logprobs is not None:
            logits = self.runner.prompt_logits(ids)
            request.prompt_logprobs = self.output_processor.prompt_logprobs(ids, logits, params.prompt_logprobs)
        if not self.engine_config.enable_prefix_caching:
            request.held = []             # nothing to share: every sample prefills now
        self._requests[request_id] = request
        for seq in seqs[:len(seqs) - len(request.held)]:
            self.scheduler.add(seq)

    def prompt_ids(self, prompt: str | list[int] | TokenizedPrompt) -> tuple[str | None, list[int]]:
        """(the prompt's text, None for token ids; its token ids), as add_request takes it."""
        return prompt_ids(prompt, self.tokenizer, self.model_config.vocab_size, self.max_prompt_bytes)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (every sample) and free its KV blocks now; unknown or finished ids are
        ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.held:          # never queued: finished here, reported next step
            seq.finish(SequenceStatus.FINISHED_ABORTED)
            self.scheduler.report_finished(seq)
        request.held = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache queries and hits, in tokens (and admissions: .requests)."""
        return self.block_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; only while no request runs. -> whether it was done."""
        return self.block_manager.reset_prefix_cache()

    # -- the loop ----------------------------------------------------------------------------
    def step(self, after_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduler step (decode rows, prompt chunks, or both: engine/scheduler.py). -> one RequestOutput per
        request that got a new token or finished. Raises EngineDeadError (see the module
        docstring) when the step failed for no one request's fault. after_launch, if given, is
        called once the step is on the device (or found nothing to run), before the host waits
        for it: the server hands the step before's outputs to its event loop there."""
        if self.dead:
            raise EngineDeadError(f"the engine is dead ({self.dead}); restart it")
        stats = self.stats
        try:
            batch, pending, rows = self.step_ahead.take()
            if batch is None:
                batch = self.scheduler.schedule()
                if stats is not None:
                    stats.step_started(batch)
                inputs, batch = self._batch_inputs(batch) if batch else (None, None)
                pending = self.runner.launch(*inputs) if batch else None
            elif stats is not None:
                stats.step_started(batch)
            if pending is not None and self.async_scheduling:
                self.step_ahead.launch_after(batch, rows)
                if stats is not None and self.step_ahead.launched is not None and self.step_ahead.launched[0].is_prefill:
                    stats.prompts_scheduled(self.step_ahead.launched[0].seqs)
            if after_launch is not None:
                after_launch()
            tokens = pending.wait() if pending is not None else None
            if rows is not None:             # a step launched ahead: the rows still running
                tokens = tokens[rows]
            if tokens is not None:
                self._fail_non_finite(batch, tokens)
                self.output_processor.append_step_logprobs(batch.seqs, tokens, self.runner)
            reported = self.scheduler.postprocess(batch, tokens)
            self.step_ahead.step_applied()
            outputs = self._report(reported)
            if stats is not None:
                self.last_step_stats = stats.step_finished(reported)
            return outputs
        except Exception as e:
            self.dead = f"{type(e).__name__}: {e}"
            log.error("engine dead: step() failed for no single request's fault", exc_info=True)
            raise EngineDeadError(f"the engine is dead: {self.dead}") from e

    def _batch_inputs(self, batch: ScheduledBatch):
        """(ForwardBatch, SamplingBatch) of the step, and the batch they are for. A failure is
        pinned on the requests whose rows fail to build on their own; they are failed and the
        batch is rebuilt without them. A failure no row reproduces alone is re-raised."""
        while True:
            try:
                return (batch.forward_batch(self.engine_config.block_size), batch.sampling_batch(self.output_processor.eos_token_ids)), batch
            except Exception as e:
                culprits = {seq: why for seq in batch.seqs if (why := self._row_failure(batch, seq))}
                if not culprits:
                    raise
                for seq, why in culprits.items():
                    self._fail(seq, f"this request's batch row could not be built: {why}")
                batch = ScheduledBatch([s for s in batch.seqs if s not in culprits],
                                       batch.is_prefill, batch.block_manager)
                if not batch.seqs:
                    return None, None
                log.warning("step rebuilt without %d request(s) after %s: %s",
                            len(culprits), type(e).__name__, e)

    def _row_failure(self, batch: ScheduledBatch, seq: Sequence) -> str | None:
        alone = ScheduledBatch([seq], batch.is_prefill, batch.block_manager)
        try:
            alone.forward_batch(self.engine_config.block_size)
            alone.sampling_batch(self.output_processor.eos_token_ids)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _fail_non_finite(self, batch: ScheduledBatch, tokens: np.ndarray) -> None:
        """The sampler's id is -1 for a row whose logits held NaN or +inf (or no finite value)."""
        tokens = np.asarray(tokens)
        if not tokens.size or tokens.min() >= 0:     # the every-step case, in one numpy call
            return
        for i in np.flatnonzero(tokens < 0):
            seq = batch.seqs[int(i)]
            self._fail(seq, "the model produced non-finite logits (NaN or inf) for this request")

    def _fail(self, seq: Sequence, message: str) -> None:
        log.warning("request %s failed: %s", seq.request_id, message)
        seq.error = message
        self.scheduler.abort(seq, SequenceStatus.FINISHED_ERROR)

    def _report(self, reported: list[Sequence]) -> list[RequestOutput]:
        """One RequestOutput per request with a sequence to report, in the order of their first
        reported sequence. A sample 0 whose prompt is now in the prefix cache releases the
        request's other samples."""
        requests: dict[str, Request] = {}
        for seq in reported:
            request = self._requests.get(seq.request_id)
            if request is not None:
                requests.setdefault(seq.request_id, request)
        outputs = []
        for request in requests.values():
            first = request.seqs[0]
            if request.held and (first.num_output_tokens > 0 or first.is_finished):
                self.scheduler.add_next(request.held)
                request.held = []
            if request.is_finished and not request.held:
                del self._requests[request.request_id]
            outputs.append(RequestOutput(request))
        return outputs

    def close(self) -> None:
        self.runner.close()
