"""Continuous batching and chunked prefill over a paged cache, against static batching.

A :class:`Scheduler` recomposes the batch at every step: it admits arrived requests while the
pool has blocks for them, runs one forward for every row, then retires the finished ones: Orca's
iteration-level scheduling (Yu et al., 2022) over vLLM's block tables (Kwon et al., 2023).
Three policies on one loop:

* ``"static"``: a batch runs until its longest request finishes (finished rows keep their
  blocks, as a padded batch's do), then the next;
* ``"continuous"``: prefill first, as vLLM did before chunked prefill: a step with newly
  admitted requests runs their whole prompts and nothing else;
* ``"continuous"`` with ``token_budget=N``: stall-free chunked prefill (Sarathi-Serve, vLLM's
  ``max_num_batched_tokens``): each decoding request's token first, then prefill chunks.

A step's rows run as one ragged forward (:class:`~kvdoc.serving.batching.RaggedStep`); a hybrid
model's rows a forward each, as a recurrent state would fold a padded row's padding in, each
sequence carrying its states from step to step.

**Admission and preemption** (stated exactly in :mod:`kvdoc.teach.schedule_spec`): by default a
request is admitted only if the free blocks, less what the running requests still need, cover
its whole final length, so none is ever preempted. With ``preempt=True``, when they cover what
it and the running requests write next, as vLLM admits; a row that then cannot get a block
preempts the most recently admitted request by recompute.

**Forks**: a request with ``samples=n`` (and a ``seed``) prefills its prompt once, then forks
into ``n`` sequences sharing its blocks (copy-on-write), each drawing with its own generator.

>>> from kvdoc import Decoder, GPTConfig
>>> from kvdoc.serving.requests import arrival_trace
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

from kvdoc.core.cache import check_int
from kvdoc.core.model import Decoder
from kvdoc.core.state import StateSpec, read_state, state_layers

from .batching import RaggedStep
from .paged import BlockPool
from .requests import Request, ServeRun, StepRecord, choose, sample_generator

Policy = Literal["continuous", "static"]


@dataclass(eq=False)  # compared by identity: the scheduler finds it in its lists
class LiveRequest:
    """One sequence the scheduler holds (a request or a sample): blocks, positions, output."""

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
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # a hybrid's

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
        """What it feeds next: (a chunk of) what it has not written yet."""
        seq = self.seq
        end = len(seq) if budget is None else min(len(seq), self.fed + budget)
        return seq[self.fed:end]


class Scheduler:
    """Runs a trace of :class:`~kvdoc.serving.requests.Request` s on ``model`` over one block
    pool, by the module docstring's policies; ``max_batch``: most sequences admitted at once."""

    def __init__(self, model: Decoder, num_blocks: int, block_size: int = 4,
                 max_batch: int | None = None, token_budget: int | None = None,
                 policy: Policy = "continuous", preempt: bool = False) -> None:
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
        self.stateful = any(isinstance(spec, StateSpec) for spec in model.config.cache_layout)
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
        """Preempt by recompute: free its blocks, forget its positions (returned); tokens stay."""
        discarded = live.fed
        self.retire(live)
        live.fed, live.states = 0, {}
        live.preemptions += 1
        return discarded

    def reserve(self, live: LiveRequest, end: int) -> bool:
        """Own every block ``live``'s next positions fall in; False, changing nothing, if short."""
        if self.pool.to_write(live.table, live.fed, end) > self.pool.num_free:
            return False
        self.pool.own(live.table, live.fed, end)
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
            promised = sum(self.pool.to_write(x.table, x.fed, len(x.seq)) for x in live)
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

    def compose(self, live: list[LiveRequest]) -> list[tuple[LiveRequest, list[int]]]:
        """Which requests feed what this step (``live`` in order of admission)."""
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

    def victim(self, live: list[LiveRequest]) -> LiveRequest:
        """Preemption's victim: the most recently admitted, as vLLM's FCFS policy takes."""
        return live[-1]

    def _make_room(self, rows: list[tuple[LiveRequest, list[int]]], live: list[LiveRequest],
                   waiting: list[LiveRequest]) -> list[tuple[int, int]]:
        """Reserve every row's blocks, oldest admitted first, preempting the :meth:`victim` while
        one cannot get them (a preempted row leaves ``rows``); ``(rid, discarded)`` for each."""
        preempted = []
        for x, ids in sorted(rows, key=lambda row: live.index(row[0])):
            while x in live and not self.reserve(x, x.fed + len(ids)):
                victim = self.victim(live)
                live.remove(victim)
                preempted.append((victim.req.rid, self.preempt(victim)))
                waiting.insert(0, victim)  # first in line, as vLLM puts it back
        rows[:] = [(x, ids) for x, ids in rows if x in live]
        return preempted

    @torch.no_grad()
    def _forward(self, rows: list[tuple[LiveRequest, list[int]]], live: list[LiveRequest],
                 step: int) -> None:
        logits = self._logits(rows)
        for b, (x, ids) in enumerate(rows):
            x.fed += len(ids)
            if x.fed < len(x.seq):
                continue  # a chunk: more to prefill before this row chooses a token
            row = logits[b][len(ids) - 1]
            x.logits.append(row)
            x.tokens.append(choose(row, x.generator))
            x.emitted.append(step)
            if x.forks_pending:  # the prompt is in: fork its samples off its blocks
                x.forks_pending = False
                forks = [LiveRequest(x.req, j, g, list(x.table), x.fed, [choose(row, g)], [row],
                                     [step], states=x.states)  # a call replaces, never edits
                         for j in range(1, x.req.samples) for g in [sample_generator(x.req, j)]]
                for y in forks:
                    self.pool.share(y.table)
                at = live.index(x) + 1
                live[at:at] = forks

    def _logits(self, rows: list[tuple[LiveRequest, list[int]]]) -> list[torch.Tensor]:
        """Each row's logits ``[n_b, V]``: one ragged forward over every row, or a forward a
        row for a hybrid model (whose rows' new states are kept once every row has run)."""
        device = self.model.wte.weight.device
        if not self.stateful:
            view = RaggedStep(self.pool, [x.table for x, _ in rows], [x.fed for x, _ in rows],
                              [len(ids) for _, ids in rows])
            C = max(view.new)
            idx = torch.tensor([ids + [0] * (C - len(ids)) for _, ids in rows], device=device)
            logits = self.model(idx, view.cache, positions=self.positions(view),
                                attn_mask=view.mask()).logits  # [B, C, V]
            return [logits[b, :len(ids)] for b, (_, ids) in enumerate(rows)]
        out, states = [], []
        for x, ids in rows:
            view = RaggedStep(self.pool, [x.table], [x.fed], [len(ids)])  # one row: no padding
            for i, state in x.states.items():
                view.cache.layers[i].replace(**state)
            run = self.model(torch.tensor([ids], device=device), view.cache)
            out.append(run.logits[0])
            states.append({i: read_state(run.cache, i) for i in state_layers(run.cache)})
        for (x, _), new in zip(rows, states, strict=True):
            x.states = new
        return out

    def _lengths_ok(self, live: list[LiveRequest]) -> bool:
        return all(len(x.table) == self.blocks_for(x.fed) and x.fed < len(x.seq)
                   and (x.decoding or not x.tokens or x.preemptions > 0) for x in live)

    def _refs_ok(self, live: list[LiveRequest]) -> bool:
        holders = Counter(b for x in live for b in x.table)
        return all(self.pool.refs(b) == holders[b] for b in range(self.pool.num_blocks))

    def run(self, trace: Sequence[Request]) -> ServeRun:
        """Serve ``trace`` until every request has its tokens, recording every step."""
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
            rows = self.compose(live) if live else []
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
    """``Scheduler(model, num_blocks, block_size, **options).run(trace)``."""
    return Scheduler(model, num_blocks, block_size, **options).run(trace)
