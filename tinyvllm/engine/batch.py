"""The two inputs of a step, shared by the numpy reference backend and the CUDA backend:
ForwardBatch, the one input format of a model forward pass, and SamplingBatch, the sampler's
per-sequence parameters (its sparse logit processing is engine/logit_edits.py's).

A batch holds S sequences, flattened into T new tokens. Sequence i contributes the tokens
[query_start[i], query_start[i+1]) of the flat arrays; they sit at the *end* of its context, so
its first new token has position context_lens[i] - q_len_i. A prefill-kind batch (is_prefill)
has q_len = the step's part of a prompt (its uncached part, or a chunk of it), and in a mixed
step (engine/scheduler.py) also decode rows, q_len = 1 at the end of their context; logits are
kept for each sequence's last new token only. A decode batch has q_len = 1 for every sequence.

The paged KV cache (per layer, K and V each):  [num_blocks, block_size, kv_heads, head_dim]

    block_tables[i] = [7, 2, 9, ...]      logical block j of sequence i lives in physical block
                                           block_tables[i, j]; unused entries are -1
    token at position p of sequence i  ->  slot = block_tables[i, p // block_size] * block_size
                                                  + p % block_size
    slot_mapping[t]                        the slot each new token's K and V are written to

Attention for new token t of sequence i reads positions 0 .. position[t] (causal), i.e. the
cached prefix and the new tokens up to itself, all through the block table.

Fed tokens (async scheduling, engine/llm_engine.py): a decode step may be launched before the
step before it has been read back. Its token ids are then not known on the host yet:
fed_rows[t] = r >= 0 says token t is row r of the previous step's sampled ids, which the
device reads where the previous step's sampler left them; -1 (or fed_rows None) says token t
is token_ids[t].

Common prefix (cascade attention, docs/engine.md): in a decode batch whose sequences all start
with the same physical KV blocks (prefix caching shared one prompt prefix among them),
common_prefix_blocks = the number of those leading blocks that attention may read once for every
sequence instead of once per sequence; 0 = none, each sequence reads its own context. Decode
batches get it from cascade_prefix_blocks() below; prefill-kind batches always have 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tinyvllm.engine.logit_edits import NO_EDITS, PLAIN, LogitEdits, step_edits
from tinyvllm.structured.mask import PendingTokenMask, TokenMask, step_token_mask


@dataclass
class ForwardBatch:
    token_ids: np.ndarray      # int32 [T]
    positions: np.ndarray      # int32 [T]
    slot_mapping: np.ndarray   # int32 [T]
    query_start: np.ndarray    # int32 [S + 1], query_start[0] = 0, query_start[S] = T
    context_lens: np.ndarray   # int32 [S], cached + new tokens
    block_tables: np.ndarray   # int32 [S, max_blocks], -1 padded
    is_prefill: bool
    fed_rows: np.ndarray | None = None   # int32 [T]: see "Fed tokens" above; None: none fed
    common_prefix_blocks: int = 0        # see "Common prefix" above; 0: no cascade attention

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def with_fed_ids(self, previous_ids: np.ndarray) -> ForwardBatch:
        """This batch with its fed tokens resolved from the previous step's sampled ids (what
        the device does in the embedding gather; used where the ids are known on the host)."""
        if self.fed_rows is None:
            return self
        fed = self.fed_rows >= 0
        ids = self.token_ids.copy()
        ids[fed] = np.asarray(previous_ids, np.int32)[self.fed_rows[fed]]
        return dataclasses.replace(self, token_ids=ids, fed_rows=None)

    @property
    def leading_decode_rows(self) -> int:
        """A prefill-kind batch's leading one-token rows: a mixed step's decode rows, which the
        scheduler puts first (the CUDA backend sends them through the decode attention kernel);
        0 for a decode batch."""
        if not self.is_prefill:
            return 0
        longer = np.flatnonzero(np.diff(self.query_start) != 1)
        return int(longer[0]) if len(longer) else self.num_seqs

    @property
    def last_token_indices(self) -> np.ndarray:
        """Flat index of each sequence's last new token: the rows whose logits are needed."""
        return self.query_start[1:] - 1

    @classmethod
    def build(cls, new_tokens: list[list[int]], context_lens: list[int],
              block_tables: list[list[int]], block_size: int, is_prefill: bool) -> ForwardBatch:
        """Flatten per-sequence new tokens (at the end of each context) into a batch."""
        q_lens = [len(t) for t in new_tokens]
        query_start = np.zeros(len(q_lens) + 1, np.int32)
        np.cumsum(q_lens, out=query_start[1:])
        positions = np.concatenate([np.arange(c - q, c, dtype=np.int32)
                                    for q, c in zip(q_lens, context_lens)]) if q_lens else np.zeros(0, np.int32)
        width = max((len(b) for b in block_tables), default=0)
        tables = np.full((len(block_tables), max(width, 1)), -1, np.int32)
        for i, b in enumerate(block_tables):
            tables[i, :len(b)] = b
        seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        decode = not is_prefill and all(q == 1 for q in q_lens)
        return cls(
            token_ids=np.asarray([t for ts in new_tokens for t in ts], np.int32),
            positions=positions,
            slot_mapping=slots.astype(np.int32),
            query_start=query_start,
            context_lens=np.asarray(context_lens, np.int32),
            block_tables=tables,
            is_prefill=is_prefill,
            common_prefix_blocks=cascade_prefix_blocks(tables, context_lens, block_size) if decode else 0,
        )

    @classmethod
    def build_decode(cls, token_ids: list[int], context_lens: list[int], block_tables: np.ndarray,
                     block_size: int) -> ForwardBatch:
        """A decode batch (one new token per sequence, at position context_len - 1) from
        ready-made -1 padded block tables: what build() gives, in a few vectorized steps."""
        context_lens = np.asarray(context_lens, np.int32)
        positions = context_lens - 1
        rows = np.arange(len(context_lens))
        slots = block_tables[rows, positions // block_size] * block_size + positions % block_size
        return cls(
            token_ids=np.asarray(token_ids, np.int32),
            positions=positions,
            slot_mapping=slots.astype(np.int32),
            query_start=np.arange(len(context_lens) + 1, dtype=np.int32),
            context_lens=context_lens,
            block_tables=block_tables,
            is_prefill=False,
            common_prefix_blocks=cascade_prefix_blocks(block_tables, context_lens, block_size),
        )


# ---- cascade attention: when a decode batch reads its common prefix once ------------------------
# The rule has vLLM V1's shape (vllm/v1/attention/backends/flash_attn.py: use_cascade_attention;
# the prefix it is given: gpu_model_runner.py's _compute_cascade_attn_prefix_len, which likewise
# caps it at the shortest computed context and rounds it down to whole blocks):
#   * a common prefix of at least CASCADE_MIN_PREFIX_TOKENS tokens,
#   * at least CASCADE_MIN_SEQS sequences;
# vLLM's numbers (256 and 8, which its comments call arbitrary) are replaced by where this
# engine's kernels pay, timed on the 1B preset (benchmarks/decode_profile.py --shared-prefix,
# decode graph GPU time with the prefix shared against main's plain decode attention over the
# same shared blocks; H100, 2026-12-07): a 1,024-token prefix at context 1,300 gains 2 % at 96
# sequences, 4 % at 128, 8 % at 192, 12 % at 256, and loses 1 % at 64; a 512-token prefix at
# context 800 loses 1-6 % at 64-256 sequences, a 256-token one 5-10 % at 8-32.
# vLLM's further test for GQA decode batches (a rough model of FlashAttention's 128 x 128 tiles
# and CTA waves against FlashDecoding's) is left out: it models that library's kernels.
# vLLM also turns cascade off for sliding-window models; here a sliding-window layer simply
# takes the per-sequence attention (reference/model.py), so a model mixing both kinds of layer
# still shares the prefix in its global layers.
CASCADE_MIN_PREFIX_TOKENS = 1024
CASCADE_MIN_SEQS = 96


def common_prefix_blocks(block_tables: np.ndarray, context_lens, block_size: int) -> int:
    """The number of leading block-table columns holding the same physical block in every row
    of a decode batch, counting only blocks that are full and lie strictly before each
    sequence's newest token: at most min((context_len - 1) // block_size) over the rows. The
    step writes only each sequence's newest K/V row (position context_len - 1), so those blocks
    are complete and nothing writes them while it runs (block_manager.py: a block in several
    tables is published, below every holder's num_cached_tokens, never rewritten)."""
    if len(context_lens) == 0:
        return 0
    return _shared_columns(block_tables, _prefix_limit(context_lens, block_size))


def _prefix_limit(context_lens, block_size: int) -> int:
    """The most leading blocks a decode batch may share: full, and before every sequence's newest
    token ((shortest context - 1) // block_size)."""
    return int(np.min(context_lens) - 1) // block_size


def _shared_columns(block_tables: np.ndarray, limit: int) -> int:
    """How many of the first `limit` columns hold one value in every row (counting from 0)."""
    if limit <= 0:
        return 0
    head = np.asarray(block_tables)[:, :limit]
    same = (head == head[0]).all(axis=0)
    return head.shape[1] if same.all() else int(np.argmin(same))


def cascade_prefix_blocks(block_tables: np.ndarray, context_lens, block_size: int) -> int:
    """A decode batch's ForwardBatch.common_prefix_blocks: its common_prefix_blocks when cascade
    attention is worth it by the rule above, else 0. Runs on every decode step: a batch of
    fewer than CASCADE_MIN_SEQS sequences, or whose shortest context cannot hold the shortest
    prefix worth sharing, is answered before any block is compared (at 256 sequences the
    comparison costs ~15 us of host time on a 2-core x86-64 CPU, numpy 2.4)."""
    if len(context_lens) < CASCADE_MIN_SEQS:
        return 0
    limit = _prefix_limit(context_lens, block_size)
    if limit * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return 0
    blocks = _shared_columns(block_tables, limit)
    return blocks if blocks * block_size >= CASCADE_MIN_PREFIX_TOKENS else 0


GREEDY_BELOW = 1e-5                 # SamplingBatch maps temperatures below this to 0 (greedy)


def samples_ahead(seq) -> bool:
    """Whether a row's sampling inputs for its next token are known before its last token is:
    plain rows, and constrained rows that are plain but for the mask (computed once that token
    is in: PendingTokenMask). Not so for penalties, logit_bias, a min_tokens ban (their edits
    count the tokens), min_p or logprobs (the runner's longer road, one step at a time)."""
    state = seq.sampler_state
    return state is PLAIN or (state is NO_EDITS and seq.constraint is not None
                              and not seq.params.min_p and seq.params.logprobs is None)


@dataclass
class StepLogprobs:
    """What the runner returns besides the sampled ids when some row asked for logprobs:
    vLLM's default "raw" logprobs, log_softmax of the model's logits before any processing.
    Row j is for batch row rows[j]; top_* hold k = the most any of them asked for, best first
    (ties: lower id first), so a row asking for n reads the first n columns."""
    rows: np.ndarray              # int32 [R]
    sampled_logprob: np.ndarray   # float32 [R]
    sampled_rank: np.ndarray      # int32 [R]: 1 + number of other tokens with logit >= the sampled one's
    top_ids: np.ndarray           # int32 [R, k]
    top_logprobs: np.ndarray      # float32 [R, k]


@dataclass
class SamplingBatch:
    """Per-sequence sampling inputs of one step, in the dtypes the CUDA kernel reads."""
    temperature: np.ndarray   # float32 [S]; 0 = greedy
    top_k: np.ndarray         # int32 [S];   <= 0 or >= vocab: off
    top_p: np.ndarray         # float32 [S]; 1 = off
    seed: np.ndarray          # uint64 [S]
    step: np.ndarray          # int32 [S];   tokens this request has generated so far
    min_p: np.ndarray | None = None       # float32 [S]; 0 = off (None: all off)
    edits: LogitEdits | None = None       # sparse logit processing; None: nothing to edit
    logprobs: np.ndarray | None = None    # int32 [S]; top log-probs wanted, -1 = none (None: none)
    # constrained rows' allowed tokens (structured/mask.py); a PendingTokenMask in a step launched
    # ahead, resolved before it samples
    token_mask: TokenMask | PendingTokenMask | None = None

    def __post_init__(self):
        if self.min_p is None:
            self.min_p = np.zeros(len(self.temperature), np.float32)

    @classmethod
    def build(cls, temperature, top_k, top_p, seed, step, min_p=None, edits=None,
              logprobs=None, token_mask=None) -> SamplingBatch:
        t = np.asarray(temperature, np.float32)
        lp = None
        if logprobs is not None:
            lp = np.asarray([-1 if v is None else v for v in logprobs], np.int32)
            if not np.any(lp >= 0):
                lp = None
        return cls(temperature=np.where(t < GREEDY_BELOW, np.float32(0), t).astype(np.float32),
                   top_k=np.asarray(top_k, np.int32), top_p=np.asarray(top_p, np.float32),
                   seed=np.asarray(seed, np.uint64), step=np.asarray(step, np.int32),
                   # clamped to [0, 1] (NaN -> 0): above 1 no token would survive the draw
                   min_p=None if min_p is None else np.clip(np.nan_to_num(np.asarray(min_p, np.float32)), 0, 1),
                   edits=edits, logprobs=lp, token_mask=token_mask)

    @classmethod
    def from_sequences(cls, seqs, eos_token_ids=(), tokens_ahead: int | np.ndarray = 0) -> SamplingBatch:
        """The step's sampling inputs for these sequences (ScheduledBatch.sampling_batch).
        Rows that use no penalty, bias or min_tokens add nothing to `edits`; a batch where
        none does has edits None, and then the runner launches exactly the plain sampler.
        tokens_ahead: tokens each sequence (an int: every one) will have generated before this
        step that are not in its token_ids yet (async scheduling's step launched ahead; rows
        that samples_ahead only, the constrained ones' mask then a PendingTokenMask)."""
        p = [s.params for s in seqs]
        states = [s.sampler_state for s in seqs]
        plain = states.count(PLAIN) == len(states)
        ahead = bool(np.any(tokens_ahead))
        if ahead and not plain and not all(samples_ahead(s) for s in seqs):
            raise ValueError("only plain-sampling rows can be sampled ahead of their last token")
        if plain or ahead:               # the common step: plain sampling only (or masked ahead)
            # built here with one numpy call per array, not through build()'s generic
            # conversions: this runs every step (with one other change it took the engine's host
            # time per step from 76-86 to 61-65 us: benchmarks/engine_overhead.py, CPU, 2026-12-03,
            # 97561a8)
            return cls(temperature=np.array([0.0 if x.temperature < GREEDY_BELOW else x.temperature for x in p],
                                            np.float32),
                       top_k=np.array([x.top_k for x in p], np.int32),
                       top_p=np.array([x.top_p for x in p], np.float32),
                       seed=np.array([s.seed for s in seqs], np.uint64),
                       step=np.array([len(s.token_ids) - s.num_prompt_tokens for s in seqs], np.int32)
                       + np.asarray(tokens_ahead, np.int32),
                       min_p=np.zeros(len(p), np.float32),
                       token_mask=None if plain else PendingTokenMask(seqs))
        min_p = [x.min_p for x in p]
        logprobs = [x.logprobs for x in p]
        return cls.build([x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p],
                         [s.seed for s in seqs], [len(s.token_ids) - s.num_prompt_tokens for s in seqs],
                         min_p=min_p if any(min_p) else None, edits=step_edits(seqs, eos_token_ids),
                         logprobs=None if logprobs.count(None) == len(logprobs) else logprobs,
                         token_mask=step_token_mask(seqs))

    @classmethod
    def greedy(cls, num_seqs: int) -> SamplingBatch:
        return cls.build([0.0] * num_seqs, [-1] * num_seqs, [1.0] * num_seqs,
                         [0] * num_seqs, [0] * num_seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.temperature)

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature <= 0))

    @property
    def logprob_rows(self) -> np.ndarray:
        """int32: the rows that asked for logprobs (empty when none did)."""
        if self.logprobs is None:
            return np.zeros(0, np.int32)
        return np.flatnonzero(self.logprobs >= 0).astype(np.int32)

    @property
    def logprob_k(self) -> int:
        """The most top log-probs any row asked for (0 when none asked, or all asked for 0)."""
        return 0 if self.logprobs is None else max(0, int(self.logprobs.max()))
