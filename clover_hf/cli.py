"""`python -m clover_hf.cli` (as `accelerate launch -m clover_hf.cli train ...` runs it): the `clover-hf` command."""

from clover_hf.tools.cli import main

if __name__ == "__main__":
    main()
