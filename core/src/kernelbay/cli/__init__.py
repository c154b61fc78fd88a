"""The ``kernelbay`` command: ``plugins``, ``doctor``, ``explain``, ``run``, ``quantize``.

Each subcommand imports what it needs when it runs, so ``kernelbay plugins`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kernelbay._version import PLUGIN_API_VERSION, __version__
from kernelbay.errors import KernelbayError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernelbay",
        description="Pick and explain LLM inference backends from installed plugins.")
    parser.add_argument("--version", action="version",
                        version=f"kernelbay {__version__} (plugin API {PLUGIN_API_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed plugins and what each offers")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show tracebacks of plugins that failed to load")

    p = sub.add_parser("doctor", help="device facts and what each plugin can do here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--device", help="describe a device instead of probing (sm_90, cpu+amx)")

    p = sub.add_parser("run", help="generate with the chosen backends, streaming the text")
    p.add_argument("model", nargs="?",
                   help="path of a local checkpoint folder (default: the bundled demo model)")
    p.add_argument("--prompt", help="prompt text (default for the demo: a Python function)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens to generate")
    p.add_argument("--temperature", type=float, help="0 is greedy (default: 0, demo 0.7)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, help="nucleus mass to keep (default 1, demo 0.95)")
    p.add_argument("--quantize", metavar="FORMAT",
                   help="quantize the model first (cached) with a plugin's writer, e.g. "
                        "modelopt-nvfp4, quark-mxfp4, fp8")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun)")
    p.add_argument("--device", help="torch device to run on (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="activation dtype (default: the checkpoint's)")
    p.add_argument("--kv-cache", default="auto", help="KV-cache record kind (default auto)")
    p.add_argument("--speculative", metavar="METHOD",
                   help="speculative decoding with this proposer (e.g. ngram)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="tokens drafted per step (default 4)")

    p = sub.add_parser("quantize", help="write a checkpoint in a producer's exact format")
    p.add_argument("source", nargs="?", help="an unquantized checkpoint folder")
    p.add_argument("destination", nargs="?", help="the folder to create")
    p.add_argument("--format", dest="output_format",
                   help="output format, e.g. modelopt-nvfp4 (kernelbay quantize --list)")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument("--list", action="store_true", dest="list_formats",
                   help="print the output formats the installed plugins write, then exit")
    # source, destination and --format are required unless --list: checked in main
    p.set_defaults(quantize_parser=p)

    p = sub.add_parser("explain", help="the per-layer plan of a checkpoint with every verdict")
    p.add_argument("model", help="path of a local checkpoint folder")
    p.add_argument("--device", help="plan for this device (sm_100, sm_90, gfx950, cpu+amx)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--kv-cache", default="auto", help="KV-cache record kind (default auto)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print every candidate's verdict for every layer group")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kernelbay`` console script."""
    args = _parser().parse_args(argv)
    # explain and doctor print every verdict; the one-line fallback warning would repeat it.
    if args.command in ("explain", "doctor"):
        logging.getLogger("kernelbay.select").setLevel(logging.ERROR)
    try:
        from kernelbay.policy import Policy

        policy = Policy.from_env()
        if getattr(args, "device", None) and args.command != "run":
            policy = policy.updated(device=args.device)
        if args.command == "plugins":
            from kernelbay.cli.plugins_cmd import run_plugins

            return run_plugins(policy, as_json=args.json, verbose=args.verbose)
        if args.command == "doctor":
            from kernelbay.cli.doctor import run_doctor

            return run_doctor(policy, as_json=args.json)
        if args.command == "run":
            from kernelbay.cli.run import run_generate

            return run_generate(policy, args.model, prompt=args.prompt,
                                max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                tp_size=args.tp, device=args.device, dtype=args.dtype,
                                kv_cache=args.kv_cache, quantize=args.quantize,
                                speculative=args.speculative,
                                num_speculative_tokens=args.num_speculative_tokens)
        if args.command == "quantize":
            from kernelbay.cli.quantize_cmd import run_quantize, run_quantize_list

            if args.list_formats:
                return run_quantize_list(policy)
            missing = [name for name, value in (("source", args.source),
                                                ("destination", args.destination),
                                                ("--format", args.output_format)) if not value]
            if missing:  # exits 2 with the usage, as argparse does for its own checks
                args.quantize_parser.error("the following arguments are required: "
                                           f"{', '.join(missing)} (or --list)")
            return run_quantize(policy, args.source, args.destination, args.output_format,
                                force=args.force)
        if args.command == "explain":
            from kernelbay.cli.explain import run_explain

            if args.tp < 1:
                raise KernelbayError(f"--tp must be >= 1, got {args.tp}")
            return run_explain(policy, args.model, tp_size=args.tp, kv_cache=args.kv_cache,
                               as_json=args.json, verbose=args.verbose)
    except KernelbayError as exc:
        print(f"kernelbay: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into a pager or head that exited: not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 2
