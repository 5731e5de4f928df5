"""Tensor- and context-parallel decoding on N processes, checked against one process.

``python -m kvdoc parallel --tp N --cp M`` starts ``N x M`` ranks (gloo, this machine), decodes
each model of :data:`kvdoc.parallel.checks.MODELS` on them and prints what it compared
(:func:`kvdoc.parallel.checks.compare`): tokens, logits, each rank's cache and its bytes, the
collectives of a decode step. Exit status 0 when every check holds, 1 when one fails, 2 for
arguments it refuses (a ``tp`` that does not divide a model's heads, too many ranks, ...).
"""

from __future__ import annotations

import argparse
import sys

MAX_RANKS = 16
"""The most processes one run starts: each is a whole Python with torch on this machine."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m kvdoc parallel``."""
    parser.add_argument("--tp", type=_positive, default=2, metavar="N",
                        help="tensor-parallel ranks: heads and MLP columns split N ways "
                             "(default 2)")
    parser.add_argument("--cp", type=_positive, default=1, metavar="M",
                        help="context-parallel ranks: positions split M ways (default 1)")
    parser.add_argument("--models", default="gpt2,llama,mqa,mistral", metavar="NAMES",
                        help="comma-separated models to check (default: all of "
                             "gpt2, llama, mqa, mistral)")
    parser.add_argument("--prompt-len", type=_positive, default=7, metavar="P",
                        help="prompt tokens (default 7)")
    parser.add_argument("--new-tokens", type=_positive, default=6, metavar="N",
                        help="tokens to generate (default 6)")


def _error(message: str) -> int:
    print(f"python -m kvdoc parallel: error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Run the checks; 0 if all hold, 1 if one fails, 2 for refused arguments."""
    import torch

    from .checks import MODELS, Job, build_model, run_jobs
    from .decode import check_run

    ranks = args.tp * args.cp
    if ranks > MAX_RANKS:
        return _error(f"--tp {args.tp} x --cp {args.cp} = {ranks} processes; "
                      f"at most {MAX_RANKS} on one machine")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        return _error(f"unknown model(s) {unknown or names}; known: {', '.join(MODELS)}")
    jobs = []
    for name in names:
        model = build_model(name)
        prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt_len),
                               generator=torch.Generator().manual_seed(0))
        try:
            check_run(model, prompt, args.new_tokens, args.tp, args.cp)
        except ValueError as err:
            return _error(f"{name}: {err}")
        jobs.append(Job(name, model, prompt, args.new_tokens, args.tp, args.cp))
    print(f"{ranks} rank(s) on torch.distributed (gloo): tp={args.tp} x cp={args.cp}; "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new; compared with one process")
    results = run_jobs(jobs)
    for result in results:
        print("\n".join(result.lines()))
    failed = [r.name for r in results if not r.ok]
    print("all checks hold" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0
