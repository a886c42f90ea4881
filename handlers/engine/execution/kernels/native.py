"""Native kernels of the engine: built from C at first use, called through ctypes, optional.

Design note: ``csrc/paged_attention.c`` (and ``prefill_attention.c``, ``elementwise.c``, ``argmax.c``, ``rotary.c``,
``panel_linear.c``)
is plain C (no torch headers), so building it takes about a second with the system compiler (``cc -O3 -march=native
-fopenmp``). The shared object is cached per source, headers, compiler flags and CPU
(``~/.cache/rollserve/kernels``, else a temporary folder) and written atomically, so concurrent workers may build it
at once. When no compiler is found or the build fails, ``load_kernels`` returns None and the engine keeps its pure-
PyTorch path (logged once): the kernel is a speed-up, never a requirement. Runs in the worker process (and every
tensor-parallel rank).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from handlers.engine.planning.cpu import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# flags a source adds: the rotary kernel's products must round as torch's unfused ones do
SOURCE_FLAGS = {"rotary.c": ("-ffp-contract=off",)}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class PagedKernels:
    """The loaded shared objects; ``decode`` runs one layer's decode rows of every sequence in one call,
    ``write_kv`` writes one layer's new keys and values into their pool slots, ``prefill`` attends a prompt chunk
    (when ``csrc/prefill_attention.c`` built)."""

    def __init__(self, lib: ctypes.CDLL, prefill_lib: ctypes.CDLL | None = None) -> None:
        self._prefill = None
        if prefill_lib is not None:
            self._prefill = prefill_lib.rollserve_prefill_attention
            self._prefill.restype = ctypes.c_int
            self._prefill.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64,
                                      _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]
        self._fn = lib.rollserve_paged_decode
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, ctypes.c_int, _I64, _I64, _PTR, _I64, _I64,
                             _PTR, _PTR,
                             _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int]
        self._write = lib.rollserve_write_kv
        self._write.restype = ctypes.c_int
        self._write.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64,
                                _I64, _I64, ctypes.c_int]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """``k_cache[:, slots] = key`` and the same for values, one row copy per (token, head) instead of
        ``index_copy_``'s element-wise loop. Measured on the 110m model's layer (12 KV heads of 64, AVX2-only
        EPYC): keys and values of 32 tokens 93 -> 43 us on one thread, 113 -> 30 us on two; of 2048 tokens
        19.7 -> 6.0 ms and 10.5 -> 2.4 ms. ``index_copy_`` was 4.2 ms of a 32-sequence decode step (110-125 ms,
        two threads). ``key``/``value`` [Hkv, T, D] of the pool's dtype with D contiguous, pools [Hkv, S, D]
        contiguous, ``slots`` [T] int64 contiguous. Returns False when the layouts are beyond it (the caller
        then uses ``index_copy_``)."""
        if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
                and key.dtype in (torch.float32, torch.bfloat16) and key.stride(2) == 1 and value.stride(2) == 1
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and key.shape == value.shape and key.shape[0] == k_cache.shape[0] and key.shape[2] == k_cache.shape[2]
                and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == key.shape[1]):
            return False
        rc = self._write(key.data_ptr(), key.stride(1), key.stride(0), value.data_ptr(), value.stride(1),
                         value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                         k_cache.shape[1], slots.data_ptr(), key.shape[1], key.shape[0], key.shape[2],
                         key.element_size(), torch.get_num_threads())
        return rc == 0

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               meta: torch.Tensor, tables: torch.Tensor, block_size: int, scale: float, softcap: float | None,
               sinks: torch.Tensor | None) -> bool:
        """Attention of the decode rows listed in ``meta`` ([n, 4] int64: query row, first key position, end
        key position, offset of the block table in ``tables`` int32). ``query`` [1, H, T, D] fp32 or bf16 (D
        contiguous), pools [Hkv, S, D] contiguous fp32 or bf16, ``out`` [1, T, H, D] contiguous, of the
        query's dtype.
        Returns False when the shapes are beyond the kernel (the caller then uses its fallback)."""
        num_heads, head_dim = query.shape[1], query.shape[3]
        sink_ptr = None
        if sinks is not None:
            sinks = sinks.detach().float().contiguous()
            sink_ptr = sinks.data_ptr()
        if query.dtype not in (torch.float32, torch.bfloat16) or out.dtype != query.dtype:
            return False
        rc = self._fn(query.data_ptr(), int(query.dtype == torch.bfloat16), query.stride(2), query.stride(1),
                      k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
                      k_cache.stride(0), k_cache.stride(1), out.data_ptr(), out.stride(1), out.stride(2),
                      meta.data_ptr(), tables.data_ptr(), meta.shape[0], num_heads, k_cache.shape[0], head_dim,
                      block_size, scale, float(softcap or 0.0), sink_ptr, torch.get_num_threads())
        return rc == 0


    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, window: int,
                scale: float) -> bool:
        """Causal attention of a prompt chunk (``csrc/prefill_attention.c``): ``query`` [n, H, D], ``out`` [n, H, D]
        with any row and head strides, ``key``/``value`` [Hkv, L, D] (L >= n: the chunk's rows are the last n keys'
        positions), all fp32 with D contiguous; ``window`` 0 or the sliding window. Returns False, having written
        nothing that counts, when the shapes are beyond the kernel (the caller then uses SDPA)."""
        if self._prefill is None:
            return False
        tensors = (query, key, value, out)
        if not (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3 and t.stride(2) == 1
                    for t in tensors)
                and key.shape == value.shape and query.shape == out.shape and key.shape[2] == query.shape[2]):
            return False
        n, heads, d = query.shape
        rc = self._prefill(query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0),
                           key.stride(1), value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(),
                           out.stride(0), out.stride(1), n, key.shape[1], window, heads, key.shape[0], d, scale,
                           torch.get_num_threads())
        return rc == 0


class ArgmaxKernel:
    """``csrc/argmax.c``: the greedy token of each row of a step's logits, as ``torch.argmax`` chooses it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rollserve_argmax_rows
        self._fn.restype = None
        self._fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int]

    def rows(self, logits: torch.Tensor) -> list[int] | None:
        """The first index of each row's largest value (NaN the largest); None for a layout it does not take
        (not fp32 [rows, V] on the CPU with contiguous columns): the caller then uses ``torch.argmax``."""
        if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
                or logits.shape[1] == 0 or logits.stride(1) != 1):
            return None
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        self._fn(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                 torch.get_num_threads())
        return out.tolist()


