"""Tolerances by dtype, and a noise floor measured from two reference captures.

A pair is judged by the coarser of its two dtypes: a BF16 tensor is not held to FP32
limits. The defaults are relative L2 errors: FP32 is set above the rounding noise of
equivalent rewrites (fused vs split projections, other attention kernels: ~1e-7..1e-6
measured on megatron-core vs HF GPT-2) and below a tanh-vs-erf GELU (~1e-4); BF16 above
the measured run-to-run noise of a BF16 GPT-2-small vs FP32 (up to 1.5e-2, see docs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import dtypes

DEFAULT_RTOL: dict[str, float] = {
    "float64": 1e-10,
    "float32": 1e-5,
    "float16": 5e-3,
    "bfloat16": 3e-2,
    "float8_e4m3fn": 2.5e-1,
    "float8_e5m2": 5e-1,
}
#: Both tensors of a pair in the same narrow dtype (BF16 against BF16, from runs that round differently): the
#: limit grows by sqrt(2), the two runs' independent rounding errors adding in quadrature.
BOTH_NARROW = 2 ** 0.5
#: Starting weights of two runs in a narrow dtype (FP16, BF16, FP8) are copies of one checkpoint: equal, or one
#: rounding apart (one side cast from FP32, the other stored narrow): a relative L2 of at most this many times the
#: dtype's resolution (2**-8 for BF16). Arithmetic's limits (``DEFAULT_RTOL``) are far above one rounding.
LOADED_ROUNDINGS = 1.0
#: Integer and boolean tensors (token ids, masks) must match exactly.
EXACT = 0.0
#: A pair is allowed this many times its measured noise (``--noise-factor``).
DEFAULT_NOISE_FACTOR = 3.0


@dataclass
class Tolerances:
    """How much relative L2 error each pair may show before it counts as diverged."""

    by_dtype: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RTOL))
    """Per-dtype relative L2 limits (the coarser dtype of the pair decides)."""
    override: float | None = None
    """One limit for every floating pair (``--rtol``)."""
    noise: dict[tuple, float] = field(default_factory=dict)
    """Measured noise per record key (phase, module, call, kind, slot) from two reference runs."""
    noise_factor: float = DEFAULT_NOISE_FACTOR
    """A pair is allowed ``noise_factor`` times its measured noise."""

    def limit(self, dtype_a: str, dtype_b: str, key: tuple | None = None, run_dtype: str = "",
              loaded: bool = False) -> float:
        """Relative-L2 limit for a pair; ``run_dtype``: the narrowest compute dtype of the two runs (a BF16
        run's FP32 outputs, such as its loss, carry BF16 error and are judged as BF16). ``loaded``: weights as the
        runs loaded them (the first step's), which no arithmetic made: in a narrow dtype they are held to one
        rounding (``LOADED_ROUNDINGS`` x the dtype's resolution), not to the arithmetic's limit, so that a weight
        converted 1% wrong is not passed over as BF16 noise."""
        judged = judged_dtype(dtype_a, dtype_b, run_dtype)
        if not dtypes.is_float(judged):
            return EXACT
        base = self.override if self.override is not None else self.by_dtype.get(judged, DEFAULT_RTOL["float32"])
        narrow = dtypes.MANTISSA_BITS.get(judged, 52) <= dtypes.MANTISSA_BITS["float16"]
        if loaded and narrow and self.override is None and not self.noise:
            return min(base, LOADED_ROUNDINGS * dtypes.resolution(judged))
        if (self.override is None and dtype_a == dtype_b == judged
                and dtypes.MANTISSA_BITS.get(judged, 52) <= dtypes.MANTISSA_BITS["float16"]):
            # the limits are set for a narrow run against a float32 one; two narrow runs each carry their own
            # rounding error, independent of the other's: their distance grows by sqrt(2)
            base *= BOTH_NARROW
        if key is not None and key in self.noise:
            base = max(base, self.noise_factor * self.noise[key])
        return base


def judged_dtype(dtype_a: str, dtype_b: str, run_dtype: str = "") -> str:
    """The dtype a pair is judged by: the coarser of the two, or the runs' compute dtype for float pairs."""
    judged = dtypes.coarsest(dtype_a, dtype_b)
    if run_dtype and dtypes.is_float(judged):
        judged = dtypes.coarsest(judged, run_dtype)
    return judged
