"""The command line (`clover-hf`) and the benchmark."""