@lru_cache(maxsize=1)
def load_argmax() -> ArgmaxKernel | None:
    """The greedy-choice kernel, built at first use; None where it cannot be built."""
    lib = shared_library("argmax.c", "greedy rows use torch.argmax")
    return None if lib is None else ArgmaxKernel(lib)


class RotaryKernel:
    """``csrc/rotary.c``: transformers' rotate-half rotary embedding in one pass, bitwise torch's result."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.rollserve_rotary
        self._fn.restype = None
        self._fn.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """``x * cos + rotate_half(x) * sin`` for ``x`` [T, H, D] and ``cos``/``sin`` [T, 1, D] (broadcast over
        heads); None for a layout it does not take (not fp32 on the CPU, D not contiguous or odd, tables not
        [T, D] contiguous): the caller then runs torch's operations."""
        t, heads, d = x.shape
        if (x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(2) != 1 or d % 2
                or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != (t, 1, d)
                or sin.shape != (t, 1, d) or not cos.is_contiguous() or not sin.is_contiguous()):
            return None
        out = torch.empty(t, heads, d, device=x.device)
        self._fn(x.data_ptr(), t, heads, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                 torch.get_num_threads())
        return out


@lru_cache(maxsize=1)
def load_rotary() -> RotaryKernel | None:
    """The rotary kernel, built at first use; None where it cannot be built."""
    lib = shared_library("rotary.c", "the rotary embedding runs as torch operations")
    return None if lib is None else RotaryKernel(lib)


