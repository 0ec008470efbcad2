"""The `autopar-lab` command line. Every command takes `--json` and then prints one JSON object on stdout.

Bad input exits with status 2 and one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence


class UsageError(Exception):
    """Bad input from the command line: printed as one sentence, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage block; one sentence is the contract
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _model(args):
    from . import models

    overrides = {}
    if getattr(args, "layers", None) is not None:
        overrides["num_layers"] = args.layers
    if getattr(args, "batch", None) is not None:
        overrides["batch_size"] = args.batch
    if getattr(args, "dtype", None) is not None:
        overrides["dtype"] = args.dtype
    return models.get(args.model, **overrides)


def cmd_graph(args) -> dict:
    """The captured graph: operators, FLOPs by primitive and role, bytes."""
    model = _model(args)
    graph = model.trace()
    out = graph.summary()
    out["model"] = model.name
    out["flops_by_layer"] = graph.flops_by("layer")
    return out


def _print_graph(out: dict) -> None:
    print(f"{out['model']}: {out['num_ops']} operators, {out['num_layers']} layers, traced in {out['trace_s']:.2f} s")
    print(f"  parameters {out['param_count']:,} ({out['param_bytes'] / 2**30:.2f} GiB)")
    print(f"  FLOPs per step {out['total_flops']:.4g}")
    for role, flops in out["flops_by_role"].items():
        print(f"    {role:<10} {flops:.4g}")
    print("  top primitives by FLOPs:")
    for prim, flops in list(out["flops_by_primitive"].items())[:6]:
        print(f"    {prim:<22} {flops:.4g}")
    for w in out["warnings"]:
        print(f"  warning: {w}")


COMMANDS: dict[str, tuple[Callable, Callable | None]] = {
    "graph": (cmd_graph, _print_graph),
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar-lab", description="Alpa-style automatic parallelization planning on JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def model_args(sp):
        sp.add_argument("model", help="a zoo model name, e.g. gpt-1.3b, moe-2.4b, wresnet-1b, mlp")
        sp.add_argument("--layers", type=int, help="override the number of layers")
        sp.add_argument("--batch", type=int, help="override the global batch size")
        sp.add_argument("--dtype", help="override the dtype (float32, float16, bfloat16)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    model_args(sub.add_parser("graph", help="capture a model's training step as an operator graph"))
    return p


def _one_sentence(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if text.endswith((".", "?", "!", ")")) else text + "."


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        run, pretty = COMMANDS[args.command]
        out = run(args)
    except UsageError as e:
        print(f"autopar-lab: {_one_sentence(e)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
        # Every engine error about the user's input is a ValueError (or KeyError/FileNotFoundError) with a message
        # that says what to change.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"autopar-lab: {_one_sentence(msg if isinstance(msg, BaseException) else Exception(msg))}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar-lab: interrupted.", file=sys.stderr)
        return 130
    if args.json:
        json.dump(out, sys.stdout, default=_json_default)
        sys.stdout.write("\n")
    elif pretty is not None:
        pretty(out)
    else:
        json.dump(out, sys.stdout, indent=2, default=_json_default)
        sys.stdout.write("\n")
    return 0


def _json_default(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, tuple):
        return list(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
