"""What the machine at hand computes natively, and how to name it in a result.

Speculative decoding pays only where verifying many tokens costs little more than one, and that
depends on the device, its instruction set and the dtype: on a CPU without native bf16 a many-token
bf16 forward costs many one-token ones, on one with it (AVX-512-bf16, AMX) little more than one.
"""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels run with (`AVX2`, `AVX512`, ...); honours ATEN_CPU_CAPABILITY."""
    return torch.backends.cpu.get_cpu_capability()


@lru_cache(maxsize=4)
def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 matrix products natively (AVX-512-bf16 or AMX) and torch may use it.

    Where it does not, torch converts bf16 to fp32 around every product: many-token forwards cost far
    more than in fp32. `ATEN_CPU_CAPABILITY=avx2` / `ONEDNN_MAX_CPU_ISA=AVX2` (an AVX2-only CPU
    emulated) count as no; so does any CPU whose flags this cannot read (other CPUs are measured by
    `bf16_reads_faster_cpu`).
    """
    if not cpu_capability().upper().startswith("AVX512"):
        return False
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if limit not in ("ALL", "") and "BF16" not in limit and "AMX" not in limit:
        return False
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def amx_cpu() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (Intel's server CPUs since Sapphire Rapids), as oneDNN does there."""
    return "amx_bf16" in _cpu_flags()


@lru_cache(maxsize=1)
def bf16_reads_faster_cpu(ratio: float = 1.2) -> bool:
    """Whether one-token products (what plain decoding does) run `ratio` times faster with bf16 weights
    than with fp32 ones on this CPU, timed on 64 MiB of fp32 weights (briefly, once).

    Without native bf16 the CPU converts bf16 to fp32 as it computes: one-token decoding still reads
    half the bytes and may win, while many-token forwards lose (the draft budget's cost model sees that).
    """
    weights = {dtype: [torch.full((2048, 1024), 0.01, dtype=dtype) for _ in range(8)]
               for dtype in (torch.float32, torch.bfloat16)}
    best = {}
    for dtype, ws in weights.items():
        x = torch.full((1, 1024), 0.01, dtype=dtype)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for w in ws:
                torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] >= ratio * best[torch.bfloat16]


def available_memory() -> int | None:
    """Bytes of memory the system could give this process now without swapping (Linux's MemAvailable;
    elsewhere the free pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def describe_machine(device: torch.device | str = "cpu") -> str:
    """One line naming the machine: CPU model, ISA and threads (and the GPU), torch and OS."""
    device = torch.device(device)
    bf16 = "native bf16" if native_bf16_cpu() else "no native bf16"
    text = f"{cpu_name()} ({cpu_capability()}, {bf16}), {torch.get_num_threads()} threads"
    if device.type == "cuda":
        text = f"{torch.cuda.get_device_name(device)}; CPU {text}"
    elif device.type != "cpu":
        text = f"{device.type}; CPU {text}"
    return f"{text}, torch {torch.__version__}, {platform.platform()}"


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """`fn()` and its wall time in seconds; on an accelerator the queued work is waited for at both ends."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return out, time.perf_counter() - start
