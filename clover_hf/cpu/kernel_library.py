"""The compiled kernel's build and loading: the C sources under `kernels/` (a shared header, a file for each family
of ops, `arch/` for each instruction set's inner loops) compiled together into one shared library per instruction
set, AVX-512-BF16 (with VNNI) or AVX2 (with FMA), by the system's C compiler (`$CC`, else `cc` or `gcc`); kept in
the user cache under a digest of the sources, flags and compiler, so that a change builds it anew; its functions
bound from one table of their C signatures (`BINDINGS`).

It is built once per machine, in a background thread started when a bf16 model is loaded on a CPU that runs it
(`KernelLibrary.prepare`); where no compiler builds it, or `CLOVER_HF_KERNEL=0`, torch's kernels compute instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from clover_hf.core.hardware import _cpu_flags, cpu_capability
from clover_hf.core.user_cache import default_cache_dir

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"  # the C sources and headers
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {"avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"),
             "avx2": ("-mavx2", "-mfma")}
KERNEL_ENV = "CLOVER_HF_KERNEL"  # "0": never build or use the kernel

# The C functions' signatures, name -> (argument types, result type). Structs (`struct layer_args` and the others)
# and arrays of them pass as pointers (`ctypes.byref`, ctypes arrays).
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
BINDINGS: dict[str, tuple[list, type | None]] = {
    # products.c
    "bf16_rows": ([P] * 4 + [I] * 4, I),
    # repack.c
    "screen_prepare": ([P] + [I] * 2 + [P] * 4 + [I], I),
    # norms.c
    "bf16_rms_norm": ([P] * 3 + [I] * 2 + [F], None),
    "bf16_add_rms_norm": ([P] * 5 + [I] * 2 + [F], None),
    "bf16_rope": ([P, L, P, L] + [P] * 4 + [I] * 5, None),
    "bf16_cosine_gate": ([P] * 5 + [I] * 3 + [F], None),
    "bf16_silu_mul": ([P, L, P, L, P, I, I], None),
    # attention.c
    "bf16_attention": ([P] * 3 + [L] * 2 + [P, I, I, P, L, P, P] + [I] * 6 + [F, I], I),
    "bf16_key_layout": ([I, I], L),
    # layers.c
    "bf16_layers": ([P, I, P], I),
    "move_slots": ([P] * 3 + [I] * 3 + [L, P, I, L], None),
    # select.c
    "argmax_rows": ([P, L, I, I, P, I], None),
    "top_probs": ([P] + [I] * 3 + [P] * 2 + [I], None),
    "top_k_columns": ([P, L] + [I] * 3 + [P, I] + [P] * 2 + [I], L),
    "bf16_screen_argmax": ([P, I] + [P] * 6 + [I] * 2 + [P] * 2 + [I], I),
    "bf16_screen_top_k": ([P, I] + [P] * 6 + [I] * 3 + [P] * 2 + [L, P, I], L),
}
del P, I, L, F


def instruction_set() -> str | None:
    """The instruction set the kernel is built for here: "avx512_bf16" (with VNNI, as every CPU with AVX-512-BF16 has
    it), else "avx2" (with FMA), else None
    (another CPU, or `CLOVER_HF_KERNEL=0`). Where torch is told to act as an older CPU
    (`ATEN_CPU_CAPABILITY=avx2`), so is the kernel."""
    if os.environ.get(KERNEL_ENV, "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability, flags = cpu_capability().upper(), _cpu_flags()
    if capability.startswith("AVX512") and {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"} <= flags:
        return "avx512_bf16"
    if capability.startswith(("AVX2", "AVX512")) and {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def cpu_supports() -> bool:
    """Whether this CPU runs the kernel."""
    return instruction_set() is not None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISA_FLAGS[isa])


def sources() -> list[Path]:
    """The C sources the library is built from, every instruction set's (each compiles only under its own flags)."""
    return sorted(KERNELS.rglob("*.c"))


