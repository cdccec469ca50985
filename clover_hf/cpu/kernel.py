"""Compiled bf16 kernels for x86 CPUs with AVX2 or AVX-512-BF16 (`kernels/bf16_cpu.c`): the product of a few
rows by a weight, and, for lean decoder layers, transformers' RMSNorm (alone or with the residual sum before it),
rotary embedding and SwiGLU activation in one call each, the attention of a few query tokens, and all of these as
a whole decoder layer in one call (`DecoderLayer`); the product by int8 rows the heads draft from, their softmax
top-k, greedy acceptance's argmax, and that argmax of the lm_head's logits without computing them all (`Screen`).
In situ each torch op a decoder layer runs took several times its warm time (SmolLM2's bf16 silu ~19 us against 4),
so every op folded into one call pays: the whole layer in one call made one-token forwards 12.8 against 17.8 ms on
the AVX2-only EPYC.

Verify forwards multiply 1-16 rows by every weight. On the AVX-512-bf16 EPYC (2 threads), 120 products of
SmolLM2's decoder shapes took, in ms at 1 / 2 / 4 / 8 / 16 rows:

    ATen's own kernel (oneDNN off)           5.7 / 9.7 / 18.3 /  -   /  -
    oneDNN, weights in its blocked layout     6.1 / 5.7 /  5.8 /  6.8 /  8.4
    this kernel, AVX-512-BF16, weights tiled  3.5 / 3.7 /  3.8 /  4.5 /  6.7
    this kernel built for AVX2 (same CPU)     5.3 / 7.2 / 11.5 / 16.1 / 24.5

(the AVX2 build then read a tile a 16-column half at a time; reading it in one pass, the 210 products took 11.0 /
11.1 / 13.8 / - / 30.6 ms on the AVX2-only EPYC, Zen 3, against 17.6 / 30.9 / 55.8 / - / 202 in `F.linear`).

It reads each weight byte once for a block of rows (8 with AVX-512-BF16's bf16 pair products, 4 with
AVX2, which widens the weights to float32 in registers; more rows there take up to 6 a pass over half a
tile, a 4 KB chunk of it at a time while it stays in L1), in a layout that streams through memory in
order, and returns with a few microseconds of call overhead (oneDNN's blocked product had ~10 us fixed).
Where torch has no native bf16 products (AVX2-only CPUs) it converts bf16 to float32 around each one;
this kernel reads the bf16 bytes alone. Like every form, it is used only where timed faster.
It is built once per machine with the system's C compiler (`$CC`, else `cc` or `gcc`) into the cache
directory, in a background thread started when a bf16 model is loaded on such a CPU; where no compiler
builds it, or `CLOVER_HF_KERNEL=0`, products use torch's kernels as before. Sums are float32, as
torch's bf16 products; their order differs, so bf16 outputs may round differently (fp32 is untouched).
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
from collections.abc import Callable
from pathlib import Path

import torch

from clover_hf.core.hardware import _cpu_flags, cpu_capability
from clover_hf.core.user_cache import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "bf16_cpu.c"
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {"avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"),
             "avx2": ("-mavx2", "-mfma")}
KERNEL_ENV = "CLOVER_HF_KERNEL"  # "0": never build or use the kernel
TILE = 32  # output columns per tile: a weight needs a multiple of it, and an even number of inputs

_lock = threading.Lock()
_build: threading.Thread | None = None
_library: ctypes.CDLL | None = None
_build_id: str | None = None  # the loaded build's digest (`library_path`)
_failed = False


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


def library_path(isa: str, cache_dir: Path | None = None) -> Path:
    """Where the kernel built for `isa` is kept: named by its source, flags and compiler, so a change builds it anew."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((*_flags(isa), str(_compiler()))).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "kernels" / f"bf16_cpu-{isa}-{digest}.so"


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
        subprocess.run([compiler, *_flags(isa), "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class LayerArgs(ctypes.Structure):
    """The C kernel's `struct layer_args`: a decoder layer's weights, sizes and cache stores."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
                    "norm_in", "qkv", "o", "gate_up", "down", "norm_post", "qkv_bias", "o_bias", "gate_up_bias",
                    "down_bias")),
                *((name, ctypes.c_int) for name in ("D", "Hq", "Hk", "hd", "F")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("kv_row", ctypes.c_long),
                ("kv_head", ctypes.c_long), ("layout", ctypes.c_void_p), ("layout_head", ctypes.c_long),
                ("laid", ctypes.c_void_p)]


class StepArgs(ctypes.Structure):
    """The C kernel's `struct step_args`: what a forward's layers share."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("x", "cos", "sin", "out")), ("length", ctypes.c_int),
                ("mask", ctypes.c_void_p), *((name, ctypes.c_int) for name in ("mask_bf16", "B", "T", "causal"))]


class FeatureArgs(ctypes.Structure):
    """The C kernel's `struct feature_args`: the input Attention Decoder and final norm of Clover's features."""

    _fields_ = [*((name, ctypes.c_int) for name in ("D", "heads", "threads")), ("in_norm", ctypes.c_void_p),
                ("in_eps", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("q", "k", "v", "q_bias", "k_bias", "v_bias", "out_norm")),
                ("out_eps", ctypes.c_float)]


class DraftLevel(ctypes.Structure):
    """The C kernel's `struct draft_level`: one depth of a static draft tree and the weights its rows multiply by."""

    _fields_ = [*((name, ctypes.c_int) for name in ("k", "expanded", "children", "next")),
                *((name, ctypes.c_void_p) for name in (
                    "parent_of_expanded", "child_parent", "child_rank", "next_expanded", "q", "k_w", "v", "q_bias",
                    "k_bias", "v_bias", "fc", "head_norm", "fc_bias")),
                ("head_eps", ctypes.c_float)]


class DraftArgs(ctypes.Structure):
    """The C kernel's `struct draft_args`: what a static tree's levels share."""

    _fields_ = [*((name, ctypes.c_int) for name in ("D", "heads", "rows", "threads")), ("reg_norm", ctypes.c_void_p),
                ("reg_eps", ctypes.c_float),
                *((name, ctypes.c_void_p) for name in ("lm_w", "lm_scales", "lm_bias", "token_ids",
                                                       "embedding"))]


def load(isa: str, cache_dir: Path | None = None) -> ctypes.CDLL:
    """The kernel built for `isa` (one of ISA_FLAGS), built first where missing; raises where it cannot be."""
    lib = ctypes.CDLL(str(_built(library_path(isa, cache_dir), isa)))
    lib.bf16_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.bf16_rows.restype = ctypes.c_int
    lib.bf16_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.bf16_rms_norm.restype = None
    lib.bf16_rope.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4 + [
        ctypes.c_int] * 5
    lib.bf16_rope.restype = None
    lib.bf16_attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p
    ] + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    lib.bf16_attention.restype = ctypes.c_int
    lib.bf16_key_layout.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.bf16_key_layout.restype = ctypes.c_long
    lib.bf16_cosine_gate.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_float]
    lib.bf16_cosine_gate.restype = None
    lib.move_slots.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_long, ctypes.c_void_p,
                                                                             ctypes.c_int, ctypes.c_long]
    lib.move_slots.restype = None
    lib.i8_rows.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.i8_rows.restype = ctypes.c_int
    lib.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.argmax_rows.restype = None
    lib.top_probs.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.top_probs.restype = None
    lib.top_k_columns.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int] + [
        ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.top_k_columns.restype = ctypes.c_long
    lib.bf16_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_int]
    lib.bf16_silu_mul.restype = None
    lib.bf16_add_rms_norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.bf16_add_rms_norm.restype = None
    lib.bf16_layers.argtypes = [ctypes.POINTER(ctypes.POINTER(LayerArgs)), ctypes.c_int, ctypes.POINTER(StepArgs)]
    lib.bf16_layers.restype = ctypes.c_int
    lib.bf16_output_head.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float, ctypes.c_void_p] + [ctypes.c_int] * 3
    lib.bf16_output_head.restype = ctypes.c_int
    lib.bf16_attention_decoder.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 7 + [
        ctypes.c_int] * 4
    lib.bf16_attention_decoder.restype = ctypes.c_int
    lib.bf16_draft_levels.argtypes = [ctypes.POINTER(DraftArgs), ctypes.POINTER(DraftLevel), ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.bf16_draft_levels.restype = ctypes.c_int
    lib.bf16_features.argtypes = [ctypes.POINTER(FeatureArgs), ctypes.POINTER(ctypes.POINTER(LayerArgs)), ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [
        ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    lib.bf16_features.restype = ctypes.c_int
    lib.bf16_screen_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 2 + [
        ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.bf16_screen_argmax.restype = ctypes.c_int
    lib.bf16_screen_top_k.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 3 + [
        ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.bf16_screen_top_k.restype = ctypes.c_long
    lib.screen_prepare.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    lib.screen_prepare.restype = ctypes.c_int
    return lib


def _load(isa: str) -> None:
    global _library, _build_id, _failed
    try:
        _library = load(isa)
        _build_id = library_path(isa).stem.rsplit("-", 1)[-1]
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or ""
        logger.info("clover_hf: the %s kernel was not built (%s%s); torch's kernels compute instead",
                    isa, e, f": {detail.strip()[-500:]}" if detail else "")
        _failed = True


def prepare() -> None:
    """Start building (or loading) the kernel in the background, where this CPU runs it: a model load does,
    so that the first `generate` call finds it ready."""
    global _build
    with _lock:
        isa = None if _build is not None or _library is not None or _failed else instruction_set()
        if isa is not None:
            _build = threading.Thread(target=_load, args=(isa,), name="clover-hf-kernel", daemon=True)
            _build.start()


def available() -> bool:
    """Whether the kernel is built and loaded (waiting for a build `prepare` started)."""
    if _library is None and not _failed:
        prepare()
        if _build is not None:
            _build.join()
    return _library is not None


def build_id() -> str | None:
    """The digest of the build loaded (its source, flags and compiler), None where none is: what it computes and
    how fast depends on it, so stored verify costs are kept per build."""
    return _build_id if available() else None


def serves(t: torch.Tensor) -> bool:
    """Whether the kernel computes for bf16 tensors like `t` on the CPU (built: asked last, so that a float32 model
    never builds it)."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and available()


class SlotMover:
    """A KV cache's compaction after a verify forward in one call (`move_slots`), where torch ran three ops a tensor
    (0.33 ms a step over SmolLM2's 60, AVX-512-bf16 EPYC): in each of the tensors (B, H, slots, D) on the CPU, of any
    dtype, slot src[b, i] of row b moves to slot dst + i (sources at or after their destinations, in order). Their
    addresses and strides are read once: a cache's stores stay put until they grow, and reading SmolLM2's 60 again
    at every compaction took ~0.07 ms a drafted step in situ (Zen 4 EPYC)."""

    def __init__(self, tensors: list[torch.Tensor], batch: int, heads: int, slot_bytes: int) -> None:
        count = len(tensors)
        self.tensors = tensors  # what the pointers point into
        self.batch, self.heads, self.slot_bytes = batch, heads, slot_bytes
        self.args = ((ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors)),
                     (ctypes.c_long * count)(*(t.stride(0) * t.element_size() for t in tensors)),
                     (ctypes.c_long * count)(*(t.stride(1) * t.element_size() for t in tensors)), count)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> SlotMover | None:
        """A mover over `tensors`, or None where the kernel is not loaded (it is never built for this alone) or a
        tensor is not laid out with each head's slots one after another."""
        if _library is None or not tensors:
            return None
        batch, heads, _, dim = tensors[0].shape
        slot_bytes = dim * tensors[0].element_size()
        if not all(t.is_cpu and t.shape[0] == batch and t.shape[1] == heads and t.stride()[2:] == (dim, 1)
                   and t.shape[3] * t.element_size() == slot_bytes for t in tensors):
            return None
        return cls(tensors, batch, heads, slot_bytes)

    def __call__(self, src: torch.Tensor, dst: int) -> bool:
        """Move slot src[b, i] of row b to slot dst + i in every tensor (as `move_slots`); False (nothing moved) where
        `src` is not of the tensors' batch."""
        if src.shape[0] != self.batch or not src.is_cpu:
            return False
        src = src.to(torch.int64).contiguous()
        _library.move_slots(*self.args, self.batch, self.heads, self.slot_bytes, src.data_ptr(), src.shape[1], dst)
        return True


def argmax(scores: torch.Tensor) -> torch.Tensor | None:
    """`scores.argmax(-1)` of float32 rows (N, V) on the CPU, the same indices (the first largest, a NaN counting as
    the largest), in one call: torch's took 155 us for a verify forward's 4 rows of SmolLM2's 49152 logits against
    ~20 (AVX2-only EPYC). None where the kernel is not loaded (it is never built for this alone) or the rows are
    not float32 on the CPU, each contiguous."""
    if _library is None or scores.dtype is not torch.float32 or not scores.is_cpu or scores.dim() != 2 or (
            scores.stride(1) != 1 and scores.shape[1] > 1):
        return None
    rows, width = scores.shape
    if rows and not width:
        return None  # torch refuses an empty row
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        _library.argmax_rows(scores.data_ptr(), scores.stride(0), rows, width, out.data_ptr(), torch.get_num_threads())
    return out


TOP_MOST = 64  # the most tokens a row `top_probs` ranks (the kernel's TOP_MOST)


def top_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`logits.float().softmax(-1).topk(k)` of bf16 rows (N, V) on the CPU, as (probabilities, indices), in one call:
    torch's three ops took ~85 us a drafting level over SmolLM2's 8192 draft rows (AVX2-only EPYC). Of equal logits
    the first ranks first; the probabilities' sums add in another order than torch's. None where no kernel is loaded
    or the input is not of that form (or k is over TOP_MOST)."""
    if (_library is None or logits.dtype is not torch.bfloat16 or not logits.is_cpu or logits.dim() != 2
            or not 0 < k <= min(TOP_MOST, logits.shape[1])):
        return None
    logits = _contiguous(logits)
    rows = logits.shape[0]
    probs, indices = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    if rows:
        _library.top_probs(logits.data_ptr(), rows, logits.shape[1], k, indices.data_ptr(), probs.data_ptr(),
                           torch.get_num_threads())
    return probs, indices


def top_k_columns(scores: torch.Tensor, k: int, marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A top-k warper's cut of float32 `scores` (R, n) on the CPU, as transformers' TopKLogitsWarper makes it (a score
    below its row's k-th largest is removed): each row's k-th largest (R,) and, ascending, the columns (C,) that some
    row keeps or that `marked` (int64 column ids) names. None where no kernel is loaded, the inputs are not of that
    form (a marked column out of range too) or a score is a NaN."""
    if (scores.dim() != 2 or scores.dtype is not torch.float32 or not scores.is_cpu or scores.stride(1) != 1
            or not 0 < k <= scores.shape[1] or marked.dtype is not torch.int64 or not marked.is_cpu or not available()):
        return None
    rows, n = scores.shape
    marked = _contiguous(marked)
    kth, columns = torch.empty(rows), torch.empty(n, dtype=torch.int64)
    count = _library.top_k_columns(scores.data_ptr(), scores.stride(0), rows, n, k, marked.data_ptr(), marked.numel(),
                                   kth.data_ptr(), columns.data_ptr(), torch.get_num_threads())
    return None if count < 0 else (kth, columns[:count])


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel computes products by `weight`: bf16 on the CPU, a multiple of TILE rows, even columns."""
    rows, cols = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and rows % TILE == 0 and cols % 2 == 0


def tile(weight: torch.Tensor, *stacked: torch.Tensor) -> torch.Tensor:
    """`weight` (O x I) laid out for the kernel: (O / TILE, I / 2, TILE, 2); with `stacked` weights of as many
    inputs (each of a multiple of TILE rows), that of `torch.cat([weight, *stacked])`, without making it. Each input
    pair moves as one 4-byte value: SmolLM2's copies took 0.11-0.13 s against 0.30-0.34 moving 2-byte values after
    stacking (AVX2-only EPYC), much of a first call's fixed cost."""
    weights = [w.detach() for w in (weight, *stacked)]
    cols = weights[0].shape[1]
    out = torch.empty(sum(w.shape[0] for w in weights) // TILE, cols // 2, TILE, 2, dtype=weights[0].dtype,
                      device=weights[0].device)
    at = 0
    for w in weights:
        blocks, into = w.shape[0] // TILE, out[at : at + w.shape[0] // TILE]
        if w.is_contiguous() and w.storage_offset() % 2 == 0 and w.dtype.itemsize == 2:
            into.view(torch.int32).view(blocks, cols // 2, TILE).copy_(
                w.view(torch.int32).view(blocks, TILE, cols // 2).transpose(1, 2))
        else:
            into.copy_(w.reshape(blocks, TILE, cols // 2, 2).transpose(1, 2))
        at += blocks
    return out


def product(tiled: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ weight.T (+ bias) as a function of bf16 x, from `tile(weight)`, in torch's number of threads."""
    run, empty, bf16 = _library.bf16_rows, torch.empty, torch.bfloat16
    out_features, in_features = tiled.shape[0] * TILE, tiled.shape[1] * 2
    bias = None if bias is None else bias.detach().float().contiguous()
    weight_at, bias_at, threads = tiled.data_ptr(), 0 if bias is None else bias.data_ptr(), torch.get_num_threads()

    def compute(x: torch.Tensor) -> torch.Tensor:
        # as few tensor calls as may be: each costs about a microsecond, and a forward runs over a hundred products
        if x.dtype is not bf16 or not x.is_cpu:  # F.linear refuses a bf16 weight for other x too
            raise TypeError(f"bf16_kernel: a bf16 weight's product takes bf16 rows on the CPU, not {x.dtype} on {x.device}")
        if x.shape[-1] != in_features:  # as F.linear refuses it
            raise RuntimeError(f"bf16_kernel: rows of {x.shape[-1]} values cannot multiply a weight of {in_features} "
                               "inputs")
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // in_features
        out = empty(x.shape[:-1] + (out_features,), dtype=bf16)
        if run(x.data_ptr(), weight_at, bias_at, out.data_ptr(), rows, in_features, out_features, threads):
            raise MemoryError(f"bf16_kernel: no memory for {rows} rows in float32")
        return out

    compute.keep = (tiled, bias)  # the memory the pointers above point into
    return compute


def int8_product(rows: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
                 ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x @ (rows * scales[:, None]).T (+ bias) as a function of bf16 x (..., I), for int8 `rows` (O x I) with a scale
    a row, or None where no kernel is loaded or the shape is not one it takes (O a multiple of TILE, I even). Each row
    of x goes in as int16s (~14 bits, see `kernels/bf16_cpu.c`) for exact int32 sums of pair products: outputs within
    bf16 rounding of torch's `_weight_int8pack_mm`, which widens each weight, and the same from either build. On the
    AVX2-only EPYC the draft vocabulary's 8192 rows of SmolLM2 (4.7 MB) took 73 / 179 us at one / three rows in cache
    and 151 / 166 read from memory, against 104 / 271 and 150 / 376 with x split in two int8 parts for two passes of
    byte products, as before (torch's int8 kernel: 705 / 929 from memory)."""
    out_features, in_features = rows.shape
    if not (available() and out_features % TILE == 0 and in_features % 2 == 0
            and rows.dtype == torch.int8 and rows.is_cpu):
        return None
    tiled = rows.detach().reshape(out_features // TILE, TILE, in_features // 2, 2).transpose(1, 2).contiguous()
    scales = scales.detach().float().contiguous()
    bias = None if bias is None else bias.detach().float().contiguous()
    run, empty, bf16, threads = _library.i8_rows, torch.empty, torch.bfloat16, torch.get_num_threads()
    pointers = (tiled.data_ptr(), scales.data_ptr(), 0 if bias is None else bias.data_ptr())

    def compute(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not bf16 or not x.is_cpu or x.shape[-1] != in_features:
            raise TypeError(f"bf16_kernel: int8 rows of {in_features} inputs take bf16 rows of that size on the CPU, "
                            f"not {x.dtype} {tuple(x.shape)} on {x.device}")
        if not x.is_contiguous():
            x = x.contiguous()
        n = x.numel() // in_features
        out = empty(x.shape[:-1] + (out_features,), dtype=bf16)
        if run(x.data_ptr(), *pointers, out.data_ptr(), n, in_features, out_features, threads):
            raise MemoryError(f"bf16_kernel: no memory to quantize {n} rows")
        return out

    compute.keep = (tiled, scales, bias)  # the memory the pointers above point into
    return compute


class Screen:
    """Greedy choices of an lm_head without its whole product (`bf16_screen_argmax`): each row's first largest logit
    of x @ weight.T (+ bias), as `product(tile(weight), bias)` computes and rounds it, from an int8 copy of the weight
    that bounds every logit and the exact product of the few columns whose bound reaches the largest. The copy holds
    a byte a weight (SmolLM2's: 28 MB against the bf16 copy's 57), read instead of the bf16 one: in situ SmolLM2's
    lm_head took 1.4 against 2.2 ms for a verify forward's 4 rows, 1.5 against 2.1 for one (AVX2-only EPYC; ~5
    columns a row computed exactly)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Made by `of`, which checks what the kernel takes: `weight` bf16 (O x I) on the CPU, contiguous."""
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        out_features, in_features = weight.shape
        self.tiled = torch.empty(out_features // TILE, in_features // 2, TILE, 2, dtype=torch.int8)
        self.scales, self.resid, self.norms = (torch.empty(out_features) for _ in range(3))
        self.finite = bool(_library.screen_prepare(
            self.weight.data_ptr(), in_features, out_features, self.tiled.data_ptr(),
            self.scales.data_ptr(), self.resid.data_ptr(), self.norms.data_ptr(), torch.get_num_threads()))
        self.counts: torch.Tensor | None = None  # the columns each row of the last call computed exactly

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Screen | None":
        """The screen of `weight` (O x I, contiguous), or None where the kernel's product does not take it (`fits`),
        a weight is not finite, or no kernel is built (asked last)."""
        if not (weight.dim() == 2 and fits(weight) and weight.is_contiguous()
                and (bias is None or bias.shape == weight.shape[:1]) and available()):
            return None
        screen = cls(weight, bias)
        return screen if screen.finite else None

    def nbytes(self) -> int:
        """Memory the screen holds beside the weight."""
        return sum(t.numel() * t.element_size() for t in (self.tiled, self.scales, self.resid, self.norms))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax (N,) int64 of the logits of bf16 rows x (N, I), or None (nothing chosen) where x is not of that
        form or not finite."""
        out_features, in_features = self.weight.shape
        if not (x.dim() == 2 and x.shape[1] == in_features and x.shape[0] and x.dtype is torch.bfloat16 and x.is_cpu):
            return None
        x = _contiguous(x)
        rows = x.shape[0]
        out, counts = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int32)
        failed = _library.bf16_screen_argmax(
            x.data_ptr(), rows, self.tiled.data_ptr(), self.scales.data_ptr(), self.resid.data_ptr(),
            self.norms.data_ptr(), _pointer(self.bias), self.weight.data_ptr(), in_features, out_features,
            out.data_ptr(), counts.data_ptr(), torch.get_num_threads())
        if failed == 1:
            raise MemoryError(f"bf16_kernel: no memory to screen {rows} rows")
        self.counts = counts
        return None if failed else out

    def top_k(self, x: torch.Tensor, k: int, room: int = 4096) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For bf16 rows x (N, I): the columns (C,) ascending that may hold one of some row's k largest logits (every
        column at least a row's k-th largest is among them: C >= k) and their logits (N, C) float32, as the lm_head
        computes and rounds them (`bf16_screen_top_k`). None where x is not of that form or not finite, or more than
        `room` columns would be taken."""
        out_features, in_features = self.weight.shape
        if not (x.dim() == 2 and x.shape[1] == in_features and x.shape[0] and x.dtype is torch.bfloat16 and x.is_cpu
                and 0 < k <= out_features):
            return None
        x = _contiguous(x)
        rows, room = x.shape[0], min(room, out_features)
        columns, values = torch.empty(room, dtype=torch.int64), torch.empty(rows * room)
        counts = torch.empty(rows, dtype=torch.int32)
        taken = _library.bf16_screen_top_k(
            x.data_ptr(), rows, self.tiled.data_ptr(), self.scales.data_ptr(), self.resid.data_ptr(),
            self.norms.data_ptr(), _pointer(self.bias), self.weight.data_ptr(), in_features, out_features, k,
            columns.data_ptr(), values.data_ptr(), room, counts.data_ptr(), torch.get_num_threads())
        if taken == -1:
            raise MemoryError(f"bf16_kernel: no memory to screen {rows} rows")
        if taken < 0:
            return None
        self.counts = counts
        return columns[:taken], values[: rows * taken].view(rows, taken)


def linear(x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) from `tile(weight)`."""
    return product(tiled, bias)(x)


def rms_norm(weight: torch.Tensor, eps: float, module: Callable[[torch.Tensor], torch.Tensor]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' Llama RMSNorm (weight * bf16(x * rsqrt(mean(x^2) + eps))) of bf16 x, as one call: the module
    runs six ops and two conversions, 13.5 us a row of 576 against 2.3 here (AVX-512-bf16 EPYC). Its sums of
    squares add in another order than torch's: 2 outputs in 806,400 differed by a last bit. Other inputs go to
    `module` (the norm's own forward)."""
    weight = weight.detach().contiguous()
    dim = weight.shape[-1]

    def compute(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != dim:
            return module(x)
        return norm(x, weight, eps)

    return compute


def add_rms_norm(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor, torch.Tensor], tuple | None]:
    """(a + b, the RMSNorm of it) of bf16 a and b of one shape on the CPU, by `weight`, in one call: a decoder layer's
    residual sum and the norm after it (the sum bitwise torch's; the norm as `rms_norm`'s). The function returns None
    for other inputs."""
    weight = weight.detach().contiguous()
    dim, bf16 = weight.shape[-1], torch.bfloat16

    def compute(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if a.dtype is not bf16 or b.dtype is not bf16 or a.shape != b.shape or a.shape[-1] != dim or not (
                a.is_cpu and b.is_cpu):
            return None
        a, b = _contiguous(a), _contiguous(b)
        total, out = torch.empty_like(a), torch.empty_like(a)
        _library.bf16_add_rms_norm(a.data_ptr(), b.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                   a.numel() // dim, dim, eps)
        return total, out

    return compute


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dimension of bf16 x on the CPU, by a contiguous bf16
    `weight` of that size (as `rms_norm` computes it)."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    dim = weight.shape[-1]
    _library.bf16_rms_norm(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.numel() // dim, dim, eps)
    return out


def rope(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Llama's rotary embedding (x * cos + rotate_half(x) * sin) of bf16 queries and keys (B, T, heads, D) by cos
    and sin (B, T, D), as (B, heads, T, D) each, bitwise as torch's bf16 operations compute it, in one call
    (27.7 us a layer in torch's, at one token: eight operations and a copy). None where the inputs' layout is
    not one it reads: each token's heads side by side and its tokens at one stride (a view of a projection's
    output, or of a stacked product's part)."""
    bf16 = torch.bfloat16
    if query.dtype is not bf16 or key.dtype is not bf16 or cos.dtype is not bf16 or sin.dtype is not bf16:
        return None
    (batch, tokens, heads, dim), (_, _, key_heads, _) = query.shape, key.shape
    q_at, k_at = query.stride(), key.stride()
    if not (key.shape[:2] == query.shape[:2] and key.shape[3] == dim and q_at[3] == k_at[3] == 1
            and q_at[2] == k_at[2] == dim and (batch == 1 or (q_at[0] == tokens * q_at[1] and k_at[0] == tokens * k_at[1]))
            and cos.shape == sin.shape == (batch, tokens, dim)):
        return None
    cos, sin = _contiguous(cos), _contiguous(sin)
    q_out = torch.empty(batch, heads, tokens, dim, dtype=bf16)
    k_out = torch.empty(batch, key_heads, tokens, dim, dtype=bf16)
    _library.bf16_rope(query.data_ptr(), q_at[1], key.data_ptr(), k_at[1], cos.data_ptr(), sin.data_ptr(),
                       q_out.data_ptr(), k_out.data_ptr(), batch, tokens, heads, key_heads, dim)
    return q_out, k_out


def cosine_gate(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, eps: float = 1e-8
                ) -> torch.Tensor:
    """h + v * cos(q, k), the cosine taken per head of `heads` over the last dimension's parts, of bf16 tensors of one
    shape on the CPU: Clover's Attention Decoder's gate in one call, where torch ran eight ops (44 us against 4 a
    drafting level, AVX-512-bf16 EPYC). Rounds as torch's bf16 ops but for the cosine's sums (float32, another
    order)."""
    h, q, k, v = (_contiguous(t) for t in (h, q, k, v))
    width = h.shape[-1]
    out = torch.empty_like(h)
    _library.bf16_cosine_gate(h.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                              h.numel() // width, heads, width // heads, eps)
    return out


ATTENTION_DIMS = range(32, 257, 32)  # the head sizes `attention` takes


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
              causal: bool = False) -> torch.Tensor | None:
    """softmax(scale * query @ key.T + mask) @ value of bf16 queries (B, H, T, D) over keys and values (B, G, K, D),
    each key/value head serving H / G query heads, as (B, T, H, D): for the few query tokens of a verify forward, where
    SDPA's CPU kernel took 23 us a layer at one token and 67 at eight over ~150 keys (SmolLM2, AVX-512-bf16 EPYC; on the
    AVX2-only EPYC 20 / 41 / 68 us at 1 / 4 / 8 tokens over 200 keys against 143 / 64 / 79, and drafted steps,
    alternating calls with SDPA, ran 63.5 against 57.8 tokens/s). Scores and softmax are float32; each weight is rounded
    to bf16 before it weighs the values (summed in float32), as SDPA's CPU kernel rounds its bf16 product's: 87-99% of
    outputs bitwise SDPA's where a head's keys are not split among threads, against ~60% with float32 weights (the
    AVX-512 build then weighs two keys a vdpbf16ps: with the keys laid out, 117 against 141 us a layer at 8 tokens over
    1,500 keys, 29 against 33 over 300, 28 against 31 at one token over 1,500; Zen 4). Both builds split a head's keys
    among threads where its rows would leave one idle (one token's 3 key/value heads on 2 threads). The AVX2 build
    weighs values in blocks of keys that stay in L1: over 30 layers' caches of 1,500 keys, 76 / 191 / 296 us a layer at
    1 / 4 / 8 tokens against 111 / 285 / 462 before; long prompts' one-token forwards 12.8-13.1 against 14.1-15.5 ms.
    The AVX-512 build lays out each head's keys for its bf16 products in registers (not by gathers) and splits that work
    too: 1 / 2 tokens over 1,500 keys 125 / 142 against 155 / 177 us a layer, over 300 keys ~23 against ~30 (Zen 4).
    `mask`: additive, (B, 1, T, K), bf16 or float32; None where every query sees every key, or with `causal` (no mask)
    where query t sees keys 0..K - T + t, as a prompt's tokens see the text up to their own: each pass over a few
    query rows then reads only the keys its last row sees, about half of a prompt's (1,000 tokens of SmolLM2: 5.1 ms a
    layer against 12.1 by SDPA's flash kernel, Zen 4 EPYC). None where the inputs are not of that form, or no kernel
    is loaded. Keys and values are read as they lie where each head's slots follow one another (a growing cache's
    views of its stores), else from contiguous copies."""
    batch, heads, tokens, dim = query.shape
    kv, bf16 = key.shape, torch.bfloat16
    if not (len(kv) == 4 and kv == value.shape and kv[0] == batch and kv[3] == dim and heads % kv[1] == 0
            and dim in ATTENTION_DIMS and query.dtype is bf16 and key.dtype is bf16 and value.dtype is bf16
            and query.is_cpu and key.is_cpu and value.is_cpu):
        return None
    length = kv[2]
    if causal and (mask is not None or length < tokens):
        return None
    if mask is not None:
        if mask.dtype not in (bf16, torch.float32) or mask.shape != (batch, 1, tokens, length) or not mask.is_cpu:
            return None
        mask = _contiguous(mask)
    query = _contiguous(query)  # held while the kernel reads it
    # keys and values as they lie: each head's rows one after another, heads and batch rows at any stride (a growing
    # cache's views of its store)
    if key.stride()[2:] != (dim, 1) or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    out = torch.empty(batch, tokens, heads, dim, dtype=bf16)
    mask_at, mask_bf16 = (None, 0) if mask is None else (mask.data_ptr(), int(mask.dtype is bf16))
    failed = _library.bf16_attention(query.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
                                     mask_at, mask_bf16, int(causal), None, 0, None, out.data_ptr(), batch, heads,
                                     kv[1], tokens, length, dim, scale, torch.get_num_threads())
    if failed > 0:
        raise MemoryError("bf16_kernel: no memory for attention's scores")
    return None if failed else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` of bf16 tensors of one shape on the CPU, as torch rounds it (silu rounded to bf16, then the
    product) but for e^-x (within 2 ulp of torch's, so a last bit may differ), in one call: a SwiGLU MLP's
    activation, read from the parts of a stacked gate/up product as they lie. None where the kernel is not loaded or
    the inputs are not of that form."""
    if (_library is None or gate.dtype is not torch.bfloat16 or up.dtype is not torch.bfloat16 or gate.shape != up.shape
            or not gate.is_cpu or not up.is_cpu or gate.dim() == 0):
        return None
    g_row, u_row = _row_stride(gate), _row_stride(up)
    if g_row is None or u_row is None:
        return None
    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    _library.bf16_silu_mul(gate.data_ptr(), g_row, up.data_ptr(), u_row, out.data_ptr(), gate.numel() // max(width, 1),
                           width)
    return out


class KeyLayout:
    """A cache layer's keys as the kernel's attention reads them (AVX-512 build: 16 keys' bf16 pairs side by side),
    kept beside its key store and extended as keys are added, with how many slots are laid out (`laid`, which the
    kernel sets). Laying out every key again at every forward took ~40% of a one-token forward's attention (Zen 4
    EPYC). The kernel lays out again from the slots a forward writes, and from those a forward before it wrote (a
    verify forward's tree, compacted after it); other writers of the store call `written`."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys  # the store it is for
        batch, heads, slots, dim = keys.shape
        laid_out = _library is not None and keys.dtype is torch.bfloat16 and keys.is_cpu and keys.dim() == 4
        self.head = _library.bf16_key_layout(slots, dim) if laid_out else 0  # uint32s a head
        # None where the build reads the keys as they lie
        self.words = torch.empty(batch * heads * self.head, dtype=torch.int32) if self.head else None
        self.laid = ctypes.c_int32(0)

    @classmethod
    def of(cls, keys: torch.Tensor, made: "KeyLayout | None") -> "KeyLayout":
        """`made` where it is for the store `keys`, else a new one."""
        return made if made is not None and made.keys is keys else cls(keys)

    def written(self, slot: int) -> None:
        """Keys from `slot` on were written by others than the kernel: laid out again when next read."""
        self.laid.value = min(self.laid.value, slot)


class DecoderLayer:
    """A Llama-pattern decoder layer (RMSNorm, attention over a growing cache, residual; RMSNorm, SwiGLU MLP,
    residual) of bf16 rows in one call (`bf16_layers`): the same kernel functions the lean layer calls one by one
    (`rms_norm`, the products, `rope`, `attention`, `add_rms_norm`, `silu_mul`), so bitwise its output, without the
    ~20 torch ops and Python calls around them, which in situ took several times their warm time.
    Holds the norms' weights and the sizes; it is given the products' tiled weights (`tile`: the q/k/v and gate/up
    weights stacked, as `linears.linear_forms` keeps them) and the cache's stores (`set_weights`, `set_stores`, or at
    each call). `DecoderStack` runs several in one call."""

    pointed = 0  # how many times any layer's args were pointed at other stores (`set_stores`)

    def __init__(self, norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float, heads: int, key_heads: int,
                 head_dim: int, scale: float) -> None:
        self.args = args = LayerArgs()
        self.norms = tuple(w.detach().contiguous() for w in (norm_in, norm_post))
        args.norm_in, args.norm_post = (w.data_ptr() for w in self.norms)
        args.D, args.Hq, args.Hk, args.hd = norm_in.shape[-1], heads, key_heads, head_dim
        args.eps, args.scale, args.threads = eps, scale, torch.get_num_threads()
        self.tiled: tuple[torch.Tensor, ...] = ()  # the products' weights the args point to, and their float32 biases
        self.biases: tuple[torch.Tensor | None, ...] = ()
        self.stores: tuple[torch.Tensor, ...] = ()  # the cache stores the args point to
        self.alone = DecoderStack([self])  # this layer's calls by itself

    def set_weights(self, weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
        """Point the args at these (tiled weight, bias) of the q/k/v, o, gate/up and down products (where they are not
        those already); False where their sizes are not the layer's."""
        if len(weights) == 4 == len(self.tiled) and all(w is t for (w, _), t in zip(weights, self.tiled)):
            return True
        a = self.args
        shapes = [(t.shape[0] * TILE, t.shape[1] * 2) for t, _ in weights]
        width = shapes[2][0] // 2 if len(shapes) == 4 else 0
        if shapes != [((a.Hq + 2 * a.Hk) * a.hd, a.D), (a.D, a.Hq * a.hd), (2 * width, a.D), (a.D, width)] or not all(
                t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() for t, _ in weights):
            self.tiled = ()
            return False
        self.tiled = tuple(t for t, _ in weights)
        self.biases = tuple(None if b is None else b.detach().float().contiguous() for _, b in weights)
        a.qkv, a.o, a.gate_up, a.down = (t.data_ptr() for t in self.tiled)
        a.qkv_bias, a.o_bias, a.gate_up_bias, a.down_bias = (None if b is None else b.data_ptr() for b in self.biases)
        a.F = width
        return True

    def set_stores(self, keys: torch.Tensor, values: torch.Tensor, batch: int, end: int,
                   layout: KeyLayout | None = None) -> bool:
        """Point the args at these cache stores (B, key_heads, slots, head_dim), which must hold `end` slots for
        `batch` rows, and the keys' `layout` beside them (None: laid out at each call); False where they are not of
        that form."""
        if layout is not None and (layout.keys is not keys or layout.words is None):
            layout = None
        if len(self.stores) == 3 and keys is self.stores[0] and values is self.stores[1] and layout is self.stores[2]:
            return end <= keys.shape[2] and keys.shape[0] == batch
        a, bf16 = self.args, torch.bfloat16
        if not (keys.dim() == 4 and keys.shape == values.shape and keys.shape[0] == batch and keys.shape[1] == a.Hk
                and keys.shape[3] == a.hd and end <= keys.shape[2] and keys.dtype is bf16 and values.dtype is bf16
                and keys.is_contiguous() and values.is_contiguous() and keys.is_cpu and values.is_cpu):
            self.stores = ()
            return False
        self.stores = (keys, values, layout)
        DecoderLayer.pointed += 1
        a.keys, a.values, a.kv_row, a.kv_head = keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1)
        a.layout, a.layout_head, a.laid = ((None, 0, None) if layout is None else
                                           (layout.words.data_ptr(), layout.head, ctypes.addressof(layout.laid)))
        return True

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 weights: list[tuple[torch.Tensor, torch.Tensor | None]], keys: torch.Tensor, values: torch.Tensor,
                 length: int, mask: torch.Tensor | None, layout: KeyLayout | None = None, causal: bool = False
                 ) -> torch.Tensor | None:
        """The layer's output for x (B, T, D), by cos and sin (B, T, head_dim), writing the T new keys and values into
        slots `length` on of the stores `keys` and `values` (B, key_heads, slots, head_dim) (and the keys' `layout`),
        under `mask` (B, 1, T, length + T) additive, or None: one token that sees every key, or with `causal` each
        token the keys up to its own. None (nothing written) where the inputs are not of that form."""
        if x.dim() != 3 or not self.set_weights(weights) or not self.set_stores(keys, values, x.shape[0],
                                                                                 length + x.shape[1], layout):
            return None
        return self.alone(x, cos, sin, length, mask, causal)


class DecoderStack:
    """Decoder layers (`DecoderLayer`s of one size, their weights and stores set) run one after another in one call:
    a forward's Python work per layer, which in situ took ~90 us of SmolLM2's ~400 a layer (AVX2-only EPYC), once."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self.pointers = (ctypes.POINTER(LayerArgs) * len(layers))(*(ctypes.pointer(layer.args) for layer in layers))
        self.step = StepArgs()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int, mask: torch.Tensor | None,
                 causal: bool = False) -> torch.Tensor | None:
        """The layers' output for x (B, T, D) by cos and sin (B, T, head_dim), each writing its T new keys and values
        into its stores from slot `length` on, under `mask` or `causal` (as `DecoderLayer`); None where the inputs are
        not of that form (nothing written)."""
        if x.dim() != 3 or not self.layers:
            return None
        first, step, bf16 = self.layers[0].args, self.step, torch.bfloat16
        batch, tokens = x.shape[0], x.shape[1]
        if not (x.shape[2] == first.D and x.dtype is bf16 and x.is_cpu and x.is_contiguous()
                and cos.shape == sin.shape == (batch, tokens, first.hd) and cos.dtype is bf16 and sin.dtype is bf16):
            return None
        step.causal = 0
        if mask is None:
            if tokens != 1 and not causal:
                return None
            step.mask, step.mask_bf16, step.causal = None, 0, int(tokens > 1)
        else:
            if mask.dtype not in (bf16, torch.float32) or mask.shape != (batch, 1, tokens, length + tokens) or (
                    not mask.is_cpu):
                return None
            mask = _contiguous(mask)
            step.mask, step.mask_bf16 = mask.data_ptr(), int(mask.dtype is bf16)
        cos, sin = _contiguous(cos), _contiguous(sin)
        out = torch.empty_like(x)
        step.x, step.cos, step.sin, step.out = x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr()
        step.length, step.B, step.T = length, batch, tokens
        if _library.bf16_layers(self.pointers, len(self.layers), ctypes.byref(step)):
            raise MemoryError(f"bf16_kernel: no memory for decoder layers of {batch * tokens} rows")
        return out


def _rows_of(x: torch.Tensor, dim: int) -> bool:
    return x.dtype is torch.bfloat16 and x.is_cpu and x.dim() >= 1 and x.shape[-1] == dim and x.is_contiguous()


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def output_head(s: torch.Tensor, e: torch.Tensor, fc: tuple[torch.Tensor, torch.Tensor | None], norm_weight: torch.Tensor,
                eps: float) -> torch.Tensor | None:
    """Clover's output head, norm(s + silu(fc([s; e]))), of bf16 rows s and e (..., D) in one call: `fc` its weight
    tiled (`tile`, 2D inputs) and its bias (float32, or None); the norm as `rms_norm`. Where torch ran a
    concatenation, the product, silu, a sum and the norm, each a few times its warm time in situ. Rounds as those
    ops but for silu's e^-x. None where the inputs are not of that form."""
    dim = norm_weight.shape[-1]
    tiled, bias = fc
    if not (_rows_of(s, dim) and _rows_of(e, dim) and s.shape == e.shape and tiled.shape[0] * TILE == dim
            and tiled.shape[1] == dim and norm_weight.dtype is torch.bfloat16 and norm_weight.is_contiguous()):
        return None
    out = torch.empty_like(s)
    if _library.bf16_output_head(s.data_ptr(), e.data_ptr(), tiled.data_ptr(), _pointer(bias), norm_weight.data_ptr(),
                                 eps, out.data_ptr(), s.numel() // dim, dim, torch.get_num_threads()):
        raise MemoryError("bf16_kernel: no memory for an output head")
    return out


def attention_decoder(h: torch.Tensor, e: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      projections: list[tuple[torch.Tensor, torch.Tensor | None]], heads: int) -> torch.Tensor | None:
    """Clover's Attention Decoder, h + v(e) * cos(q(norm(h)), k(e)) per head, of bf16 rows h and e (..., D) in one
    call: `projections` q, k and v, each its weight tiled (`tile`) and its bias (float32, or None); the norm as
    `rms_norm`, the gate as `cosine_gate`. None where the inputs are not of that form."""
    dim = norm_weight.shape[-1]
    if not (_rows_of(h, dim) and _rows_of(e, dim) and h.shape == e.shape and dim % heads == 0
            and all(t.shape[0] * TILE == dim and t.shape[1] * 2 == dim for t, _ in projections)
            and norm_weight.dtype is torch.bfloat16 and norm_weight.is_contiguous()):
        return None
    out = torch.empty_like(h)
    (q, q_bias), (k, k_bias), (v, v_bias) = projections
    if _library.bf16_attention_decoder(h.data_ptr(), e.data_ptr(), norm_weight.data_ptr(), eps, q.data_ptr(),
                                       _pointer(q_bias), k.data_ptr(), _pointer(k_bias), v.data_ptr(), _pointer(v_bias),
                                       out.data_ptr(), h.numel() // dim, dim, heads, torch.get_num_threads()):
        raise MemoryError("bf16_kernel: no memory for an attention decoder")
    return out


class Features:
    """Clover's feature for drafting in one call (`bf16_features`): the input Attention Decoder over the new positions,
    the Augmenting Block's layers (`DecoderLayer`s, writing their keys and values into their cache stores) and the
    final norm, of the last position. The same kernels in the same order as the heads' modules call them one by one
    (`heads.CloverHeads.features`), so the same feature, without the torch ops and calls around them: the heads'
    catch-up took 0.64 against 0.90 ms a drafting step in situ (AVX2-only EPYC, medians)."""

    def __init__(self, in_norm: torch.Tensor, in_eps: float, heads: int, out_norm: torch.Tensor, out_eps: float,
                 layers: list[DecoderLayer]) -> None:
        self.args = args = FeatureArgs()
        self.norms = tuple(w.detach().contiguous() for w in (in_norm, out_norm))
        args.in_norm, args.out_norm = (w.data_ptr() for w in self.norms)
        args.D, args.heads, args.threads = in_norm.shape[-1], heads, torch.get_num_threads()
        args.in_eps, args.out_eps = in_eps, out_eps
        self.projections: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] = ()  # what the args point to
        self.stack = DecoderStack(layers)

    def set_projections(self, projections: list[tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
        """Point the args at the input decoder's q, k and v (each its tiled weight and float32 bias, or None); False
        where they are not of its size."""
        if len(projections) == 3 == len(self.projections) and all(
                p[0] is q[0] and p[1] is q[1] for p, q in zip(projections, self.projections)):
            return True
        dim, bf16 = self.args.D, torch.bfloat16
        if len(projections) != 3 or dim % self.args.heads or not all(
                t.shape == (dim // TILE, dim // 2, TILE, 2) and t.dtype is bf16 and t.is_cpu and t.is_contiguous()
                and (b is None or (b.shape == (dim,) and b.dtype is torch.float32 and b.is_contiguous()))
                for t, b in projections):
            self.projections = ()
            return False
        self.projections = tuple(projections)
        a = self.args
        (a.q, a.q_bias), (a.k, a.k_bias), (a.v, a.v_bias) = ((t.data_ptr(), _pointer(b)) for t, b in projections)
        return True

    def __call__(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 tables: tuple[torch.Tensor, torch.Tensor], length: int,
                 projections: list[tuple[torch.Tensor, torch.Tensor | None]],
                 weights: list[list[tuple[torch.Tensor, torch.Tensor | None]]],
                 stores: list[tuple[torch.Tensor, torch.Tensor]], layouts: list[KeyLayout | None] | None = None
                 ) -> torch.Tensor | None:
        """The last position's feature (D,) for bf16 `hidden` and `embeds` (1, T, D) at `positions` (1, T), whose
        rotary cos and sin are rows of `tables` (P, head_dim), each layer (`weights` as `DecoderLayer.set_weights`
        takes them) writing its T new keys and values into its `stores` from slot `length` on (and their keys'
        `layouts`, where given). None (nothing written) where the inputs are not of that form or a position is not in
        the tables."""
        dim, bf16, layers = self.args.D, torch.bfloat16, self.stack.layers
        if not (hidden.dim() == 3 and hidden.shape == embeds.shape and hidden.shape[0] == 1 and hidden.shape[2] == dim
                and hidden.dtype is bf16 and embeds.dtype is bf16 and hidden.is_cpu and embeds.is_cpu
                and len(weights) == len(stores) == len(layers) and self.set_projections(projections)):
            return None
        tokens, (cos, sin) = hidden.shape[1], tables
        if not (tokens and positions.shape == (1, tokens) and positions.dtype is torch.int64 and positions.is_cpu
                and cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == layers[0].args.hd
                and cos.dtype is bf16 and sin.dtype is bf16 and cos.is_contiguous() and sin.is_contiguous()):
            return None
        for layer, weight, (keys, values), layout in zip(layers, weights, stores, layouts or [None] * len(stores)):
            if not (layer.args.D == dim and layer.set_weights(weight)
                    and layer.set_stores(keys, values, 1, length + tokens, layout)):
                return None
        hidden, embeds, positions = _contiguous(hidden), _contiguous(embeds), _contiguous(positions)
        feature = torch.empty(dim, dtype=bf16)
        failed = _library.bf16_features(ctypes.byref(self.args), self.stack.pointers, len(layers), hidden.data_ptr(),
                                        embeds.data_ptr(), tokens, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                        cos.shape[0], length, feature.data_ptr())
        if failed == 1:
            raise MemoryError(f"bf16_kernel: no memory for the features of {tokens} positions")
        return None if failed else feature


class StaticDraft:
    """Clover's heads drafting a static tree in one call (`bf16_draft_levels`): at each level the regressive Attention
    Decoder (after the first), the level's output head, the lm_head's int8 draft rows (`int8_product`) and `top_probs`,
    the same kernels in the same order as the heads' modules call them level by level, so the same tokens and
    probabilities, without the ~10 torch ops and calls a level around them (~0.3 ms a level in situ, AVX2-only EPYC).

    `levels`: the tree's levels (`tree.TreeLevel`: index tensors on the CPU); `weights`: per level, its output head's
    (tiled fc weight, float32 bias or None, norm weight, eps) and the regressive decoder's q, k, v as (tiled weight,
    float32 bias or None) for the level's row count (none at the first level); `regressive_norm`: (weight, eps);
    `lm_rows`: `int8_product`'s (tiled rows, scales, bias); `token_ids`: the vocabulary token of each draft row
    (None: its own index); `embedding`: the (vocabulary, D) table that embeds tokens."""

    def __init__(self, levels, weights: list[tuple[tuple, list[tuple[torch.Tensor, torch.Tensor | None]]]],
                 regressive_norm: tuple[torch.Tensor, float], heads: int, lm_rows: tuple, token_ids: torch.Tensor | None,
                 embedding: torch.Tensor) -> None:
        a, dim = DraftArgs(), embedding.shape[1]
        indices = [None if t is None else t.to(torch.int64).contiguous()
                   for level in levels
                   for t in (level.parent_of_expanded, level.child_parent, level.child_rank, level.next_expanded)]
        self.keep = (indices, weights, regressive_norm, lm_rows, token_ids, embedding)  # what the pointers point into
        a.D, a.heads, a.rows, a.threads = dim, heads, lm_rows[0].shape[0] * TILE, torch.get_num_threads()
        a.reg_norm, a.reg_eps = regressive_norm[0].data_ptr(), regressive_norm[1]
        a.lm_w, a.lm_scales, a.lm_bias = (_pointer(t) for t in lm_rows)
        a.token_ids, a.embedding = _pointer(token_ids), embedding.data_ptr()
        self.args, self.levels = a, (DraftLevel * len(levels))()
        self.drafted = 0
        for d, (level, ((fc, fc_bias, norm, eps), regressive)) in enumerate(zip(levels, weights)):
            L = self.levels[d]
            parent_of_expanded, child_parent, child_rank, next_expanded = indices[4 * d : 4 * d + 4]
            L.k, L.children = level.k, child_parent.shape[0]
            L.expanded = 1 if parent_of_expanded is None else parent_of_expanded.shape[0]
            L.next = 0 if next_expanded is None else next_expanded.shape[0]
            L.parent_of_expanded, L.child_parent, L.child_rank, L.next_expanded = (
                _pointer(t) for t in (parent_of_expanded, child_parent, child_rank, next_expanded))
            if regressive:
                (q, q_bias), (k, k_bias), (v, v_bias) = regressive
                L.q, L.k_w, L.v, L.q_bias, L.k_bias, L.v_bias = (_pointer(t) for t in (q, k, v, q_bias, k_bias, v_bias))
            L.fc, L.fc_bias, L.head_norm, L.head_eps = fc.data_ptr(), _pointer(fc_bias), norm.data_ptr(), eps
            self.drafted += L.children

    @staticmethod
    def fits(levels, weights, lm_rows: tuple, token_ids: torch.Tensor | None, embedding: torch.Tensor) -> bool:
        """Whether the call takes these (as `__init__` takes them): contiguous bf16 weights on the CPU of one size,
        top-k within `TOP_MOST` and the draft rows, and draft tokens (int64 ids, or the rows' own indices) that the
        embedding holds (its torch lookup would refuse others; the kernel would read past it)."""
        dim, rows = embedding.shape[-1], lm_rows[0].shape[0] * TILE
        tensors = [embedding] + [t for (fc, _, norm, _), regressive in weights
                                 for t in (fc, norm, *(w for w, _ in regressive))]
        if token_ids is None:
            tokens_fit = rows <= embedding.shape[0]
        else:
            tokens_fit = (token_ids.dtype is torch.int64 and token_ids.is_cpu and token_ids.is_contiguous()
                          and token_ids.shape == (rows,)
                          and 0 <= int(token_ids.min()) and int(token_ids.max()) < embedding.shape[0])
        return (available() and embedding.dim() == 2 and tokens_fit and all(
            t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() for t in tensors)
                and all(0 < level.k <= min(TOP_MOST, rows) for level in levels)
                and all(fc.shape[0] * TILE == dim and fc.shape[1] == dim and all(
                    w.shape[0] * TILE == dim and w.shape[1] * 2 == dim for w, _ in regressive)
                        for (fc, _, _, _), regressive in weights))

    def __call__(self, feature: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted tokens (n,) of every level, level after level, and their probabilities (n,) (float32)."""
        feature = _contiguous(feature)
        tokens, probs = torch.empty(self.drafted, dtype=torch.int64), torch.empty(self.drafted)
        if _library.bf16_draft_levels(ctypes.byref(self.args), self.levels, len(self.levels), feature.data_ptr(), root,
                                      tokens.data_ptr(), probs.data_ptr()):
            raise MemoryError("bf16_kernel: no memory to draft a tree")
        return tokens, probs


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between the rows (last dimension) of `t` where they lie at one stride, each contiguous; else None."""
    shape, stride = t.shape, t.stride()
    if shape[-1] > 1 and stride[-1] != 1:
        return None
    row = None
    for i in range(t.dim() - 2, -1, -1):  # inner to outer: each dimension of more than one a multiple of the next
        if shape[i] == 1:
            continue
        if row is None:
            row, span = stride[i], stride[i] * shape[i]
        elif stride[i] != span:
            return None
        else:
            span *= shape[i]
    return shape[-1] if row is None else row


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