class ElementwiseKernels:
    """``csrc/elementwise.c``: RMSNorm, the residual add fused with the next RMSNorm, and silu(gate) * up, each one
    pass over fp32 rows on the CPU (the last bits differ from torch's: ``lean.py`` checks the forward at load)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.rollserve_rms_norm
        self._norm.restype = None
        self._norm.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, _I64, ctypes.c_int]
        self._add_norm = lib.rollserve_add_rms_norm
        self._add_norm.restype = None
        self._add_norm.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, _I64, ctypes.c_int]
        self._silu_mul = lib.rollserve_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, ctypes.c_int]

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """Whether every tensor is one the kernels read: fp32 on the CPU, 2-D rows (1-D weights) with contiguous
        columns."""
        return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() in (1, 2) and t.stride(-1) == 1
                   for t in tensors)

    def _fits(self, rows: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.takes(rows, weight) and rows.dim() == 2 and weight.shape == rows.shape[1:]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2) + eps))`` per row of ``x`` [T, C] (torch's where the layout is not the
        kernel's: a projection of some other kind may hand over another dtype)."""
        if not self._fits(x, weight):
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(),
                   out.stride(0), torch.get_num_threads())
        return out

    def add_rms_norm(self, a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``residual += a`` (in place), then returns its RMSNorm; both [T, C]."""
        if not (self._fits(residual, weight) and self.takes(a) and a.shape == residual.shape):
            residual += a  # torch's whole, as for the other layouts the kernels do not read
            return F.rms_norm(residual, residual.shape[-1:], weight, eps)
        out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        self._add_norm(a.data_ptr(), a.stride(0), residual.data_ptr(), residual.stride(0), residual.shape[0],
                       residual.shape[1], weight.data_ptr(), eps, out.data_ptr(), out.stride(0),
                       torch.get_num_threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, both [T, I] (rows may be slices of one wider tensor)."""
        if not (self.takes(gate, up) and gate.dim() == 2 and gate.shape == up.shape):
            return F.silu(gate) * up
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        self._silu_mul(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), gate.shape[0], gate.shape[1],
                       out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out


@lru_cache(maxsize=1)
def load_elementwise() -> ElementwiseKernels | None:
    """The fused element-wise kernels, built at first use; None where they cannot be built."""
    lib = shared_library("elementwise.c", "norms and the MLP's activation run as torch operations")
    return None if lib is None else ElementwiseKernels(lib)


@lru_cache(maxsize=1)
def load_kernels() -> PagedKernels | None:
    """Build (or find in the cache) and load the kernels; None when they cannot be built here."""
    lib = shared_library("paged_attention.c", "the engine uses its PyTorch attention path (slower decode)")
    if lib is None:
        return None
    return PagedKernels(lib, shared_library("prefill_attention.c", "prompt chunks use SDPA"))


def shared_library(source_name: str, without: str) -> ctypes.CDLL | None:
    """``csrc/source_name`` built with FLAGS (and its SOURCE_FLAGS) for this CPU (cached by source, flags and CPU
    features) and loaded; None, logged once with ``without`` (what the caller does instead), when it cannot be
    built. One process builds it while the others that need it wait (the largest takes half a minute)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s", without)
        return None
    source = CSRC / source_name
    flags = (*FLAGS, *SOURCE_FLAGS.get(source_name, ()))
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            with open(target.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not target.exists():  # else another process built it while this one waited
                    _build(compiler, source, target, flags)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("building %s failed (%s %s): %s", source.name, exc, detail.decode(errors="replace")[-500:],
                       without)
        return None


def _build(compiler: str, source: Path, target: Path, flags: tuple[str, ...]) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], check=True, capture_output=True,
                       timeout=600)  # a loaded machine (a test run beside it) takes minutes for the largest
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file is fine either way
        logger.info("built %s", target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cache_dir() -> Path:
    """The folder of built kernels and kernel timings: ~/.cache/rollserve/kernels, else a temporary one."""
    for candidate in (Path.home() / ".cache" / "rollserve" / "kernels",
                      Path(tempfile.gettempdir()) / f"rollserve-kernels-{os.getuid()}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise OSError("no writable folder for the kernel cache")


def main() -> None:
    """Build every kernel of ``csrc`` for this CPU into the cache ahead of the first worker that needs one (the
    test command runs it while the test model is fetched), the largest first, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sources = sorted((p.name for p in CSRC.glob("*.c")), key=lambda n: -(CSRC / n).stat().st_size)
    with ThreadPoolExecutor(2) as pool:
        libs = pool.map(lambda n: shared_library(n, "built at first use instead"), sources)
        for name, lib in zip(sources, libs, strict=True):
            print(f"{name}: {'built' if lib is not None else 'not built'}")


if __name__ == "__main__":
    main()
