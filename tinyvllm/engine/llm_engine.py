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
j's random stream is seeded with sample_seed(seed, j) (sample 0: the seed itself, so n=1 and
sample 0 of n>1 agree); aborting the request aborts every sample.

Aborted requests: abort_request() frees the blocks at once; the next step() reports the request
one last time with finished=True, finish_reason="abort".

Async scheduling (EngineConfig.async_scheduling; on by default where the runner overlaps steps,
i.e. on cuda): a decode step is launched before the step before it has been read back, so that
the host's work of a step (scheduling, building the inputs, reading the tokens back, the stop
conditions, the outputs) runs while the GPU computes the next. Every input of decode step N+1
but its token ids follows from lengths alone; the ids are row r of step N's sampled ids, which
the device reads where N's sampler left them (ForwardBatch.fed_rows). step() still returns one
step's outputs per call, the same as without it:

    step() call k:   [launch N+1 ahead]  [wait for N, apply its tokens, report N]
    step() call k+1: [launch N+2 ahead]  [wait for N+1 ...]          (N+1 is ready or nearly)

A step goes ahead only where nothing about it depends on N's tokens beyond the ids: after a
decode step, or a prefill of every running sequence that ends each prompt in it (its sampled
ids are then one per row too, so the first decode step runs while the host reads the first
token back), a batch whose rows all sample plainly (no penalties, logit_bias, min_tokens ban, min_p or
logprobs), nobody waiting to be admitted, and a free block for every row that needs one. A row
that N ends by length (max_tokens, the context limit) is left out of N+1; a row that N ends by a
stop token or string, or that is aborted meanwhile, is computed and its token thrown away (its
K/V write lands in its own last block, which nothing else reads before it is handed out again
— and any later user's own writes come after it on the stream).

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

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from tinyvllm.checkpoint.default_model import resolve_model_dir
from tinyvllm.checkpoint.generation_config import default_sampling_fields
from tinyvllm.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyvllm.checkpoint.weights import load_weights
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.batch import PLAIN, ForwardBatch, SamplingBatch
from tinyvllm.engine.block_manager import BlockManager, PrefixCacheStats, blocks_for
from tinyvllm.engine.limits import (
    check_request,
    check_text,
    fit_context_to_cache,
    longest_token_bytes,
    max_prompt_bytes,
)
from tinyvllm.engine.model_runner import ModelRunner, PendingStep, logprobs_of_rows, make_runner, runner_class
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.outputs import RequestOutput
from tinyvllm.engine.sampling_params import SamplingParams
from tinyvllm.engine.scheduler import ScheduledBatch, Scheduler
from tinyvllm.engine.sequence import Request, Sequence, SequenceStatus
from tinyvllm.engine.stats import StatsCollector, StepStats
from tinyvllm.errors import EngineDeadError, InvalidRequestError, ModelLoadError, TinyVLLMError
from tinyvllm.structured.grammar import GrammarCompiler

log = logging.getLogger("tinyvllm.engine")

MASK64 = (1 << 64) - 1

# SamplingParams fields the sampler of this build applies, by the value that means "off". The
# sampler's own branch (penalties, min_p, logit_bias: engine/batch.py, reference/sampling.py,
# gpu/cuda/sampling.cu) empties this when it lands; until then a request asking for one of them
# is refused rather than served without it.

def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: the seed itself for sample 0, a
    splitmix64 mix of (seed, index) for the others (distinct streams, reproducible)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt already encoded by the caller: add_request takes its ids as they are, with no
    tokenizing on the engine's thread (the server encodes in a worker pool, server/encoding.py).
    text is what RequestOutput.prompt reports (None: the ids were the prompt)."""
    text: str | None
    token_ids: tuple[int, ...]


def make_engine_config(engine_config: EngineConfig | None, options: dict) -> EngineConfig:
    try:
        if engine_config is None:
            return EngineConfig(**options)
        return dataclasses.replace(engine_config, **options)
    except TypeError as e:           # an unknown keyword
        known = ", ".join(f.name for f in dataclasses.fields(EngineConfig))
        raise TinyVLLMError(f"unknown engine option ({e}); known options: {known}") from None
    except ValueError as e:          # EngineConfig's own range checks
        raise TinyVLLMError(f"invalid engine option: {e}") from None


class LLMEngine:
    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None, *,
                 runner: ModelRunner | None = None, chat_template: str | Path | None = None,
                 **engine_options):
        """model: a Hugging Face model directory; None: the default model (checkpoint/default_model.py). runner: a ready
        ModelRunner to use instead of loading the weights into a new one (benchmarks and tests
        drive the real engine with a fake model this way). chat_template: a template file or
        text replacing the model directory's own."""
        start = time.perf_counter()
        self.engine_config = make_engine_config(engine_config, engine_options)
        if runner is None and model is None:
            runner_class(self.engine_config)   # a backend that cannot load is said before the default model's conversion
        model_dir = resolve_model_dir(model)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir, self.model_config, chat_template)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ModelLoadError(
                f"{model_dir}: tokenizer.json has {self.tokenizer.vocab_size} tokens but config.json's "
                f"vocab_size is {self.model_config.vocab_size}: the model has no embedding for the rest")
        self.runner = runner or make_runner(self.model_config, load_weights(model_dir, self.model_config),
                                            self.engine_config)
        try:
            self.engine_config = fit_context_to_cache(self.engine_config, self.model_config,
                                                      self.runner.num_kv_blocks)
        except TinyVLLMError:
            self.runner.close()          # give the device memory back before the error leaves
            raise
        if self.engine_config.trace_steps:       # eager, printed steps first (tinyvllm/trace.py)
            from tinyvllm.trace import TracingRunner
            self.runner = TracingRunner(self.runner, self.model_config, self.engine_config)
        self.context_limit = self.engine_config.context_limit(self.model_config)
        longest = longest_token_bytes(self.tokenizer)
        self.max_prompt_bytes = None if longest is None else max_prompt_bytes(self.context_limit, longest)
        self.dead: str | None = None     # why the engine died (see the module docstring)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.engine_config.block_size,
                                          self.engine_config.enable_prefix_caching)
        self.output_processor = OutputProcessor(self.tokenizer, self.tokenizer.eos_token_ids,
                                                self.context_limit)
        self.scheduler = Scheduler(self.engine_config, self.block_manager, self.output_processor)
        self.default_sampling_fields = default_sampling_fields(model_dir, self.engine_config.generation_config)
        # structured outputs: grammars compiled for this tokenizer (llguidance's made on first use)
        self.structured = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids)
        self._seed_rng = np.random.default_rng(self.engine_config.seed)   # seeds for unseeded requests
        self._requests: dict[str, Request] = {}                           # unfinished, by id
        asked = self.engine_config.async_scheduling
        self.async_scheduling = self.runner.overlaps_steps if asked is None else asked
        self._ahead: tuple[ScheduledBatch, PendingStep] | None = None   # the step launched ahead
        self.num_steps_ahead = 0          # decode steps launched ahead (async scheduling) ...
        self.num_rows_thrown_away = 0     # ... and their rows whose sequence finished meanwhile
        self.stats: StatsCollector | None = None       # enable_stats() turns it on
        self.last_step_stats: StepStats | None = None
        self._log_ready(model_dir, time.perf_counter() - start)

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
        self._check_supported(params)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.context_limit:
            raise InvalidRequestError(f"prompt is {len(ids)} tokens; the context limit is "
                                      f"{self.context_limit}, which leaves no room to generate")
        if blocks_for(len(ids), self.block_manager.block_size) > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens but the whole KV cache holds only "
                f"{self.block_manager.num_blocks * self.block_manager.block_size}")
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

    def _check_supported(self, params: SamplingParams) -> None:
        """What this engine cannot honour is refused, never ignored (a runner that does not say
        it supports logprobs, e.g. a test fake, does not get them)."""
        device = self.engine_config.device
        if params.logprobs is not None and not getattr(self.runner, "supports_logprobs", False):
            raise InvalidRequestError(f"invalid sampling parameter logprobs={params.logprobs!r}: the "
                                      f"{device} runner does not return logprobs in this build")
        if params.prompt_logprobs is not None and not getattr(self.runner, "supports_prompt_logprobs", False):
            raise InvalidRequestError(
                f"invalid sampling parameter prompt_logprobs={params.prompt_logprobs!r}: not supported on "
                f"{device}: its forward pass computes the logits of each sequence's last position only")

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, TokenizedPrompt):
            return prompt.text, self._prompt_ids(list(prompt.token_ids))[1]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            check_text(prompt, "prompt", self.max_prompt_bytes)
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt] if all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt) else None
            if ids is None:
                raise InvalidRequestError("a token-id prompt must be a list of integers")
            if not ids:
                raise InvalidRequestError("prompt is empty")
            vocab = self.model_config.vocab_size
            if not all(0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
            return None, ids
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

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
    def step(self) -> list[RequestOutput]:
        """One scheduler step: a prefill batch or a decode step. -> one RequestOutput per
        request that got a new token or finished. Raises EngineDeadError (see the module
        docstring) when the step failed for no one request's fault."""
        if self.dead:
            raise EngineDeadError(f"the engine is dead ({self.dead}); restart it")
        stats = self.stats
        try:
            batch, pending, rows = self._take_ahead() if self._ahead is not None else (None, None, None)
            if batch is None:
                batch = self.scheduler.schedule()
                if stats is not None:
                    stats.step_started(batch)
                inputs, batch = self._batch_inputs(batch) if batch else (None, None)
                pending = self.runner.launch(*inputs) if batch else None
            elif stats is not None:
                stats.step_started(batch)
            if pending is not None and self.async_scheduling:
                self._ahead = self._launch_ahead(batch, rows)
            tokens = pending.wait() if pending is not None else None
            if rows is not None:             # a step launched ahead: the rows still running
                tokens = tokens[rows]
            if tokens is not None:
                self._fail_non_finite(batch, tokens)
                self._logprobs(batch, tokens)
            reported = self.scheduler.postprocess(batch, tokens)
            if self._ahead is not None and all(s.status.is_finished for s in self._ahead[0].seqs):
                self._take_ahead()           # every row just finished: nothing of it is kept
            outputs = self._report(reported)
            if stats is not None:
                self.last_step_stats = stats.step_finished(reported)
            return outputs
        except Exception as e:
            self.dead = f"{type(e).__name__}: {e}"
            log.error("engine dead: step() failed for no single request's fault", exc_info=True)
            raise EngineDeadError(f"the engine is dead: {self.dead}") from e

    # -- async scheduling (the module docstring) -------------------------------------------------
    def _launch_ahead(self, batch: ScheduledBatch, rows: np.ndarray | None) -> tuple[ScheduledBatch, PendingStep] | None:
        """Launch the decode step after `batch` (a decode step or a prefill, launched, not read
        back yet), or None where it cannot go ahead; it is then scheduled as usual once `batch`
        is applied. rows: the row of each of batch's sequences in its launched step (None: its
        own order)."""
        if self.scheduler.waiting:
            return None                  # admitting them comes first (a prompt chunk stays waiting too)
        if batch.is_prefill and (len(batch.seqs) != len(self.scheduler.running) or any(
                (r := self._requests.get(s.request_id)) is not None and r.held for s in batch.seqs)):
            return None      # rows that sat this prefill out, or samples it releases: the next step is theirs
        if any(s.sampler_state is not PLAIN for s in batch.seqs):
            return None                  # its next sampler inputs depend on this step's token
        seqs = [s for s in batch.seqs if not self.output_processor.ends_by_length(s, len(s.token_ids) + 1)]
        if not seqs:
            return None
        bm, block_size = self.block_manager, self.engine_config.block_size
        needing = sum(len(s.token_ids) + 1 > len(s.block_table) * block_size for s in seqs)
        if needing > bm.num_free_blocks:
            return None                  # the scheduler's preemption decides, next step
        for seq in seqs:
            bm.try_append_slot(seq, len(seq.token_ids) + 1)
        row_of = {id(s): i if rows is None else int(rows[i]) for i, s in enumerate(batch.seqs)}
        context_lens = [len(s.token_ids) + 1 for s in seqs]
        width = -(-max(context_lens) // block_size)
        forward = ForwardBatch.build_decode([0] * len(seqs), context_lens,
                                            bm.tables[[s.block_table_row for s in seqs], :width], block_size)
        forward.fed_rows = np.asarray([row_of[id(s)] for s in seqs], np.int32)
        sampling = SamplingBatch.from_sequences(seqs, tokens_ahead=1)
        pending = self.runner.launch(forward, sampling)
        self.num_steps_ahead += 1
        return ScheduledBatch(seqs, False, bm), pending

    def _take_ahead(self):
        """The step launched ahead, as this step's batch of the rows still running (a row
        finished or aborted since has its token thrown away) -> (batch, pending step, the
        rows of its sampled ids to keep); (None, None, None) when no row is still running,
        and the step is scheduled as usual."""
        (batch, pending), self._ahead = self._ahead, None
        rows = [i for i, s in enumerate(batch.seqs) if not s.status.is_finished]
        self.num_rows_thrown_away += len(batch.seqs) - len(rows)
        if not rows:
            return None, None, None
        seqs = [batch.seqs[i] for i in rows]
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        return ScheduledBatch(seqs, False, batch.block_manager), pending, np.asarray(rows, np.intp)

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

    def _logprobs(self, batch: ScheduledBatch, tokens: np.ndarray) -> None:
        """The logprobs of this step's sampled tokens, for the rows that asked (a prompt chunk
        that samples nothing is skipped by its row's count), before postprocess appends them."""
        rows = [i for i, s in enumerate(batch.seqs) if s.logprobs is not None and tokens[i] >= 0
                and s.num_cached_tokens + s.num_scheduled_tokens >= len(s.token_ids)]
        if not rows:
            return
        sampled_ids = np.asarray(tokens)[rows]
        k = max(batch.seqs[i].params.logprobs for i in rows)
        sampled, ranks, top_ids, top_lps = logprobs_of_rows(self.runner.last_logprobs, rows, k)
        for j, i in enumerate(rows):
            seq = batch.seqs[i]
            kk = seq.params.logprobs
            self.output_processor.append_logprobs(seq, int(sampled_ids[j]), float(sampled[j]),
                                                  int(ranks[j]), top_ids[j, :kk].tolist(),
                                                  top_lps[j, :kk].tolist())

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
