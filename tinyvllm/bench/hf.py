"""The HF transformers side of `tinyvllm bench --compare-hf`: the same model directory, the same
requests, timed the same way. torch and transformers are imported here only; they are not
tinyvllm dependencies.

HF `generate` has no continuous batching, so:
  latency     TTFT = a generate(max_new_tokens=1) call; decode tok/s = (n - 1) / (time of the
              n-token call - TTFT).
  batch64     one generate call over 64 equal-length prompts (no padding).
  throughput  static batches of 64 in request order, left-padded to the batch's longest prompt,
              each run to the batch's longest output (min_new_tokens = max_new_tokens, HF's
              ignore_eos); only each request's own requested tokens count as output, so the
              padding and the overrun are HF's cost, as they would be in a static server.
Every HF run shares one wall-clock budget (--hf-max-seconds): a workload whose estimate does not
fit what is left is skipped, and one that overruns is cut off at the deadline; either way it is
reported with a note instead of a number.
"""
from __future__ import annotations

import importlib.util
import time

from tinyvllm.bench.workloads import BenchRequest, WorkloadResult, WorkloadSpec
from tinyvllm.errors import TinyVLLMError

STATIC_BATCH = 64


def check_available() -> None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise TinyVLLMError(f"--compare-hf needs {' and '.join(missing)} (not tinyvllm "
                            f"dependencies): pip install torch transformers")


class HFBench:
    def __init__(self, model_dir, device: str, budget_s: float):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.torch, self.device = torch, device
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        if device == "cuda" and not torch.cuda.is_available():
            raise TinyVLLMError("--compare-hf: torch sees no CUDA device")
        self.deadline = time.perf_counter() + budget_s
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), torch_dtype=torch.bfloat16).to(device).eval()
        eos = self.model.config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
        # A plain greedy config: the checkpoint's own asks for sampling.
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.config.bos_token_id, eos_token_id=eos, pad_token_id=self.pad_id)
        self._decode_step_s: float | None = None     # per-token time at batch 64, for estimates

    @property
    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()

    def close(self) -> None:
        del self.model
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    # -- one generate call ---------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, bool]:
        """Left-padded greedy generate of exactly new_tokens per row -> (seconds, finished),
        finished False when the budget's deadline cut it short."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      stopping_criteria=self._deadline_criteria())
        self._sync()
        return time.perf_counter() - start, out.shape[1] - width == new_tokens

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _deadline_criteria(self):
        from transformers import StoppingCriteria, StoppingCriteriaList
        torch, deadline = self.torch, self.deadline

        class PastDeadline(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), time.perf_counter() > deadline,
                                  dtype=torch.bool, device=input_ids.device)
        return StoppingCriteriaList([PastDeadline()])

    # -- workloads -----------------------------------------------------------------------------
    def warm_up(self, requests: list[BenchRequest]) -> None:
        self.generate([requests[0].prompt_token_ids], 4)

    def run(self, spec: WorkloadSpec, requests: list[BenchRequest]) -> WorkloadResult:
        result = WorkloadResult("hf", num_requests=len(requests),
                                prompt_tokens=sum(len(r.prompt_token_ids) for r in requests))
        estimate = self.estimate_s(requests) or 0.0
        if self.seconds_left <= 0 or estimate > self.seconds_left:
            result.note = (f"skipped: estimated {estimate:.0f} s, {max(self.seconds_left, 0):.0f} s "
                           f"left of --hf-max-seconds" if estimate else
                           "skipped: no time left of --hf-max-seconds")
            return result
        run = self._run_latency if spec.num_requests == 1 else self._run_batches
        return run(requests, result)

    def _run_latency(self, requests, result: WorkloadResult) -> WorkloadResult:
        prompt, n = [requests[0].prompt_token_ids], requests[0].max_tokens
        ttft, _ = self.generate(prompt, 1)
        wall, finished = self.generate(prompt, n)
        if not finished:
            return self._cut_off(result)
        result.output_tokens, result.ttft_ms = n, 1000 * ttft
        result.decode_tok_s = (n - 1) / (wall - ttft) if wall > ttft else None
        return result.finish(wall)

    def _run_batches(self, requests, result: WorkloadResult) -> WorkloadResult:
        wall = 0.0
        for start in range(0, len(requests), STATIC_BATCH):
            batch = requests[start:start + STATIC_BATCH]
            longest = max(r.max_tokens for r in batch)
            seconds, finished = self.generate([r.prompt_token_ids for r in batch], longest)
            if not finished:
                return self._cut_off(result)
            wall += seconds
            if len(batch) == STATIC_BATCH:
                self._decode_step_s = seconds / longest
            result.output_tokens += sum(r.max_tokens for r in batch)
        result.note = "static batches of 64, left-padded" if len(requests) > STATIC_BATCH else None
        return result.finish(wall)

    def estimate_s(self, requests: list[BenchRequest]) -> float | None:
        """Seconds the static batches would take, from the per-token time of an earlier full
        batch (prefill folded in; longer contexts make it an underestimate, which the deadline
        covers); None before any full batch has run."""
        if self._decode_step_s is None:
            return None
        batches = [requests[i:i + STATIC_BATCH] for i in range(0, len(requests), STATIC_BATCH)]
        return self._decode_step_s * sum(max(r.max_tokens for r in b) for b in batches)

    def _cut_off(self, result: WorkloadResult) -> WorkloadResult:
        result.output_tokens = 0
        result.note = "cut off: --hf-max-seconds ran out"
        return result
