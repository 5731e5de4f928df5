"""Continuous batching and chunked prefill over a paged cache, against static batching.

Requests arrive over time (:func:`arrival_trace`: prompt length, output length, arrival step,
from a seeded ``torch.Generator``). A :class:`Scheduler` recomposes the batch at every step:
it admits arrived requests while the pool has blocks for them, runs one forward of the model
for every row of the step, then retires the finished requests and frees their blocks. This is
iteration-level scheduling as Orca (Yu et al., OSDI 2022) named it, over the block tables of
vLLM's PagedAttention (Kwon et al., 2023).

Three policies on one loop (``policy``, ``token_budget``):

* ``"static"``: a batch is formed from the requests waiting, runs until its longest request
  finishes (finished rows keep their blocks, as the rows of a padded batch do), then the next.
* ``"continuous"`` without a budget: prefill first, as vLLM's scheduler did by default before
  chunked prefill: a step that has newly admitted requests runs their whole prompts and
  nothing else, so the running requests' decodes pause for it.
* ``"continuous"`` with ``token_budget=N``: chunked prefill with stall-free batching, as in
  Sarathi-Serve (Agrawal et al., OSDI 2024) and vLLM's chunked prefill
  (``max_num_batched_tokens``): every decoding request gets its one token first, and the rest of
  the budget goes to prefill chunks, in order of admission.

**A ragged step.** Rows of one step are at different lengths: row ``b`` holds ``P_b`` cached
positions and brings ``n_b`` new tokens (a prefill chunk or one decode token). The reference
decoder takes them in one call: the new tokens are right-padded to ``C = max n_b``; each row
writes its ``n_b`` K/V rows into its own blocks and reads its own blocks back, gathered to
``T = max (P_b + n_b)`` columns (:class:`RaggedStep`); per-row positions ``P_b .. P_b + n_b - 1``
and a per-row mask (a real query at position ``P_b + j`` reads keys ``0 .. P_b + j`` of its own
row) make each row the function of its own sequence. Pad queries read key 0 of their row so no
softmax row is empty; their outputs are never read. This needs learned positions
(``Decoder.forward(positions=...)``): :func:`kvdoc.core.rope.apply_rope` turns a whole batch from
one start, so a RoPE model is refused rather than run wrong.

Real engines do not pad. vLLM flattens the step's tokens of every sequence into one packed batch
(each sequence's start in it is ``query_start_loc``, a cumulative sum) and attends with
variable-length kernels that read each sequence's blocks through its block table
(FlashAttention's ``flash_attn_varlen_func`` with cumulative lengths ``cu_seqlens``; PyTorch's
``torch.nn.attention.varlen.varlen_attn`` takes ``cu_seq_q``, ``cu_seq_k`` and a
``block_table``); SGLang does the same with FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (``qo_indptr``, page indices). Linear layers then see
``sum n_b`` tokens; Orca called this selective batching: every operation batched over the
packed tokens except attention, which is computed per request. The padding here costs time,
not correctness.

**Admission and preemption.** By default admission never over-commits: a request is admitted
only if the free blocks, less those the running requests will still need, cover its whole final
length (prompt + output - 1 positions, :meth:`Request.blocks_needed`), so no request is ever
preempted. With ``preempt=True`` a request is admitted when the free blocks cover what it and
the running requests write next, as vLLM admits; when a row then cannot get a block, the most
recently admitted request (vLLM's policy) is preempted by recompute: all its blocks are given
back, it goes to the front of the waiting queue with its prompt and the tokens it has chosen,
and when admitted again it prefills that whole sequence (its tokens are kept, never chosen
again). Either way blocks are taken as positions are written, so the memory held per step is
what is filled, rounded up to blocks.

**Forks.** A request with ``samples=n`` (and a ``seed``) prefills its prompt once; when the
prompt's last position has its logits, it forks into ``n`` sequences that share every block of
the prompt (one reference each, :meth:`BlockPool.share`). Each draws its tokens with its own
generator (:func:`sample_generator`, :func:`choose`); the first write of a fork into a shared
block, the prompt's partly filled last block, copies it first (copy-on-write,
:meth:`BlockPool.copy`), as vLLM's block manager did for parallel sampling and beam search.

>>> from kvdoc import Decoder, GPTConfig
>>> _ = torch.manual_seed(0)
>>> model = Decoder(GPTConfig()).eval()
>>> trace = arrival_trace(4, prompt_lens=(2, 6), output_lens=(2, 5), max_gap=2, seed=0)
>>> [(r.rid, len(r.prompt), r.output_len, r.arrival) for r in trace]
[(0, 6, 5, 0), (1, 5, 2, 1), (2, 5, 4, 1), (3, 3, 2, 3)]
>>> run = Scheduler(model, num_blocks=8, block_size=4).run(trace)
>>> [len(run.tokens[r.rid]) == r.output_len for r in trace], run.invariants_hold
([True, True, True, True], True)
>>> [s.occupancy for s in run.steps]  # step 1 prefills requests 1 and 2; 0 waits
[1, 2, 3, 1, 3, 2, 1]
>>> from kvdoc import generate
>>> alone = generate(model, torch.tensor([trace[3].prompt]), trace[3].output_len)
>>> alone[0, len(trace[3].prompt):].tolist() == run.tokens[3]
True
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvdoc.core.cache import KV, KVCache
from kvdoc.core.config import check_int
from kvdoc.core.layers import CacheLayer
from kvdoc.core.model import Decoder

from .paged import BlockPool

Policy = Literal["continuous", "static"]


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        rid: its id (its index in the trace). prompt: its token ids.
        output_len: tokens it generates (greedy). arrival: the step from which it may be admitted.
    """

    rid: int
    prompt: tuple[int, ...]
    output_len: int
    arrival: int
    samples: int = 1
    """Sequences it forks into once its prompt is in (parallel sampling), each ``output_len``."""
    seed: int | None = None
    """None: greedy; else sample ``j`` draws from generator seed ``seed + j``."""

    @property
    def final_len(self) -> int:
        """Positions its cache holds when it finishes: the last token is chosen, never fed."""
        return len(self.prompt) + self.output_len - 1

    def blocks_needed(self, block_size: int) -> int:
        """Most blocks it holds at once: the prompt's full blocks once, shared by its samples,
        and every other block of its final length once per sample.

        >>> Request(0, (1,) * 6, 3, 0, samples=4, seed=0).blocks_needed(4)  # 1 + 4 * (2 - 1)
        5
        """
        shared = len(self.prompt) // block_size
        return shared + self.samples * (math.ceil(self.final_len / block_size) - shared)


