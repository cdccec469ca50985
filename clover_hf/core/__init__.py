"""The floor of the package: facts of the machine, the user cache, quantized tensors, tensor watches. Imports nothing else of clover_hf."""
