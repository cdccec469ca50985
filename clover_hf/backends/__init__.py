"""How the base computes for the decode loop: one seam, several backends. `TorchBackend` (eager, any device and
architecture; or compiled over a static cache), `KernelBackend` (the CPU kernel's linear forms, Llama-pattern bf16 on
x86). The loop asks a backend for a prefill, a verify forward and its width, a node's greedy choice, and calls its
step hooks; it does not know which one it has."""

from .kernel_backend import KernelBackend
from .kernel_forms import FormBook
from .keys import cost_key
from .torch_backend import TorchBackend

__all__ = ["FormBook", "KernelBackend", "TorchBackend", "cost_key"]
