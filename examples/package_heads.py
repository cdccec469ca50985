"""Copy trained SmolLM2 heads into the package (bf16, named for the Hub base, with a model card).

    python examples/package_heads.py runs/smol-data/heads [--benchmark runs/bench/results.json]
    python examples/package_heads.py runs/medusa/heads   # the Medusa baseline (its own tree, no lookup chain)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from clover_hf.embedded import DEFAULT_BASE_NAME, shipped_heads_path
from clover_hf.heads.config import validate_tree
from clover_hf.heads.tree import tree_from_accuracies
from clover_hf.hub.card import write_model_card
from clover_hf.hub.repo import load_heads, save_heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", type=Path, help="the trainer's OUTPUT_DIR/heads")
    parser.add_argument("--benchmark", type=Path, default=None, help="a JSON with tokens_per_step/speedup/prompts")
    parser.add_argument("--tree-size", type=int, default=None, help="reshape the tree from the measured ranks")
    parser.add_argument("--tree", type=json.loads, default=None, help="ship this static tree (Medusa paths, JSON)")
    parser.add_argument("--lookup", type=int, default=None, help="prompt-lookup chain length to ship (lookup_tokens)")
    parser.add_argument("--lookup-max", type=int, default=None,
                        help="length the chain doubles up to while the text copies (lookup_max_tokens)")
    parser.add_argument("--dynamic-tree", type=json.loads, default=None,
                        help='ship a dynamic tree, e.g. \'{"depth": 4, "width": 4, "nodes": 16}\'')
    parser.add_argument("--accelerator-tree", type=json.loads, default=None,
                        help='the dynamic tree drafted at batch size 1 off the CPU (accelerator_dynamic_tree), e.g. '
                             '\'{"depth": 4, "width": 16, "nodes": 128}\'')
    parser.add_argument("--note", action="append", default=[], help="a line for the card's training facts")
    args = parser.parse_args()
    heads = load_heads(args.heads, dtype=torch.bfloat16)
    heads.config.base_model_name_or_path = DEFAULT_BASE_NAME
    heads.config.base_revision = None
    metrics = json.loads((args.heads / "training_metrics.json").read_text())
    metrics.get("data_config", {})["base_model"] = DEFAULT_BASE_NAME
    if args.tree_size:
        ranks = [head["ranks"] for head in metrics["eval"]]
        heads.config.tree = validate_tree(tree_from_accuracies(ranks, args.tree_size), heads.config.num_heads)
    if args.tree is not None:
        heads.config.tree = validate_tree(args.tree, heads.config.num_heads)
    if args.lookup is not None:
        heads.config.lookup_tokens = args.lookup
    if args.lookup_max is not None:
        heads.config.lookup_max_tokens = args.lookup_max
    if args.dynamic_tree is not None:
        heads.config.dynamic_tree = args.dynamic_tree
    if args.accelerator_tree is not None:
        heads.config.accelerator_dynamic_tree = args.accelerator_tree
    heads.config.__post_init__()  # validate the settings just changed
    metrics["notes"] = metrics.get("notes", []) + args.note
    if args.benchmark:
        metrics["benchmark"] = json.loads(args.benchmark.read_text())
    target = shipped_heads_path(heads.config.head_type)  # Clover heads, or the Medusa baseline beside them
    if target.exists():
        shutil.rmtree(target)
    save_heads(heads, target)
    (target / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_model_card(target, heads.config, metrics, license="apache-2.0")
    print(f"packaged into {target}: " + ", ".join(sorted(p.name for p in target.iterdir())))


if __name__ == "__main__":
    main()
