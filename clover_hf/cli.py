"""`clover-hf` command line.

Examples:
    # heads for your model, on ShareGPT prompts answered by the model itself
    clover-hf train --base-model HuggingFaceTB/SmolLM2-135M-Instruct --self-distill --output-dir runs/smol

    # your own chat data (JSONL with "messages"), several processes or GPUs
    accelerate launch --num_processes 2 -m clover_hf.cli train --base-model ./my-model \\
        --data chats.jsonl --output-dir runs/mine --max-steps 2000

    # an interrupted run resumes from its last checkpoint when started again with the same command
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from .pipeline import DataConfig, train_heads
from .training import TrainConfig


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args else kind
        if typing.get_origin(base) in (list, tuple) or typing.get_origin(kind) in (list, tuple):
            inner = typing.get_args(base if typing.get_origin(base) else kind)[0]
            parser.add_argument(flag, type=inner, nargs="+", default=default, required=required, help=help_text)
        else:
            parser.add_argument(flag, type=base, default=default, required=required,
                                help=f"{help_text} (default: {default})")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train Clover heads for a base model")
    _add_dataclass_args(train, DataConfig)
    _add_dataclass_args(train, TrainConfig)
    train.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the trained heads to this repo")
    return parser


def _pick(cls: type, values: dict) -> typing.Any:
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def main(argv: list[str] | None = None) -> int:
    args = vars(make_parser().parse_args(argv))
    command = args.pop("command")
    if command == "train":
        push = args.pop("push_to_hub")
        train_heads(_pick(DataConfig, args), _pick(TrainConfig, args), push_to_hub=push)
    return 0


if __name__ == "__main__":
    sys.exit(main())
