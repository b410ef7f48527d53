"""Small C loops for hot paths, compiled on first use with the system's C compiler and loaded with ctypes.

* the diff's compare of float32/bfloat16 pairs: every metric in two passes, where numpy takes ~15 a chunk (widen,
  subtract, square, sum, the ULP test, the floored ratio);
* HDF5's shuffle filter: the byte planes split and put back together in one pass each;
* a record's statistics on the host (``stats.host_stats``: min, max, sum, sum of squares, NaN and Inf counts): one
  pass instead of six;
* the launch of capture's CUDA statistics kernel (``cuda_stats.py``): one foreign call with the kernel's arguments,
  ~1 µs of host time less a record than setting ctypes' argument buffers under a lock.

Built once per machine into the user's cache (``$XDG_CACHE_HOME/tensordiff`` or ``~/.cache/tensordiff``, keyed by
the source, the compiler and the CPU) by ``cc -O3 -march=native``: no wheel to build, nothing to install. Without a
compiler, or when the build or its self-check fails, ``lib()`` is None and the callers keep their numpy paths
(``TENSORDIFF_NATIVE=0`` chooses them on purpose); the results are the same to float64 rounding. A training process
that captures builds it at its first CPU record on a machine that has no cached build yet (~0.5 s, once).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any

#: float32 and bfloat16 (the other narrow floats stay on numpy's path).
DTYPE_CODES = {"float32": 0, "bfloat16": 1}

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

static inline float f_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The chunk loops of each dtype pair: A in TA, B in TB (float or uint16_t = bfloat16), LA/LB load one as float. */
#define LOAD_F32(p, i) (((const float *)(p))[i])
#define LOAD_BF16(p, i) f_bf16(((const uint16_t *)(p))[i])

#define SUMSQ(NAME, LOAD)                                                                                   \
int NAME(const void *a, int64_t n, double *out) {                                                            \
    double acc = 0.0; uint32_t special = 0;                                                                  \
    for (int64_t s = 0; s < n; s += 4096) {                                                                  \
        int64_t e = s + 4096 < n ? s + 4096 : n; double part = 0.0;                                          \
        _Pragma("omp simd reduction(+:part) reduction(|:special)")                                           \
        for (int64_t i = s; i < e; i++) {                                                                    \
            float x = LOAD(a, i); double xd = x; part += xd * xd;                                            \
            special |= (uint32_t)((bits(x) & 0x7F800000u) == 0x7F800000u);                                   \
        }                                                                                                    \
        acc += part;                                                                                         \
    }                                                                                                        \
    *out = acc; return special ? 1 : 0;                                                                      \
}
SUMSQ(td_sumsq_f32, LOAD_F32)
SUMSQ(td_sumsq_bf16, LOAD_BF16)

/* out: diff_sq, b_sq, dot, max_abs, max_rel, within (as a double). Returns 1 (nothing written) when an element of
   either side is NaN or Inf: the caller's float64 path handles those. */
#define COMPARE(NAME, LA, LB)                                                                                \
int NAME(const void *a, const void *b, int64_t n, float floor_, float ulp_floor, float scale, double *out) { \
    double diff_sq = 0, b_sq = 0, dot = 0; float max_abs = 0, max_rel = 0; int64_t within = 0;               \
    uint32_t special = 0;                                                                                    \
    for (int64_t s = 0; s < n; s += 4096) {                                                                  \
        int64_t e = s + 4096 < n ? s + 4096 : n;                                                             \
        double pd = 0, pb = 0, pab = 0; float ma = 0, mr = 0; int64_t w = 0;                                 \
        _Pragma("omp simd reduction(+:pd,pb,pab,w) reduction(max:ma,mr) reduction(|:special)")              \
        for (int64_t i = s; i < e; i++) {                                                                    \
            float x = LA(a, i), y = LB(b, i);                                                                \
            uint32_t ex = bits(x) & 0x7F800000u, ey = bits(y) & 0x7F800000u;                                 \
            special |= (uint32_t)(ex == 0x7F800000u) | (uint32_t)(ey == 0x7F800000u);                        \
            float d = x - y; d = d < 0 ? -d : d;                                                             \
            double dd = d, yd = y;                                                                           \
            pd += dd * dd; pb += yd * yd; pab += (double)x * yd;                                             \
            ma = d > ma ? d : ma;                                                                            \
            float lim = from_bits(ex > ey ? ex : ey) * scale; lim = lim > ulp_floor ? lim : ulp_floor;        \
            w += d <= lim;                                                                                   \
            float ax = x < 0 ? -x : x; ax = ax > floor_ ? ax : floor_;                                       \
            float r = d / ax; mr = r > mr ? r : mr;                                                          \
        }                                                                                                    \
        diff_sq += pd; b_sq += pb; dot += pab; within += w;                                                  \
        max_abs = ma > max_abs ? ma : max_abs; max_rel = mr > max_rel ? mr : max_rel;                        \
        if (special) return 1;                                                                               \
    }                                                                                                        \
    out[0] = diff_sq; out[1] = b_sq; out[2] = dot; out[3] = max_abs; out[4] = max_rel; out[5] = (double)within; \
    return 0;                                                                                                \
}
COMPARE(td_compare_0_0, LOAD_F32, LOAD_F32)
COMPARE(td_compare_0_1, LOAD_F32, LOAD_BF16)
COMPARE(td_compare_1_0, LOAD_BF16, LOAD_F32)
COMPARE(td_compare_1_1, LOAD_BF16, LOAD_BF16)

/* A record's statistics by the rule of tensordiff/stats.py: out = [min, max, sum, l2^2, nan, inf], min, max and the
   sums over the finite elements only (min and max 0 when there is none), sums in float64. A fast pass first, for
   tensors without NaN/Inf (nearly all): plain min, max and sums, and a count of the non-finite; only when that count
   is not 0, the careful pass. */
#define STATS(NAME, T, FINITE, ISNAN)                                                                        \
void NAME(const T *x, int64_t n, double *out) {                                                              \
    double s = 0, q = 0; T mn = x[0], mx = x[0]; int64_t special = 0;                                        \
    for (int64_t b = 0; b < n; b += 4096) {                                                                  \
        int64_t e = b + 4096 < n ? b + 4096 : n; double ps = 0, pq = 0; T lo = mn, hi = mx; int32_t sp = 0;  \
        _Pragma("omp simd reduction(+:ps,pq,sp) reduction(min:lo) reduction(max:hi)")                       \
        for (int64_t i = b; i < e; i++) {                                                                    \
            T v = x[i]; double d = (double)v; ps += d; pq += d * d;                                          \
            lo = v < lo ? v : lo; hi = v > hi ? v : hi; sp += !FINITE(v);                                    \
        }                                                                                                    \
        s += ps; q += pq; mn = lo; mx = hi; special += sp;                                                   \
    }                                                                                                        \
    if (!special) {                                                                                          \
        out[0] = (double)mn; out[1] = (double)mx; out[2] = s; out[3] = q; out[4] = 0; out[5] = 0; return;    \
    }                                                                                                        \
    s = 0; q = 0; mn = 0; mx = 0; int64_t nan = 0, inf = 0, fin_seen = 0;                                    \
    for (int64_t b = 0; b < n; b += 4096) {                                                                  \
        int64_t e = b + 4096 < n ? b + 4096 : n; double ps = 0, pq = 0; int64_t pn = 0, pi = 0;              \
        T lo = 0, hi = 0; int have = 0;                                                                      \
        for (int64_t i = b; i < e && !have; i++) if (FINITE(x[i])) { lo = hi = x[i]; have = 1; }             \
        _Pragma("omp simd reduction(+:ps,pq,pn,pi) reduction(min:lo) reduction(max:hi)")                     \
        for (int64_t i = b; i < e; i++) {                                                                    \
            T v = x[i]; int f = FINITE(v); T w = f ? v : (T)0; double d = (double)w;                         \
            ps += d; pq += d * d; pn += !f && ISNAN(v); pi += !f && !ISNAN(v);                               \
            lo = (f && v < lo) ? v : lo; hi = (f && v > hi) ? v : hi;                                        \
        }                                                                                                    \
        s += ps; q += pq; nan += pn; inf += pi;                                                              \
        if (have) { if (!fin_seen) { mn = lo; mx = hi; fin_seen = 1; }                                      \
                    else { mn = lo < mn ? lo : mn; mx = hi > mx ? hi : mx; } }                               \
    }                                                                                                        \
    out[0] = (double)mn; out[1] = (double)mx; out[2] = s; out[3] = q; out[4] = (double)nan; out[5] = (double)inf; \
}
static inline int fin32(float v) { return (bits(v) & 0x7F800000u) != 0x7F800000u; }
static inline int nan32(float v) { return (bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }
static inline int fin64(double v) { uint64_t u; memcpy(&u, &v, 8); return (u & 0x7FF0000000000000ull) != 0x7FF0000000000000ull; }
static inline int nan64(double v) { uint64_t u; memcpy(&u, &v, 8); return (u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
STATS(td_stats_f32, float, fin32, nan32)
STATS(td_stats_f64, double, fin64, nan64)

/* HDF5's shuffle: byte j of element i to planes[j * n + i]. */
void td_shuffle(const uint8_t *raw, int64_t n, int64_t itemsize, uint8_t *planes) {
    if (itemsize == 2) {
        const uint16_t *w = (const uint16_t *)raw; uint8_t *p0 = planes, *p1 = planes + n;
        for (int64_t i = 0; i < n; i++) { p0[i] = (uint8_t)w[i]; p1[i] = (uint8_t)(w[i] >> 8); }
    } else if (itemsize == 4) {
        const uint32_t *w = (const uint32_t *)raw;
        uint8_t *p0 = planes, *p1 = planes + n, *p2 = planes + 2 * n, *p3 = planes + 3 * n;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = w[i]; p0[i] = (uint8_t)v; p1[i] = (uint8_t)(v >> 8); p2[i] = (uint8_t)(v >> 16);
            p3[i] = (uint8_t)(v >> 24);
        }
    } else {
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < itemsize; j++) planes[j * n + i] = raw[i * itemsize + j];
    }
}

/* One launch of capture's CUDA statistics kernel (capturing/torch/cuda_stats.py) through the driver's cuLaunchKernel,
   given by address: its six arguments on this stack, no driver header or library needed to build this file. */
typedef int (*td_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
int td_cuda_launch(void *launch, void *kernel, uint64_t x, int64_t n, uint64_t out, uint64_t part, uint64_t counter,
                   int32_t row, uint32_t blocks, uint32_t threads, void *stream) {
    void *params[6] = {&x, &n, &out, &part, &counter, &row};
    return ((td_launch_fn)launch)(kernel, blocks, 1, 1, threads, 1, 1, 0, stream, params, 0);
}

/* HDF5's shuffle undone: planes[j * n + i] is byte j of element i; out gets the first m elements. */
void td_unshuffle(const uint8_t *planes, int64_t n, int64_t itemsize, int64_t m, uint8_t *out) {
    if (itemsize == 2) {
        const uint8_t *p0 = planes, *p1 = planes + n; uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < m; i++) o[i] = (uint16_t)(p0[i] | ((uint16_t)p1[i] << 8));
    } else if (itemsize == 4) {
        const uint8_t *p0 = planes, *p1 = planes + n, *p2 = planes + 2 * n, *p3 = planes + 3 * n;
        uint32_t *o = (uint32_t *)out;
        for (int64_t i = 0; i < m; i++)
            o[i] = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
    } else {
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < itemsize; j++) out[i * itemsize + j] = planes[j * n + i];
    }
}
"""