def sample_generator(request: Request, sample: int = 0) -> torch.Generator | None:
    """The generator sample ``sample`` of ``request`` draws from (None: greedy)."""
    if request.seed is None:
        return None
    return torch.Generator().manual_seed(request.seed + sample)


def choose(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """The next token from ``[V]`` logits: the argmax without a generator; with one, a draw
    from ``softmax(logits)`` by the Gumbel-max trick, ``argmax(logits - log(-log U))`` with
    ``U`` uniform from ``generator`` (float64 on the CPU, so the draw is the same on any device
    and for the same generator state; the logits decide only through their argmax).

    >>> logits = torch.tensor([0.0, 3.0, 1.0])
    >>> choose(logits, None), choose(logits, torch.Generator().manual_seed(0))
    (1, 1)
    """
    if generator is None:
        return int(logits.argmax())
    u = torch.rand(logits.shape[-1], generator=generator, dtype=torch.float64)
    return int((logits.detach().double().cpu() - torch.log(-torch.log(u))).argmax())


def arrival_trace(n: int = 8, prompt_lens: tuple[int, int] = (2, 16),
                  output_lens: tuple[int, int] = (1, 12), max_gap: int = 3,
                  vocab_size: int = 97, seed: int = 0) -> list[Request]:
    """``n`` requests: prompt and output lengths uniform on the inclusive ranges, token ids uniform
    on the vocabulary, the first arriving at step 0 and each next one after a gap uniform on
    ``0 .. max_gap`` steps, all from ``torch.Generator`` seed ``seed``.

    >>> trace = arrival_trace(3, prompt_lens=(1, 2), output_lens=(3, 3), max_gap=0)
    >>> [r.arrival for r in trace], trace == arrival_trace(3, (1, 2), (3, 3), 0)
    ([0, 0, 0], True)
    """
    if (n < 1 or max_gap < 0 or not 1 <= prompt_lens[0] <= prompt_lens[1]
            or not 1 <= output_lens[0] <= output_lens[1]):
        raise ValueError("need n >= 1, max_gap >= 0 and ranges (lo, hi) with 1 <= lo <= hi")
    g = torch.Generator().manual_seed(seed)

    def uniform(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    trace, step = [], 0
    for rid in range(n):
        step += uniform(0, max_gap) if rid else 0
        prompt = torch.randint(0, vocab_size, (uniform(*prompt_lens),), generator=g).tolist()
        trace.append(Request(rid, tuple(prompt), uniform(*output_lens), step))
    return trace


class RaggedLayer(CacheLayer):
    """Layer ``index`` of a :class:`RaggedStep`: the real new rows go into their rows' blocks,
    and a read gathers every row's ``T`` columns (the mask hides what a row does not hold)."""

    in_place = True

    def __init__(self, step: RaggedStep, index: int) -> None:
        cfg, pool = step.pool.config, step.pool
        super().__init__(len(step.past), cfg.n_kv_head, (cfg.head_dim, cfg.head_dim), pool.dtype,
                         pool.device)
        self.step, self.index = step, index

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        self.check_rows(k, v)
        s = self.step
        # the real new rows only: [M, H_kv, D_h] into (block, :, offset) of each row's blocks
        for store, new in ((s.pool.k[self.index], k), (s.pool.v[self.index], v)):
            store[s.blocks, :, s.offsets] = new[s.rows, :, s.cols]
        return self.read(start)

    def read(self, seq_len: int) -> KV:
        s = self.step
        B, n = s.table.shape
        out = []
        for store in (s.pool.k[self.index], s.pool.v[self.index]):
            blocks = store[s.table]  # [B, n, H_kv, S, D_h]
            out.append(blocks.transpose(1, 2).reshape(B, self.heads, n * s.pool.block_size,
                                                      self.widths[0])[:, :, :s.width])
        return out[0], out[1]

    def tensors(self) -> list[torch.Tensor]:
        return [self.step.pool.k[self.index], self.step.pool.v[self.index]]


class RaggedStep(KVCache):
    """The cache one ragged step writes into and reads from: row ``b``'s blocks ``tables[b]``,
    ``past[b]`` positions held, ``new[b]`` new tokens this step (see the module docstring).

    The blocks for the new positions must already be in the tables (the scheduler allocates);
    :attr:`seq_len` is ``T - C``, so the model's mask and new tokens span the ``T`` gathered
    columns.

    >>> from kvdoc.core.config import GPTConfig
    >>> pool = BlockPool(GPTConfig(), num_blocks=3, block_size=4)
    >>> step = RaggedStep(pool, tables=[[0, 1], [2]], past=[5, 0], new=[1, 3])
    >>> step.seq_len, step.positions().tolist()  # T = 6 columns, C = 3 new
    (3, [[5, 0, 0], [0, 1, 2]])
    """

    def __init__(self, pool: BlockPool, tables: Sequence[list[int]], past: Sequence[int],
                 new: Sequence[int]) -> None:
        S = pool.block_size
        self.pool, self.past, self.new = pool, list(past), list(new)
        if not tables or min(self.new) < 1 or min(self.past) < 0:
            raise ValueError("a step needs rows, each with at least one new token")
        self.width = max(p + n for p, n in zip(past, new, strict=True))  # T
        if any(len(t) * S < p + n for t, p, n in zip(tables, past, new, strict=True)):
            raise ValueError("every row needs blocks for its new positions before the step")
        n_blocks = math.ceil(self.width / S)
        # a row shorter than T reads its own first block past its end; the mask hides it
        self.table = torch.tensor([t[:n_blocks] + [t[0]] * (n_blocks - len(t[:n_blocks]))
                                   for t in tables], dtype=torch.long, device=pool.device)
        rows = [(b, j) for b, n in enumerate(new) for j in range(n)]
        slots = torch.tensor([self.past[b] + j for b, j in rows], device=pool.device)
        self.rows = torch.tensor([b for b, _ in rows], device=pool.device)
        self.cols = torch.tensor([j for _, j in rows], device=pool.device)
        self.blocks = self.table[self.rows, slots // S]
        self.offsets = slots % S
        super().__init__([RaggedLayer(self, i) for i in range(pool.config.n_layer)],
                         seq_len=self.width - max(self.new))

    def mask(self) -> torch.Tensor:
        """``[B, C, T]`` bool: a real query at position ``P_b + j`` reads keys ``0 .. P_b + j``
        of its row; a pad query reads key 0 only."""
        C = max(self.new)
        past = torch.tensor(self.past, device=self.device)[:, None, None]
        new = torch.tensor(self.new, device=self.device)[:, None, None]
        j = torch.arange(C, device=self.device)[None, :, None]
        key = torch.arange(self.width, device=self.device)[None, None, :]
        return torch.where(j < new, key <= past + j, key == 0)

    def positions(self) -> torch.Tensor:
        """``[B, C]``: ``P_b + j`` for the real new tokens, 0 for the padding."""
        C = max(self.new)
        past = torch.tensor(self.past, device=self.device)[:, None]
        new = torch.tensor(self.new, device=self.device)[:, None]
        j = torch.arange(C, device=self.device)[None, :]
        return torch.where(j < new, past + j, 0)


@dataclass(eq=False)  # compared by identity: the scheduler finds it in its lists
class LiveRequest:
    """One sequence the scheduler holds (a request, or one sample of it): its blocks, positions
    written, and what it produced."""

    req: Request
    sample: int = 0
    generator: torch.Generator | None = None
    table: list[int] = field(default_factory=list)
    fed: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # the step of each token
    preemptions: int = 0
    forks_pending: bool = False

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.req.output_len

    @property
    def seq(self) -> list[int]:
        """Its prompt and the tokens chosen so far: what a recompute prefills."""
        return [*self.req.prompt, *self.tokens]

    @property
    def decoding(self) -> bool:
        """Every position but its last token's is written: it feeds that one token next."""
        return bool(self.tokens) and self.fed == len(self.req.prompt) + len(self.tokens) - 1

    def next_ids(self, budget: int | None) -> list[int]:
        """What it feeds next: (a chunk of) what it has not written yet, which is its last token
        when decoding, its prompt (and, after a preemption, its tokens) otherwise."""
        seq = self.seq
        end = len(seq) if budget is None else min(len(seq), self.fed + budget)
        return seq[self.fed:end]


@dataclass(frozen=True)
class StepRecord:
    """One step of a run.

    Attributes:
        step: its index. rows: ``(rid, new tokens, kind)`` per row of the forward, kind
            ``"prefill"``, ``"recompute"`` (a preempted request prefilling again) or
            ``"decode"``.
        waiting: rids arrived but not admitted. holding: rids admitted, not in this forward.
        blocks_held: ``pool.num_used`` after the step (finished requests retired).
        blocks_named: distinct blocks the live requests' tables name. blocks_free: the free list.
        lengths_ok: every live request's table covers exactly its written positions, and one
            that has tokens and was never preempted has written prompt + tokens - 1 of them.
        refs_ok: every block's reference count is the number of live tables naming it.
        preempted: ``(rid, positions discarded)`` per request preempted in this step.
    """

    step: int
    rows: tuple[tuple[int, int, str], ...]
    waiting: tuple[int, ...]
    holding: tuple[int, ...]
    blocks_held: int
    blocks_named: int
    blocks_free: int
    lengths_ok: bool
    refs_ok: bool = True
    preempted: tuple[tuple[int, int], ...] = ()

    @property
    def occupancy(self) -> int:
        """Rows in this step's forward."""
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """New tokens this step's forward processed."""
        return sum(n for _, n, _ in self.rows)


@dataclass(frozen=True)
class ServeRun:
    """What :meth:`Scheduler.run` returns.

    Attributes:
        policy, token_budget: how it was scheduled. num_blocks, block_nbytes: the pool.
        tokens: rid -> its tokens (its first sample's). logits: rid -> ``[output_len, V]``,
            behind each token. emitted: rid -> the step each token came out.
        steps: one :class:`StepRecord` per step.
        samples, sample_logits: ``(rid, sample)`` -> tokens and logits, every sample of every
            request.
    """

    policy: str
    token_budget: int | None
    num_blocks: int
    block_nbytes: int
    tokens: dict[int, list[int]]
    logits: dict[int, torch.Tensor]
    emitted: dict[int, list[int]]
    steps: list[StepRecord]
    samples: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    sample_logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def invariants_hold(self) -> bool:
        """At every step: blocks held == blocks the tables name, free + held == the pool,
        reference counts == holders (:attr:`StepRecord.refs_ok`), every request's cache length
        is its tokens so far (:attr:`StepRecord.lengths_ok`); at the end every block free."""
        return all(s.blocks_held == s.blocks_named and s.blocks_free + s.blocks_held
                   == self.num_blocks and s.lengths_ok and s.refs_ok for s in self.steps
                   ) and self.steps[-1].blocks_free == self.num_blocks

    @property
    def preemptions(self) -> int:
        """Requests preempted over the run (one request may be preempted more than once)."""
        return sum(len(s.preempted) for s in self.steps)

    @property
    def recomputed(self) -> int:
        """Positions whose K/V a preemption discarded and a later prefill computed again."""
        return sum(n for s in self.steps for _, n in s.preempted)

    @property
    def blocks_peak(self) -> int:
        """Most blocks held after any step."""
        return max(s.blocks_held for s in self.steps)

    def decode_gaps(self) -> list[int]:
        """Steps between consecutive tokens of one request, over every request."""
        return [b - a for e in self.emitted.values() for a, b in zip(e, e[1:], strict=False)]

    def memory_bytes(self) -> list[int]:
        """Cache memory held after each step: blocks held * bytes per block."""
        return [s.blocks_held * self.block_nbytes for s in self.steps]

    def composition(self, trace: Sequence[Request]) -> torch.Tensor:
        """``[requests, steps]`` int: 0 not arrived or gone, 1 waiting, 2 holding blocks outside
        the forward, 3 prefill, 4 decode, 5 recompute (the batch's composition over time)."""
        grid = torch.zeros(len(trace), len(self.steps), dtype=torch.long)
        for s in self.steps:
            grid[list(s.waiting), s.step] = 1
            grid[list(s.holding), s.step] = 2
            for rid, _, kind in s.rows:
                grid[rid, s.step] = {"prefill": 3, "decode": 4, "recompute": 5}[kind]
        return grid


class Scheduler:
    """Runs a trace of :class:`Request` s on ``model`` over one :class:`BlockPool`, one forward a
    step; see the module docstring for the policies.

    Args:
        model: a decoder with learned positions (GPT-2 style).
        num_blocks, block_size: the pool.
        max_batch: most sequences admitted at once (default: as many as the blocks allow; a
            request's forks join it regardless).
        token_budget: new tokens per step (continuous only): chunked prefill.
        policy: ``"continuous"`` or ``"static"``.
        preempt: admit on what the next step writes and preempt by recompute when blocks run
            out (continuous only), instead of admitting only what fits to the end.
    """

    def __init__(self, model: Decoder, num_blocks: int, block_size: int = 4,
                 max_batch: int | None = None, token_budget: int | None = None,
                 policy: Policy = "continuous", preempt: bool = False) -> None:
        if model.wpe is None:
            raise ValueError("a ragged step needs per-row positions; this model uses RoPE, "
                             "which kvdoc.core.rope.apply_rope turns from one start per batch")
        if policy not in ("continuous", "static"):
            raise ValueError(f"unknown policy {policy!r}; use 'continuous' or 'static'")
        if token_budget is not None:
            check_int("token_budget", token_budget)
            if policy == "static":
                raise ValueError("a token budget needs policy='continuous'")
        if preempt and policy == "static":
            raise ValueError("preemption needs policy='continuous'")
        if max_batch is not None:
            check_int("max_batch", max_batch)
        weight = model.wte.weight
        self.model, self.config = model, model.config
        self.pool = BlockPool(model.config, num_blocks, block_size, weight.dtype, weight.device)
        self.max_batch, self.token_budget, self.policy = max_batch, token_budget, policy
        self.preempt_on = preempt

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.pool.block_size)

    def retire(self, live: LiveRequest) -> None:
        """Give a finished request's blocks back and forget its table."""
        self.pool.release(live.table)
        live.table.clear()

    def preempt(self, live: LiveRequest) -> int:
        """Preemption by recompute: give every block back and forget every written position (its
        tokens stay); returns the positions discarded."""
        discarded = live.fed
        self.pool.release(live.table)
        live.table.clear()
        live.fed = 0
        live.preemptions += 1
        return discarded

    def blocks_to_write(self, live: LiveRequest, end: int) -> int:
        """Blocks to copy or allocate before ``live`` writes positions ``fed .. end - 1``."""
        first, last = live.fed // self.pool.block_size, self.blocks_for(end)
        shared = sum(self.pool.refs(b) > 1 for b in live.table[first:last])
        return max(0, last - len(live.table)) + shared

    def reserve(self, live: LiveRequest, end: int) -> bool:
        """Own every block positions ``fed .. end - 1`` of ``live`` fall in: a block it shares is
        copied first (copy-on-write), missing ones are allocated. False, changing nothing, when
        the pool has too few free blocks."""
        if self.blocks_to_write(live, end) > self.pool.num_free:
            return False
        first, last = live.fed // self.pool.block_size, self.blocks_for(end)
        for n in range(first, min(last, len(live.table))):
            if self.pool.refs(live.table[n]) > 1:
                live.table[n] = self.pool.copy(live.table[n])
        live.table.extend(self.pool.allocate(max(0, last - len(live.table))))
        return True

    def positions(self, view: RaggedStep) -> torch.Tensor:
        return view.positions()

    def _check(self, trace: Sequence[Request]) -> None:
        for r in trace:
            if r.final_len > self.config.n_positions:
                raise ValueError(f"request {r.rid} needs {r.final_len} positions, the model has "
                                 f"{self.config.n_positions}")
            if not r.prompt or r.output_len < 1:
                raise ValueError(f"request {r.rid} needs a prompt and at least one output token")
            check_int("samples", r.samples)
            if r.samples > 1 and r.seed is None:
                raise ValueError(f"request {r.rid} forks {r.samples} samples; they need a seed "
                                 "(greedy samples would all be the same)")
            need = r.blocks_needed(self.pool.block_size)
            if need > self.pool.num_blocks:
                raise ValueError(f"request {r.rid} needs {need} blocks, "
                                 f"the pool has {self.pool.num_blocks}")

    def _admit(self, waiting: list[LiveRequest], live: list[LiveRequest], step: int) -> None:
        """Admit arrived requests in order while the blocks not yet promised cover them."""
        if self.policy == "static" and live:
            return
        S = self.pool.block_size
        if self.preempt_on:  # what the running requests write next
            promised = sum(self.blocks_to_write(x, len(x.seq)) for x in live)
        else:  # what they hold at most, to the end, less what they hold now
            held: dict[int, set[int]] = {}
            for x in live:
                held.setdefault(x.req.rid, set()).update(x.table)
            reqs = {x.req.rid: x.req for x in live}
            promised = sum(r.blocks_needed(S) - len(held[rid]) for rid, r in reqs.items())
        while waiting and waiting[0].req.arrival <= step:
            x = waiting[0]
            need = (self.blocks_for(len(x.seq)) if self.preempt_on
                    else x.req.blocks_needed(S))
            full = self.max_batch is not None and len(live) >= self.max_batch
            if full or need > self.pool.num_free - promised:
                return
            live.append(waiting.pop(0))
            promised += need

    def _compose(self, live: list[LiveRequest]) -> list[tuple[LiveRequest, list[int]]]:
        """Which requests feed what this step."""
        prefilling = [x for x in live if not x.decoding]
        decoding = [x for x in live if x.decoding and not x.done]
        if self.token_budget is None:
            # prefill first (static batching's first step is all prefill too)
            return [(x, x.next_ids(None)) for x in (prefilling or decoding)]
        budget, rows = self.token_budget, []
        for x in decoding + prefilling:  # stall-free: decodes first, then prefill chunks
            if budget == 0:
                break
            rows.append((x, x.next_ids(budget)))
            budget -= len(rows[-1][1])
        return rows

    def _make_room(self, rows: list[tuple[LiveRequest, list[int]]], live: list[LiveRequest],
                   waiting: list[LiveRequest]) -> list[tuple[int, int]]:
        """Reserve every row's blocks, oldest admitted first; while one cannot get them, preempt
        the most recently admitted sequence (vLLM's policy), which may be that row itself. A
        preempted row leaves ``rows``; returns ``(rid, positions discarded)`` per preemption."""
        preempted = []
        for x, ids in sorted(rows, key=lambda row: live.index(row[0])):
            while x in live and not self.reserve(x, x.fed + len(ids)):
                victim = live.pop()
                preempted.append((victim.req.rid, self.preempt(victim)))
                waiting.insert(0, victim)  # first in line, as vLLM puts it back
        rows[:] = [(x, ids) for x, ids in rows if x in live]
        return preempted

    @torch.no_grad()
    def _forward(self, rows: list[tuple[LiveRequest, list[int]]], live: list[LiveRequest],
                 step: int) -> None:
        view = RaggedStep(self.pool, [x.table for x, _ in rows], [x.fed for x, _ in rows],
                          [len(ids) for _, ids in rows])
        C, device = max(view.new), self.model.wte.weight.device
        idx = torch.tensor([ids + [0] * (C - len(ids)) for _, ids in rows], device=device)
        logits = self.model(idx, view, positions=self.positions(view),
                            attn_mask=view.mask()).logits  # [B, C, V]
        for b, (x, ids) in enumerate(rows):
            x.fed += len(ids)
            if x.fed < len(x.seq):
                continue  # a chunk: more to prefill before this row chooses a token
            row = logits[b, len(ids) - 1]
            x.logits.append(row)
            x.tokens.append(choose(row, x.generator))
            x.emitted.append(step)
            if x.forks_pending:  # the prompt is in: fork its samples off its blocks
                x.forks_pending = False
                forks = [LiveRequest(x.req, j, g, list(x.table), x.fed, [choose(row, g)], [row],
                                     [step]) for j in range(1, x.req.samples)
                         for g in [sample_generator(x.req, j)]]
                for y in forks:
                    self.pool.share(y.table)
                at = live.index(x) + 1
                live[at:at] = forks

    def _lengths_ok(self, live: list[LiveRequest]) -> bool:
        return all(len(x.table) == self.blocks_for(x.fed) and x.fed < len(x.seq)
                   and (x.decoding or not x.tokens or x.preemptions > 0) for x in live)

    def _refs_ok(self, live: list[LiveRequest]) -> bool:
        holders = Counter(b for x in live for b in x.table)
        return all(self.pool.refs(b) == holders[b] for b in range(self.pool.num_blocks))

    def run(self, trace: Sequence[Request]) -> ServeRun:
        """Serve ``trace`` until every request has its tokens; returns what each produced and a
        record of every step."""
        self._check(trace)
        waiting = [LiveRequest(r, 0, sample_generator(r, 0), forks_pending=r.samples > 1)
                   for r in sorted(trace, key=lambda r: (r.arrival, r.rid))]
        live: list[LiveRequest] = []
        done: dict[tuple[int, int], LiveRequest] = {}
        steps: list[StepRecord] = []
        while waiting or live:
            step = len(steps)
            self._admit(waiting, live, step)
            if not live and waiting and waiting[0].req.arrival <= step:  # nothing frees blocks
                raise ValueError(f"request {waiting[0].req.rid} cannot be admitted: "
                                 f"{self.pool.num_free} blocks free of {self.pool.num_blocks}")
            rows = self._compose(live) if live else []
            preempted = self._make_room(rows, live, waiting)
            kinds = tuple((x.req.rid, len(ids), "decode" if x.decoding else
                           "recompute" if x.preemptions else "prefill") for x, ids in rows)
            if rows:
                self._forward(rows, live, step)
            in_step = {id(x) for x, _ in rows}
            holding = tuple(x.req.rid for x in live if id(x) not in in_step)
            finished = [x for x in live if x.done]
            if self.policy == "continuous" or len(finished) == len(live):
                for x in finished:
                    done[x.req.rid, x.sample] = x
                    self.retire(x)
                live = [x for x in live if not x.done]
            named = {b for x in live for b in x.table}
            steps.append(StepRecord(
                step, kinds, tuple(x.req.rid for x in waiting if x.req.arrival <= step),
                holding, self.pool.num_used, len(named), self.pool.num_free,
                self._lengths_ok(live), self._refs_ok(live), tuple(preempted)))
        first = {rid: x for (rid, j), x in sorted(done.items()) if j == 0}
        return ServeRun(self.policy, self.token_budget, self.pool.num_blocks,
                        self.pool.block_nbytes, {r: x.tokens for r, x in first.items()},
                        {r: torch.stack(x.logits) for r, x in first.items()},
                        {r: x.emitted for r, x in first.items()}, steps,
                        {k: x.tokens for k, x in sorted(done.items())},
                        {k: torch.stack(x.logits) for k, x in sorted(done.items())})


def serve(model: Decoder, trace: Sequence[Request], num_blocks: int, block_size: int = 4,
          **options) -> ServeRun:
    """``Scheduler(model, num_blocks, block_size, **options).run(trace)``.

    >>> from kvdoc import Decoder, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> trace = arrival_trace(3, prompt_lens=(5, 5), output_lens=(2, 2), max_gap=0)
    >>> run = serve(Decoder(GPTConfig()).eval(), trace, num_blocks=6, token_budget=4)
    >>> [s.rows for s in run.steps][:2]  # 15 prompt tokens, 4 a step
    [((0, 4, 'prefill'),), ((0, 1, 'prefill'), (1, 3, 'prefill'))]
    """
    return Scheduler(model, num_blocks, block_size, **options).run(trace)
