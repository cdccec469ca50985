"""How the base model computes: its parts (layers, norms, rotary), the KV cache, the mask and forward of a tree, the lean eager forward and the compiled one."""
