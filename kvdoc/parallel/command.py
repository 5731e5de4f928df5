"""Tensor- and context-parallel decoding on N processes, checked against one process.

``python -m kvdoc parallel --tp N --cp M`` runs ``N x M`` ranks (gloo, this machine) and prints
what :func:`kvdoc.parallel.comparison.compare` compared; ``--handover`` adds the block hand-over
(:mod:`kvdoc.parallel.blocks`), ``--latent`` the MLA latent (:mod:`kvdoc.parallel.latent`). Exit
status 0 when every check holds, 1 when one fails, 2 for arguments it refuses.
"""

from __future__ import annotations

import argparse
import sys

from kvdoc.measure.memory import positive_arg

MAX_RANKS = 16
"""The most processes one run starts: each is a whole Python with torch on this machine."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc parallel``."""
    parser.add_argument("--tp", type=positive_arg, default=2, metavar="N",
                        help="tensor-parallel ranks: heads and MLP columns split N ways "
                             "(default 2)")
    parser.add_argument("--cp", type=positive_arg, default=1, metavar="M",
                        help="context-parallel ranks: positions split M ways (default 1)")
    parser.add_argument("--models", default="gpt2,llama,mqa,mistral,qwen2", metavar="NAMES",
                        help="comma-separated models to check (default: all of "
                             "gpt2, llama, mqa, mistral, qwen2)")
    parser.add_argument("--prompt-len", type=positive_arg, default=7, metavar="P",
                        help="prompt tokens (default 7)")
    parser.add_argument("--new-tokens", type=positive_arg, default=6, metavar="N",
                        help="tokens to generate (default 6)")
    parser.add_argument("--handover", choices=("push", "pull"), default=None,
                        help="also hand each prompt's K/V from a prefill at TP = --tp to one "
                             "more rank that decodes: 'push' (the prefill ranks send every "
                             "block) or 'pull' (the decode rank asks for the blocks it lacks)")
    parser.add_argument("--block-size", type=positive_arg, default=4, metavar="S",
                        help="positions per block of the hand-over (default 4)")
    parser.add_argument("--have", type=int, default=0, metavar="K",
                        help="with --handover pull: leading blocks the decode rank already "
                             "holds and does not pull (default 0)")
    parser.add_argument("--latent", action="store_true",
                        help="also run the site's MLA model on --tp ranks with its latent "
                             "replicated under TP and split by requests (DP-attention), "
                             "a batch of --tp requests (needs --cp 1)")


def _error(message: str) -> int:
    print(f"python -m kvdoc parallel: error: {message}", file=sys.stderr)
    return 2


def _latent_jobs(args: argparse.Namespace) -> list:
    """The MLA latent under TP and under DP-attention on ``--tp`` ranks, one request each."""
    import torch

    from .latent import MODES, LatentJob, check_latent_job, latent_model

    model = latent_model()
    prompts = torch.randint(1, model.config.vocab_size, (args.tp, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    jobs = [LatentJob(mode, model, prompts, args.new_tokens, mode) for mode in MODES]
    for job in jobs:
        check_latent_job(job, args.tp)
    return jobs


def main(args: argparse.Namespace) -> int:
    """Run the checks; 0 if all hold, 1 if one fails, 2 for refused arguments."""
    import torch

    from .blocks import Handover, check_handover, handover_jobs
    from .comparison import MODELS, Job, build_model, run_jobs
    from .decode import check_run
    from .latent import latent_jobs
    from .launch import choose_backend

    ranks = args.tp * args.cp
    if ranks > MAX_RANKS:
        return _error(f"--tp {args.tp} x --cp {args.cp} = {ranks} processes; "
                      f"at most {MAX_RANKS} on one machine")
    if args.handover and args.tp + 1 > MAX_RANKS:
        return _error(f"--handover needs --tp {args.tp} + 1 processes; at most {MAX_RANKS}")
    if args.latent and args.cp != 1:
        return _error("--latent runs on --tp ranks alone: use --cp 1")
    if args.have and args.handover != "pull":
        return _error("--have needs --handover pull: a pushing prefill sends every block")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        return _error(f"unknown model(s) {unknown or names}; known: {', '.join(MODELS)}")
    jobs, handed, where = [], [], "--latent"
    try:  # every job checked here, before any rank starts
        latent = _latent_jobs(args) if args.latent else []
        for name in names:
            model, where = build_model(name), name
            total = args.prompt_len + args.new_tokens
            if total > model.config.n_positions:  # before the prompt tensor is allocated
                raise ValueError(f"--prompt-len {args.prompt_len} + --new-tokens "
                                 f"{args.new_tokens} = {total} positions; the model has "
                                 f"{model.config.n_positions}")
            prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt_len),
                                   generator=torch.Generator().manual_seed(0))
            check_run(model, prompt, args.new_tokens, args.tp, args.cp)
            jobs.append(Job(name, model, prompt, args.new_tokens, args.tp, args.cp))
            for mode in ("logits", "recompute") if args.handover else ():
                where = f"{name}, hand-over ({mode})"
                check_handover(model, prompt, args.new_tokens, args.tp, args.block_size, mode,
                               args.handover, args.have)
                handed.append(Handover(name, model, prompt, args.new_tokens, args.block_size,
                                       mode, transfer=args.handover, have=args.have))
    except ValueError as err:
        return _error(f"{where}: {err}")
    # the tensors live on the CPU, which gloo carries and NCCL does not
    print(f"{ranks} rank(s) on torch.distributed ({choose_backend(ranks, 'gloo')}): "
          f"tp={args.tp} x cp={args.cp}; prompt {args.prompt_len} tokens, {args.new_tokens} "
          "new; compared with one process")
    results = run_jobs(jobs)
    for result in results:
        print("\n".join(result.lines()))
    if handed:
        print(f"hand-over ({args.handover}) from {args.tp} prefill rank(s) to 1 decode rank, "
              f"blocks of {args.block_size}, {args.tp + 1} processes (gloo):")
    handovers = handover_jobs(handed, tp=args.tp) if handed else []
    for check in handovers:
        print("\n".join(check.lines()))
    latents = latent_jobs(latent, ranks=args.tp) if latent else []
    for check in latents:
        print("\n".join(check.lines()))
    failed = [r.name for r in results if not r.ok] + [
        f"{c.name} hand-over ({c.mode})" for c in handovers if not c.ok] + [
        f"latent {c.mode}" for c in latents if not c.ok]
    print("all checks hold" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0