def library_path(isa: str, cache_dir: Path | None = None) -> Path:
    """Where the kernel built for `isa` is kept: named by its sources and headers (their paths and bytes), flags and
    compiler, so a change builds it anew."""
    digest = hashlib.sha256()
    for path in sorted([*KERNELS.rglob("*.c"), *KERNELS.rglob("*.h")]):
        digest.update(path.relative_to(KERNELS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join((*_flags(isa), str(_compiler()))).encode())
    return (cache_dir or default_cache_dir()) / "kernels" / f"bf16_cpu-{isa}-{digest.hexdigest()[:16]}.so"


def _built(path: Path, isa: str) -> Path:
    """`path`, built there if missing (written under a temporary name first: a reader never sees half a file)."""
    if path.exists():
        return path
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_flags(isa), "-o", tmp, *map(str, sources())], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(isa: str, cache_dir: Path | None = None) -> ctypes.CDLL:
    """The kernel built for `isa` (one of ISA_FLAGS), built first where missing, its functions bound (`BINDINGS`);
    raises where it cannot be."""
    lib = ctypes.CDLL(str(_built(library_path(isa, cache_dir), isa)))
    for name, (argtypes, restype) in BINDINGS.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


class KernelLibrary:
    """The process's kernel: loaded once, in a background thread that builds it first where need be, or failed for
    good. `lib` is the loaded build (None until it is, or where it cannot be: the ops then decline and torch's
    kernels compute), `build_id` its digest (`library_path`). Tests point `lib` at a build of their choosing."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.build_id: str | None = None
        self.failed = False
        self.building: threading.Thread | None = None
        self.lock = threading.Lock()

    def load(self, isa: str) -> None:
        """Load the build for `isa` (built first where missing); where it cannot be, say why and fail for good."""
        try:
            self.lib = load(isa)
            self.build_id = library_path(isa).stem.rsplit("-", 1)[-1]
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or ""
            logger.info("clover_hf: the %s kernel was not built (%s%s); torch's kernels compute instead",
                        isa, e, f": {detail.strip()[-500:]}" if detail else "")
            self.failed = True

    def prepare(self) -> None:
        """Start building (or loading) the kernel in the background, where this CPU runs it: a model load does,
        so that the first `generate` call finds it ready."""
        with self.lock:
            isa = None if self.building is not None or self.lib is not None or self.failed else instruction_set()
            if isa is not None:
                self.building = threading.Thread(target=self.load, args=(isa,), name="clover-hf-kernel", daemon=True)
                self.building.start()

    def available(self) -> bool:
        """Whether the kernel is built and loaded (waiting for a build `prepare` started, or starting one)."""
        if self.lib is None and not self.failed:
            self.prepare()
            if self.building is not None:
                self.building.join()
        return self.lib is not None


KERNEL = KernelLibrary()  # the process's one kernel


def prepare() -> None:
    """Start building (or loading) the kernel in the background (`KernelLibrary.prepare`)."""
    KERNEL.prepare()


def available() -> bool:
    """Whether the kernel is built and loaded (waiting for a build `prepare` started)."""
    return KERNEL.available()


def build_id() -> str | None:
    """The digest of the build loaded (its sources, flags and compiler), None where none is: what it computes and
    how fast depends on it, so stored verify costs are kept per build."""
    return KERNEL.build_id if KERNEL.available() else None


def serves(t: torch.Tensor) -> bool:
    """Whether the kernel computes for bf16 tensors like `t` on the CPU (built: asked last, so that a float32 model
    never builds it)."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and KERNEL.available()


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` where it is contiguous, else its contiguous copy (the kernels read tensors as they lie)."""
    return t if t.is_contiguous() else t.contiguous()


def pointer(t: torch.Tensor | None) -> int | None:
    """The address of `t`'s data, or None (NULL) for None."""
    return None if t is None else t.data_ptr()