_lock = threading.Lock()
_state: dict[str, Any] = {}


def lib() -> Any:
    """The loaded library (ctypes.CDLL with its argument types set), or None: no compiler, a failed build or
    self-check, or ``TENSORDIFF_NATIVE=0``. Built once per machine, loaded once per process."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            _state["lib"] = None
            if os.environ.get("TENSORDIFF_NATIVE", "1") != "0":
                try:
                    _state["lib"] = _load()
                except Exception as err:  # numpy's path is always there
                    _state["why"] = f"{type(err).__name__}: {err}"
        return _state["lib"]


#: glibc's malloc gives blocks above 32 MiB back to the system as soon as they are freed and maps them again, page
#: by page, at the next allocation: a diff allocates and frees a tensor's worth for every record (inflated chunks,
#: arrays), and those page faults were a third of its reading time. Blocks up to this size stay in the heap.
MMAP_THRESHOLD = 64 << 20
#: ... and up to this much freed memory stays with the process (RSS does not grow: the same blocks are reused).
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for a process that allocates and frees large blocks over and over (``MMAP_THRESHOLD``):
    the diff's own processes call it, never a training process. False where this is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))


def why_not() -> str:
    """Why ``lib()`` is None ('' when it is loaded or was not asked for)."""
    return str(_state.get("why", ""))


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tensordiff")


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = [ln for ln in fh.read().splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _load() -> Any:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([_SOURCE, cc, *flags, _cpu(), platform.machine()]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"native-{key}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
            src = os.path.join(tmp, "native.c")
            with open(src, "w", encoding="utf-8") as fh:
                fh.write(_SOURCE)
            out = os.path.join(tmp, "native.so")
            proc = subprocess.run([cc, *flags, src, "-o", out], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-300:]}")
            os.replace(out, path)  # atomic: a concurrent build writes the same bytes
    so = ctypes.CDLL(path)
    p, i64, f32, dp = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.POINTER(ctypes.c_double)
    for name in ("td_sumsq_f32", "td_sumsq_bf16"):
        fn = getattr(so, name)
        fn.argtypes, fn.restype = [p, i64, dp], ctypes.c_int
    for ca in DTYPE_CODES.values():
        for cb in DTYPE_CODES.values():
            fn = getattr(so, f"td_compare_{ca}_{cb}")
            fn.argtypes, fn.restype = [p, p, i64, f32, f32, f32, dp], ctypes.c_int
    so.td_unshuffle.argtypes, so.td_unshuffle.restype = [p, i64, i64, i64, p], None
    so.td_shuffle.argtypes, so.td_shuffle.restype = [p, i64, i64, p], None
    for name in ("td_stats_f32", "td_stats_f64"):
        fn = getattr(so, name)
        fn.argtypes, fn.restype = [p, i64, dp], None
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    so.td_cuda_launch.argtypes = [p, p, u64, i64, u64, u64, u64, ctypes.c_int32, u32, u32, p]
    so.td_cuda_launch.restype = ctypes.c_int
    _self_check(so)
    return so


def _self_check(so: Any) -> None:
    """The build computes what it must (a wrong flag or compiler would be found here, not in a report)."""
    import numpy as np

    x = np.array([1.5, -2.0, 0.25, 3.0, 1e-3], np.float32)
    y = np.array([1.5, -2.5, 0.25, 2.0, 0.0], np.float32)
    out = (ctypes.c_double * 6)()
    if so.td_compare_0_0(x.ctypes.data, y.ctypes.data, x.size, 0.0, 0.0, 0.0, out) != 0:
        raise RuntimeError("self-check: finite values reported as NaN/Inf")
    d = np.abs(x - y).astype(np.float64)
    want = [float((d * d).sum()), float((y.astype(np.float64) ** 2).sum()), float((x.astype(np.float64) * y).sum()),
            1.0, 1.0, 2.0]
    got = list(out)
    if any(abs(g - w) > 1e-12 * max(1.0, abs(w)) for g, w in zip(got, want)):
        raise RuntimeError(f"self-check: {got} != {want}")
    v = np.array([np.nan, 2.0, -np.inf, -1.0, 0.5], np.float32)
    for fn, arr in ((so.td_stats_f32, v), (so.td_stats_f64, v.astype(np.float64))):
        fn(arr.ctypes.data, arr.size, out)
        if list(out) != [-1.0, 2.0, 1.5, 5.25, 1.0, 1.0]:
            raise RuntimeError(f"self-check: statistics {list(out)}")
    planes = np.arange(8, dtype=np.uint8)
    back = np.empty(8, np.uint8)
    so.td_unshuffle(planes.ctypes.data, 4, 2, 4, back.ctypes.data)
    if back.tolist() != [0, 4, 1, 5, 2, 6, 3, 7]:
        raise RuntimeError("self-check: unshuffle")
    so.td_shuffle(back.ctypes.data, 4, 2, planes.ctypes.data)
    if planes.tolist() != list(range(8)):
        raise RuntimeError("self-check: shuffle")
