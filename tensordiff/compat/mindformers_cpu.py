"""CPU helper for MindFormers 1.9 on MindSpore 2.9 (PyNative and graph mode, FP32): CPU reference runs of real models.

Use it to train (forward + ``mindspore.value_and_grad``) these real MindFormers models on the CPU:
``parallel_core`` ``GPTModel`` (``mindformers/parallel_core/training_graph``), ``TrainingQwen3ForCausalLM``
and the legacy ``mindformers.LlamaForCausalLM``. Out of the box they fail because some kernels are
Ascend-only, one MindFormers code path has a bug, and one MindSpore autograd rule gives wrong gradients.
``enable()`` swaps each of these for a composite of ops that have CPU kernels; autodiff then
differentiates the composite. Fixes, one line each (name: target -> replacement, and why):

- ``morph``: ``Morph.__call__`` -> ``self.__morph_fn__(*args)``. The primitive raises "Morph is only supported
  in GRAPH_MODE". Custom Morph ``bprop_fn`` functions are ignored: the wrapped function is differentiated instead.
- ``embedding``: ``mindspore.mint.nn.functional.embedding`` -> ``ops.gather(weight, ids, 0)``. The CPU has no
  Embedding kernel.
- ``outer``: ``Outer.__call__`` -> ``x[:, None] * y[None, :]``. The CPU has no Outer kernel (used by RoPE).
- ``rms_norm``: ``RmsNorm.__call__`` -> ``x * rsqrt(mean(x**2) + eps) * gamma``, returns ``(y, rstd)`` like the
  primitive. The CPU has no RmsNorm kernel, and ``fused_norm=False`` does not reach every norm.
- ``flash_attention``: ``FlashAttentionScore.__call__`` -> fp32 ``softmax(scale * q k^T, masked) v``.
  The CPU has no FlashAttentionScore kernel, and the MindFormers ``FlashAttention`` cell is always
  ``core_attention``. Layouts BNSD/BSND/BSH/SBH/TND/TH, GQA, sparse modes 0-4; ``keep_prob`` must be 1.
- ``one_hot``: ``OneHotExt.__call__`` -> legacy ``ops.OneHot``. The CPU has no OneHotExt kernel (loss).
- ``zeros_like``: ``ZerosLikeExt.__call__`` -> legacy ``ops.ZerosLike``. The CPU has no ZerosLikeExt kernel
  (the custom ``bprop`` of the cross-entropy loss).
- ``split_with_size``: ``SplitWithSize.__call__`` -> a sequence of ``ops.narrow``. Not a missing kernel: in
  PyNative on the CPU, the gradient of ``Transpose(SplitWithSize(x)[i])`` ignores the permutation. The
  forward and the loss look right, but the ``linear_qkv`` gradients (and all below them) are wrong.
  ``mint.split`` has the same defect and is not patched.
- ``repeat_kv``: MindFormers ``Attention._repeat_kv`` -> repeat each KV head ``rep`` times along axis 2.
  MindFormers bug: without flash attention it receives ``[S, B, N, D]`` but assumes ``[B, N, S, D]``, so GQA fails
  ("shape1 and shape2 must be broadcastable").

Not swapped: DropoutExt has no CPU kernel, so set ``hidden_dropout=0.0`` and ``attention_dropout=0.0``.
MatMul has no bf16 CPU kernel, so use fp32 dtypes. Use ``use_flash_attention=False``: with ``True``,
MindFormers casts q/k/v to fp16 before attention.

Graph mode (``GRAPH_MODE``, or a ``mindspore.jit`` train step): the graph compiler never calls
``Primitive.__call__``, so the swaps above do nothing there. ``enable_graph(model)`` instead swaps primitive
*attributes* of a built model's cells for ``nn.Cell`` composites (the same maths as above: ``_composites``),
and turns on the two global fixes whose replacements the graph parser reads at compile time. Graph fixes
(``GRAPH_FIXES``), one line each (target -> replacement, and why):

- ``embedding``: the global ``embedding`` fix above. There is no EmbeddingDenseBackward CPU kernel (the
  forward compiles); the parser resolves ``mint.nn.functional.embedding`` when it compiles the Morph'd function.
- ``outer``: each ``Outer`` attribute (``rotary_pos_emb.outer``, ``.outer_for_eod``) -> ``OuterCPU``. No Outer kernel.
- ``rms_norm``: each ``RmsNorm`` attribute (the ``.norm`` of every fused RMSNorm, Qwen3's q/k norms included)
  -> ``RmsNormCPU``. No RmsNorm kernel.
- ``flash_attention``: each ``FlashAttentionScore`` attribute (``core_attention.flash_attention``) ->
  ``FlashAttentionCPU``; layouts BNSD/BSND/BSH/SBH (TND/TH are refused). No FlashAttentionScore kernel.
- ``repeat_kv``: the global ``repeat_kv`` fix above: the MindFormers bug is the same in graph mode (GQA does not
  compile).

Not needed in graph mode, checked on the three models: ``morph`` (Morph is native there), ``one_hot`` and
``zeros_like`` (OneHotExt and ZerosLikeExt compile and run on the CPU in graph mode), ``split_with_size`` (the
gradient defect is PyNative's only). Against PyNative with ``enable()``, 2 SGD steps: losses bit-identical,
parameter gradients within relative L2 6e-7.

Usage::

    from tensordiff.compat.mindformers_cpu import init_mindformers_cpu, mindformers_cpu, mindformers_cpu_graph
    init_mindformers_cpu(seed=0)            # PyNative, CPU, seed, build_mf_context({"use_legacy": False})
                                            # (use_legacy=True before building legacy LlamaForCausalLM)
    with mindformers_cpu():                 # or enable() ... disable()
        loss, grads = mindspore.value_and_grad(loss_fn, None, model.trainable_params())(ids)

    mindspore.set_context(mode=mindspore.GRAPH_MODE)   # or keep PyNative and decorate a step with @mindspore.jit
    with mindformers_cpu_graph(model):      # or enable_graph(model) ... disable_graph(model)
        loss, grads = mindspore.value_and_grad(loss_fn, None, model.trainable_params())(ids)

``disable()`` and ``disable_graph()`` put back the identical original objects. Importing MindFormers creates
``./output/log`` under the current directory (set ``LOCAL_DEFAULT_PATH`` or change directory to avoid it).
This module never imports torch (MindFormers itself does, through tensorboardX); MindSpore and MindFormers are
imported only when a function needs them.

Why one file of ~800 lines (above the ~400 the rest of the package keeps to): the PyNative and graph fixes
share one implementation of each replacement and one swap/restore ledger for the global swaps, and the
disable functions must put back every original object whatever subset was enabled; a user copies or reads
this one file to see everything that was changed in MindSpore's behaviour.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

FIXES: tuple[str, ...] = (
    "morph",
    "embedding",
    "outer",
    "rms_norm",
    "flash_attention",
    "one_hot",
    "zeros_like",
    "split_with_size",
    "repeat_kv",
)

_MISSING = object()

# fix name -> [(owner, attribute, original value or _MISSING)], in the order the swaps were made.
_ORIGINALS: dict[str, list[tuple[Any, str, Any]]] = {}

# A swap: (owner object, attribute name, dotted name for messages, replacement).
_Swap = tuple[Any, str, str, Any]


# --------------------------------------------------------------------------------------------------
# helpers


def _versions() -> str:
    parts = []
    for mod in ("mindspore", "mindformers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # pragma: no cover - reported, not needed
            parts.append(f"{mod} (not importable)")
    return ", ".join(parts)


def _resolve(fix: str, module: str, *path: str) -> Any:
    """Import ``module`` and walk ``path``; raise a RuntimeError that names what is missing."""
    import importlib

    dotted = ".".join((module,) + path)
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"mindformers_cpu fix {fix!r}: cannot import {module} ({exc}); "
                           f"installed: {_versions()}") from exc
    for name in path:
        if not hasattr(obj, name):
            raise RuntimeError(f"mindformers_cpu fix {fix!r}: {dotted} does not exist (missing attribute "
                               f"{name!r}); installed: {_versions()}. This helper was written for "
                               f"mindspore 2.9 / mindformers 1.9.")
        obj = getattr(obj, name)
    return obj


def _gen_prim(fix: str, name: str) -> Any:
    """A primitive class generated in ``mindspore.ops.auto_generate.gen_ops_prim``."""
    cls = _resolve(fix, "mindspore.ops.auto_generate.gen_ops_prim", name)
    if "__call__" not in vars(cls):
        raise RuntimeError(f"mindformers_cpu fix {fix!r}: {cls.__module__}.{name} defines no __call__ of its "
                           f"own; installed: {_versions()}")
    return cls


def _ms():
    import mindspore

    return mindspore


# --------------------------------------------------------------------------------------------------
# composites: the maths of every replacement, once. Plain MindSpore ops, written so that the graph
# compiler can parse them (``ops`` is reached through the closure), and used by both the PyNative
# ``__call__`` swaps and the graph-mode cells.

_COMPOSITES: dict[str, Any] = {}
_GRAPH_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")


def _composites() -> dict[str, Any]:
    """Build the composites once, on first use (MindSpore is imported only then)."""
    if _COMPOSITES:
        return _COMPOSITES
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    fp32_min = float(np.finfo(np.float32).min)

    def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):
        """``mint.nn.functional.embedding`` as ``ops.gather(weight, input, 0)`` (no options supported)."""
        if padding_idx is not None or max_norm is not None or scale_grad_by_freq:
            raise NotImplementedError("mindformers_cpu embedding: padding_idx, max_norm and scale_grad_by_freq "
                                      "are not supported by the CPU replacement")
        return ops.gather(weight, input, 0)

    def outer(input, vec2):
        """``Outer`` as a broadcast product of a column and a row."""
        return ops.reshape(input, (-1, 1)) * ops.reshape(vec2, (1, -1))

    def rms_norm(x, gamma, epsilon):
        """``y = x * rsqrt(mean(x**2) + eps) * gamma`` over gamma's dims, in fp32; returns ``(y, rstd)``."""
        axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
        x32 = ops.cast(x, ms.float32)
        rstd = ops.rsqrt(ops.mean(ops.square(x32), axes, keep_dims=True) + epsilon)
        y = x32 * rstd * ops.cast(gamma, ms.float32)
        return ops.cast(y, x.dtype), rstd

    def repeat_kv(self, x, rep):
        """``Attention._repeat_kv`` for the ``[S, B, N_kv, D]`` tensors it actually receives: head ``h`` -> ``h // rep``."""
        if rep == 1:
            return x
        s, b, n_kv, d = x.shape
        x = ops.broadcast_to(ops.expand_dims(x, 3), (s, b, n_kv, rep, d))
        return ops.reshape(x, (s, b, n_kv * rep, d))

    def band_mask(s1, s2, sparse_mode, pre_tokens, next_tokens, has_mask):
        """Boolean ``[1, 1, s1, s2]``, True where FlashAttentionScore skips a position (before the explicit
        mask), or None."""
        i = ops.reshape(ops.arange(s1), (s1, 1))
        j = ops.reshape(ops.arange(s2), (1, s2))
        if sparse_mode == 0:  # defaultMask: the band applies only when a mask is passed (left-up aligned)
            if not has_mask or (pre_tokens >= s1 + s2 and next_tokens >= s1 + s2):
                return None
            allowed = ops.logical_and(j - i <= next_tokens, i - j <= pre_tokens)
        elif sparse_mode == 1:  # allMask: the full mask alone
            return None
        elif sparse_mode == 2:  # leftUpCausal
            allowed = j <= i
        elif sparse_mode == 3:  # rightDownCausal
            allowed = j <= i + (s2 - s1)
        else:  # 4: band, right-down aligned
            d = j - i - (s2 - s1)
            allowed = ops.logical_and(d <= next_tokens, 0 - d <= pre_tokens)
        return ops.reshape(ops.logical_not(allowed), (1, 1, s1, s2))

    def attend(q, k, v, real_shift, mask, scale):
        """fp32 ``softmax(scale * (q k^T + real_shift), masked) v`` on ``[B, N, S, D]``, GQA by head repetition.

        ``mask``: True = masked out. Returns ``(out, row_max, row_sum)``; the row max and row sum of exp carry
        no gradient.
        """
        b, n1 = q.shape[0], q.shape[1]
        n2, s2, d = k.shape[1], k.shape[2], k.shape[3]
        if n2 != n1:  # GQA/MQA: query head h uses key/value head h // rep
            rep = n1 // n2
            k = ops.reshape(ops.broadcast_to(ops.expand_dims(k, 2), (b, n2, rep, s2, d)), (b, n1, s2, d))
            v = ops.reshape(ops.broadcast_to(ops.expand_dims(v, 2), (b, n2, rep, s2, d)), (b, n1, s2, d))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2)))
        if real_shift is not None:
            scores = scores + ops.cast(real_shift, ms.float32)
        scores = scores * scale
        if mask is not None:
            scores = ops.masked_fill(scores, ops.broadcast_to(mask, scores.shape), ms.Tensor(fp32_min, ms.float32))
        probs = ops.softmax(scores, -1)
        out = ops.matmul(probs, v)
        row_max = ops.stop_gradient(ops.amax(scores, -1, True))
        row_sum = ops.stop_gradient(ops.sum(ops.exp(scores - row_max), -1, True))
        return out, row_max, row_sum

    def to_bnsd(t, layout, head_dim):
        """A BNSD/BSND/BSH/SBH tensor as fp32 ``[B, N, S, D]``."""
        t = ops.cast(t, ms.float32)
        if layout == "BSND":
            return ops.transpose(t, (0, 2, 1, 3))
        if layout == "BSH":
            return ops.transpose(ops.reshape(t, t.shape[:2] + (-1, head_dim)), (0, 2, 1, 3))
        if layout == "SBH":
            return ops.transpose(ops.reshape(t, t.shape[:2] + (-1, head_dim)), (1, 2, 0, 3))
        return t

    def from_bnsd(out, layout):
        """``[B, N, S, D]`` back to ``layout`` (BNSD/BSND/BSH/SBH)."""
        if layout == "BSND":
            return ops.transpose(out, (0, 2, 1, 3))
        if layout == "BSH":
            return ops.reshape(ops.transpose(out, (0, 2, 1, 3)), (out.shape[0], out.shape[2], -1))
        if layout == "SBH":
            return ops.reshape(ops.transpose(out, (2, 0, 1, 3)), (out.shape[2], out.shape[0], -1))
        return out

    def flash_attention(query, key, value, real_shift, attn_mask, head_num, scale, layout, sparse_mode,
                        pre_tokens, next_tokens):
        """``FlashAttentionScore`` for the BNSD/BSND/BSH/SBH layouts; mask value 1/True = masked out.

        Returns ``(softmax_max, softmax_sum, softmax_out, attention_out)`` like the primitive: row max and row sum
        repeated 8 times on the last axis, ``softmax_out`` an empty placeholder.
        """
        head_dim = query.shape[-1] // head_num
        q = to_bnsd(query, layout, head_dim)
        k = to_bnsd(key, layout, head_dim)
        v = to_bnsd(value, layout, head_dim)
        if q.shape[1] != head_num or head_num % k.shape[1]:
            raise ValueError("FlashAttentionScore: head_num does not fit the query or the key/value heads")
        s1, s2 = q.shape[2], k.shape[2]
        mask = band_mask(s1, s2, sparse_mode, pre_tokens, next_tokens, attn_mask is not None)
        if attn_mask is not None and sparse_mode in (0, 1):
            explicit = ops.cast(attn_mask, ms.bool_)
            if explicit.ndim == 2:
                explicit = ops.reshape(explicit, (1, 1) + explicit.shape)
            mask = explicit if mask is None else ops.logical_or(explicit, mask)
        out, row_max, row_sum = attend(q, k, v, real_shift, mask, scale)
        return (ops.tile(row_max, (1, 1, 1, 8)), ops.tile(row_sum, (1, 1, 1, 8)), ops.zeros((0,), query.dtype),
                ops.cast(from_bnsd(out, layout), query.dtype))

    class RmsNormCPU(nn.Cell):
        """Graph-mode ``RmsNorm``: ``(y, rstd)``."""

        _tensordiff_internal = True  # stands in for a primitive: capture does not record it as a cell

        def __init__(self, epsilon):
            super().__init__()
            self.epsilon = epsilon

        def construct(self, x, gamma):
            return rms_norm(x, gamma, self.epsilon)

    class OuterCPU(nn.Cell):
        """Graph-mode ``Outer``."""

        _tensordiff_internal = True  # stands in for a primitive: capture does not record it as a cell

        def construct(self, input, vec2):
            return outer(input, vec2)

    class FlashAttentionCPU(nn.Cell):
        """Graph-mode ``FlashAttentionScore`` (BNSD/BSND/BSH/SBH); the primitive's attributes are copied."""

        _tensordiff_internal = True  # stands in for a primitive: capture does not record it as a cell

        def __init__(self, head_num, scale_value, layout, sparse_mode, pre_tokens, next_tokens):
            super().__init__()
            self.head_num = head_num
            self.scale_value = scale_value
            self.layout = layout
            self.sparse_mode = sparse_mode
            self.pre_tokens = pre_tokens
            self.next_tokens = next_tokens

        def construct(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None,
                      attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
            if drop_mask is not None or padding_mask is not None or prefix is not None:
                raise ValueError("mindformers_cpu flash_attention: drop_mask, padding_mask and prefix are not "
                                 "supported")
            return flash_attention(query, key, value, real_shift, attn_mask, self.head_num, self.scale_value,
                                   self.layout, self.sparse_mode, self.pre_tokens, self.next_tokens)

    _COMPOSITES.update(embedding=embedding, outer=outer, rms_norm=rms_norm, repeat_kv=repeat_kv,
                       band_mask=band_mask, attend=attend, flash_attention=flash_attention,
                       RmsNormCPU=RmsNormCPU, OuterCPU=OuterCPU, FlashAttentionCPU=FlashAttentionCPU)
    return _COMPOSITES


# --------------------------------------------------------------------------------------------------
# replacements (module level so that they are the same objects across enable/disable cycles)


def _morph_call(self, *args):
    """``Morph.__call__`` for PyNative: run the wrapped function; autodiff differentiates it."""
    return self.__morph_fn__(*args)


def _outer_call(self, input, vec2):
    """``Outer`` as a broadcast product of a column and a row."""
    return _composites()["outer"](input, vec2)


def _rms_norm_call(self, x, gamma):
    """``RmsNorm``: ``y = x * rsqrt(mean(x**2) + eps) * gamma`` in fp32; returns ``(y, rstd)``."""
    return _composites()["rms_norm"](x, gamma, self.epsilon)


_ONE_HOT: dict[int, Any] = {}


def _one_hot_call(self, tensor, num_classes, on_value, off_value):
    """``OneHotExt`` through the legacy ``ops.OneHot`` primitive (same axis)."""
    ms = _ms()
    axis = int(self.axis)
    prim = _ONE_HOT.get(axis)
    if prim is None:
        prim = _ONE_HOT[axis] = ms.ops.OneHot(axis=axis)
    if not isinstance(on_value, ms.Tensor):
        on_value = ms.Tensor(on_value, ms.float32)
    if not isinstance(off_value, ms.Tensor):
        off_value = ms.Tensor(off_value, on_value.dtype)
    return prim(tensor, int(num_classes), on_value, off_value)


_ZEROS_LIKE: list[Any] = []


def _zeros_like_call(self, input, dtype=None):
    """``ZerosLikeExt`` through the legacy ``ops.ZerosLike`` primitive, cast to ``dtype`` if given."""
    ms = _ms()
    if not _ZEROS_LIKE:
        _ZEROS_LIKE.append(ms.ops.ZerosLike())
    out = _ZEROS_LIKE[0](input)
    if dtype is not None and out.dtype != dtype:
        out = ms.ops.cast(out, dtype)
    return out


def _split_with_size_call(self, input, split_size, dim=0):
    """``SplitWithSize`` as consecutive ``ops.narrow`` slices (correct gradients through later transposes)."""
    ops = _ms().ops
    dim = int(dim)
    if dim < 0:
        dim += input.ndim
    sizes = [int(s) for s in split_size]
    if sum(sizes) != input.shape[dim]:
        raise ValueError(f"SplitWithSize: split sizes {sizes} do not add up to {input.shape[dim]} (dim {dim})")
    out, start = [], 0
    for size in sizes:
        out.append(ops.narrow(input, dim, start, size))
        start += size
    return tuple(out)


# ---- flash attention -----------------------------------------------------------------------------

_LAYOUT_NAMES = ("BSH", "BNSD", "SBH", "BSND", "TND", "TH")
_LAYOUTS: dict[Any, str] = {}


def _layout_name(prim) -> str:
    """``input_layout`` is stored as an enum value; map it back to its name."""
    value = prim.input_layout
    if isinstance(value, str):
        return value
    if not _LAYOUTS:
        cls = type(prim)
        for name in _LAYOUT_NAMES:
            _LAYOUTS[cls(head_num=1, input_layout=name).input_layout] = name
    try:
        return _LAYOUTS[value]
    except KeyError:
        raise ValueError(f"FlashAttentionScore: unknown input_layout {value!r}") from None


def _as_ints(value, what: str) -> list[int]:
    if value is None:
        raise ValueError(f"FlashAttentionScore: the TND/TH layout needs {what}")
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    return [int(v) for v in list(value)]


def _flash_attention_attrs(prim) -> tuple[str, int, float, int, int, int]:
    """``(layout, head_num, scale_value, sparse_mode, pre_tokens, next_tokens)`` of a FlashAttentionScore whose
    settings the replacement supports; raises otherwise."""
    keep_prob = float(prim.keep_prob)
    if keep_prob != 1.0:
        raise ValueError(f"mindformers_cpu flash_attention: keep_prob must be 1.0 (got {keep_prob}); "
                         "set attention_dropout=0.0")
    sparse_mode = int(prim.sparse_mode)
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise NotImplementedError(f"mindformers_cpu flash_attention: sparse_mode {sparse_mode} is not supported")
    return (_layout_name(prim), int(prim.head_num), float(prim.scale_value), sparse_mode, int(prim.pre_tokens),
            int(prim.next_tokens))


def _flash_attention_call(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None,
                          attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """``FlashAttentionScore`` as fp32 ``softmax(scale * (q k^T + real_shift), masked) v``.

    Mask convention: 1/True = masked out. Returns ``(softmax_max, softmax_sum, softmax_out, attention_out)``
    like the primitive; ``softmax_max``/``softmax_sum`` are the row max and row sum of exp (no gradient),
    repeated 8 times on the last axis, ``softmax_out`` is an empty placeholder.
    """
    import numpy as np

    ms = _ms()
    ops = ms.ops
    comp = _composites()
    layout, n1, scale, sparse_mode, pre_tokens, next_tokens = _flash_attention_attrs(self)
    if drop_mask is not None:
        raise ValueError("mindformers_cpu flash_attention: drop_mask is not supported (keep_prob must be 1.0); "
                         "set attention_dropout=0.0")
    if prefix is not None or padding_mask is not None:
        raise NotImplementedError("mindformers_cpu flash_attention: prefix and padding_mask are not supported")
    if layout in _GRAPH_LAYOUTS:
        return comp["flash_attention"](query, key, value, real_shift, attn_mask, n1, scale, layout, sparse_mode,
                                       pre_tokens, next_tokens)
    if layout not in ("TND", "TH"):
        raise NotImplementedError(f"mindformers_cpu flash_attention: layout {layout} is not supported")
    if attn_mask is not None and sparse_mode in (0, 1):
        raise NotImplementedError("mindformers_cpu flash_attention: explicit masks with TND are not supported")

    # TND/TH: the packed sequences as one batch of [1, N, T, D], with a block-diagonal mask.
    out_dtype = query.dtype
    q, k, v = (ops.cast(t, ms.float32) for t in (query, key, value))
    if layout == "TH":
        d = q.shape[-1] // n1
        q, k, v = (ops.reshape(t, (t.shape[0], -1, d)) for t in (q, k, v))
    q, k, v = (ops.expand_dims(ops.transpose(t, (1, 0, 2)), 0) for t in (q, k, v))
    s1, s2 = q.shape[2], k.shape[2]
    if q.shape[1] != n1 or n1 % k.shape[1]:
        raise ValueError(f"FlashAttentionScore: head_num {n1}, query heads {q.shape[1]}, key/value heads "
                         f"{k.shape[1]}")
    cq = _as_ints(actual_seq_qlen, "actual_seq_qlen")
    ck = _as_ints(actual_seq_kvlen, "actual_seq_kvlen")
    if len(cq) != len(ck):
        raise ValueError("FlashAttentionScore: actual_seq_qlen and actual_seq_kvlen differ in length")
    masked = np.ones((s1, s2), dtype=bool)
    q0 = k0 = 0
    for qe, ke in zip(cq, ck):
        block = comp["band_mask"](qe - q0, ke - k0, sparse_mode, pre_tokens, next_tokens, attn_mask is not None)
        masked[q0:qe, k0:ke] = False if block is None else block.asnumpy()[0, 0]
        q0, k0 = qe, ke
    out, row_max, row_sum = comp["attend"](q, k, v, real_shift, ms.Tensor(masked[None, None]), scale)
    out = ops.transpose(out[0], (1, 0, 2))
    if layout == "TH":
        out = ops.reshape(out, (s1, -1))
    row_max = ops.transpose(row_max[0], (1, 0, 2))
    row_sum = ops.transpose(row_sum[0], (1, 0, 2))
    softmax_out = ops.zeros((0,), out_dtype)
    return ops.tile(row_max, (1, 1, 8)), ops.tile(row_sum, (1, 1, 8)), softmax_out, ops.cast(out, out_dtype)


# --------------------------------------------------------------------------------------------------
# fixes: each returns the swaps it makes (and raises RuntimeError if a target is missing)


def _fix_morph() -> list[_Swap]:
    """Morph raises outside GRAPH_MODE: call the wrapped function directly."""
    cls = _resolve("morph", "mindspore.ops.operations.debug_ops", "Morph")
    return [(cls, "__call__", "mindspore.ops.operations.debug_ops.Morph.__call__", _morph_call)]


def _fix_embedding() -> list[_Swap]:
    """No Embedding CPU kernel: ``mint.nn.functional.embedding`` becomes a gather."""
    mod = _resolve("embedding", "mindspore.mint.nn.functional")
    _resolve("embedding", "mindspore.mint.nn.functional", "embedding")
    return [(mod, "embedding", "mindspore.mint.nn.functional.embedding", _composites()["embedding"])]


def _fix_outer() -> list[_Swap]:
    """No Outer CPU kernel (RoPE frequencies): broadcast product."""
    cls = _gen_prim("outer", "Outer")
    return [(cls, "__call__", "mindspore.ops.auto_generate.Outer.__call__", _outer_call)]


def _fix_rms_norm() -> list[_Swap]:
    """No RmsNorm CPU kernel: composite RMS norm returning ``(y, rstd)``."""
    cls = _gen_prim("rms_norm", "RmsNorm")
    return [(cls, "__call__", "mindspore.ops.auto_generate.RmsNorm.__call__", _rms_norm_call)]


def _fix_flash_attention() -> list[_Swap]:
    """No FlashAttentionScore CPU kernel: fp32 masked softmax attention."""
    cls = _gen_prim("flash_attention", "FlashAttentionScore")
    return [(cls, "__call__", "mindspore.ops.auto_generate.FlashAttentionScore.__call__", _flash_attention_call)]


def _fix_one_hot() -> list[_Swap]:
    """No OneHotExt CPU kernel (cross-entropy loss): legacy OneHot."""
    cls = _gen_prim("one_hot", "OneHotExt")
    return [(cls, "__call__", "mindspore.ops.auto_generate.OneHotExt.__call__", _one_hot_call)]


def _fix_zeros_like() -> list[_Swap]:
    """No ZerosLikeExt CPU kernel (loss bprop): legacy ZerosLike."""
    cls = _gen_prim("zeros_like", "ZerosLikeExt")
    return [(cls, "__call__", "mindspore.ops.auto_generate.ZerosLikeExt.__call__", _zeros_like_call)]


def _fix_split_with_size() -> list[_Swap]:
    """Wrong gradient of Transpose(SplitWithSize(x)[i]) in PyNative: split with ``ops.narrow`` instead."""
    cls = _gen_prim("split_with_size", "SplitWithSize")
    return [(cls, "__call__", "mindspore.ops.auto_generate.SplitWithSize.__call__", _split_with_size_call)]


def _fix_repeat_kv() -> list[_Swap]:
    """MindFormers ``Attention._repeat_kv`` assumes BNSD but gets SBND: repeat heads on axis 2."""
    cls = _resolve("repeat_kv", "mindformers.parallel_core.training_graph.transformer.attention", "Attention")
    if "_repeat_kv" not in vars(cls):
        raise RuntimeError(f"mindformers_cpu fix 'repeat_kv': {cls.__module__}.Attention._repeat_kv does not "
                           f"exist; installed: {_versions()}")
    return [(cls, "_repeat_kv", f"{cls.__module__}.Attention._repeat_kv", _composites()["repeat_kv"])]


_FIX_FUNCS: dict[str, Callable[[], list[_Swap]]] = {
    "morph": _fix_morph,
    "embedding": _fix_embedding,
    "outer": _fix_outer,
    "rms_norm": _fix_rms_norm,
    "flash_attention": _fix_flash_attention,
    "one_hot": _fix_one_hot,
    "zeros_like": _fix_zeros_like,
    "split_with_size": _fix_split_with_size,
    "repeat_kv": _fix_repeat_kv,
}
assert tuple(_FIX_FUNCS) == FIXES


# --------------------------------------------------------------------------------------------------
# public API


def _select(fixes: Iterable[str] | None, exclude: Iterable[str], known: Sequence[str] = FIXES,
            what: str = "fix") -> list[str]:
    """The fixes of ``known`` chosen by ``fixes`` (all by default) minus ``exclude``, in ``known``'s order."""
    if isinstance(fixes, str) or isinstance(exclude, str):
        raise TypeError("fixes and exclude take a sequence of fix names, not a single string")
    chosen = list(known) if fixes is None else list(fixes)
    excluded = set(exclude)
    unknown = sorted((set(chosen) | excluded) - set(known))
    if unknown:
        raise ValueError(f"unknown mindformers_cpu {what}(es) {unknown}; known: {', '.join(known)}")
    return [name for name in known if name in chosen and name not in excluded]


def enable(fixes: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """Apply the named fixes (all of ``FIXES`` by default, minus ``exclude``); already active ones are kept.

    Idempotent. Every target is looked up before anything is swapped, so a missing target
    (RuntimeError) leaves the state unchanged. Returns the fixes active afterwards.
    """
    wanted = [name for name in _select(fixes, exclude) if name not in _ORIGINALS]
    planned = {name: _FIX_FUNCS[name]() for name in wanted}
    for name, swaps in planned.items():
        saved = []
        for owner, attr, _dotted, replacement in swaps:
            saved.append((owner, attr, vars(owner).get(attr, _MISSING)))
            setattr(owner, attr, replacement)
        _ORIGINALS[name] = saved
    return enabled_fixes()


def disable(fixes: Sequence[str] | None = None) -> None:
    """Restore the original objects (``is``-identical) of the named fixes, by default of all fixes."""
    names = [name for name in _select(fixes, ()) if name in _ORIGINALS]
    for name in reversed(names):
        for owner, attr, original in reversed(_ORIGINALS.pop(name)):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def is_enabled() -> bool:
    """Whether any fix is active."""
    return bool(_ORIGINALS)


def enabled_fixes() -> tuple[str, ...]:
    """The active fixes, in ``FIXES`` order."""
    return tuple(name for name in FIXES if name in _ORIGINALS)


def swap_targets(fixes: Sequence[str] | None = None) -> dict[str, list[tuple[Any, str]]]:
    """For each named fix (default: all), the ``(owner, attribute)`` pairs it swaps. Swaps nothing."""
    return {name: [(owner, attr) for owner, attr, _d, _r in _FIX_FUNCS[name]()] for name in _select(fixes, ())}


@contextlib.contextmanager
def mindformers_cpu(exclude: Sequence[str] = (), fixes: Sequence[str] | None = None) -> Iterator[tuple[str, ...]]:
    """Inside the block exactly the selected fixes are active; on exit the previous state is restored.

    Yields the active fix names.
    """
    before = enabled_fixes()
    wanted = _select(fixes, exclude)
    removed = [name for name in before if name not in wanted]
    disable(removed)
    added: tuple[str, ...] = ()
    try:
        added = tuple(name for name in wanted if name not in before)
        enable(added)
        yield enabled_fixes()
    finally:
        disable([name for name in added if name in _ORIGINALS])
        enable(removed)


def init_mindformers_cpu(seed: int = 0, *, use_legacy: bool = False) -> None:
    """PyNative mode on the CPU, ``mindspore.set_seed(seed)`` (also seeds numpy), and the MindFormers context.

    ``build_mf_context({"use_legacy": False})`` is required before building ``parallel_core`` models
    (otherwise ``'TransformerConfig' object has no attribute 'swap'``). Legacy models such as
    ``mindformers.LlamaForCausalLM`` need ``use_legacy=True`` instead (otherwise
    ``'TransformerOpParallelConfig' object has no attribute 'cpu_offloading'``); MindFormers reads the flag
    when a model is built, so call this again with the right value before building each kind. Safe to call
    any number of times: the MindFormers context is a singleton and only its ``use_legacy`` is updated.
    """
    ms = _ms()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ms.set_device("CPU")
    except RuntimeError:
        # set_device may be called only once per process; accept a second call that changes nothing.
        if ms.get_context("device_target") != "CPU":
            raise
    ms.set_seed(seed)
    from mindformers.core.context.build_context import MFContextOperator, build_mf_context

    ctx = MFContextOperator.get_mf_ctx_instance()
    if ctx is None:
        ctx = build_mf_context({"use_legacy": bool(use_legacy)})
    if ctx.get_context("use_legacy") is not bool(use_legacy):
        ctx.set_context(use_legacy=bool(use_legacy))


def register_cpu_wrapper() -> None:
    """Register ``CPUTrainOneStepCell`` as a MindFormers wrapper (YAML ``runner_wrapper: type: CPUTrainOneStepCell``):
    ``MFTrainOneStepCell`` whose overflow check is an ``isfinite`` over the gradients. MindFormers checks overflow
    with ``NPUGetFloatStatusV2`` (GPU: ``FloatStatus``), neither of which has a CPU kernel; in FP32 without loss
    scaling no step is skipped either way, so the update is MFTrainOneStepCell's."""
    from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
    from mindformers.wrapper.wrapper import MFTrainOneStepCell
    from mindspore import ops

    finite = ops.MultitypeFuncGraph("finite")

    @finite.register("Tensor")
    def _all_finite(grad):
        return ops.isfinite(grad).all()

    class CPUTrainOneStepCell(MFTrainOneStepCell):
        def get_overflow_status(self, status, compute_output):
            return ops.logical_not(ops.stack(self.hyper_map(finite, compute_output)).all())

    MindFormerRegister.register_cls(CPUTrainOneStepCell, module_type=MindFormerModuleType.WRAPPER)


def _barrier_call(self: Any) -> Any:
    """``Barrier()`` as an all-reduce of one element over its group (the CPU has no Barrier kernel; AllReduce has)."""
    ms = _ms()
    return ms.ops.AllReduce(group=getattr(self, "group", None) or "hccl_world_group")(ms.Tensor([0.0], ms.float32))


def trainer_on_cpu() -> None:
    """What MindFormers' Trainer needs on the CPU beyond ``enable()``: the ``CPUTrainOneStepCell`` wrapper
    (``register_cpu_wrapper``) and, for a data-parallel run under msrun (``use_parallel: True``), a ``Barrier`` made
    of an AllReduce: the Trainer calls ``mindspore.communication.comm_func.barrier()`` while it loads a checkpoint
    and saves, and the Barrier primitive has no CPU kernel ("Unsupported op [Barrier] on CPU"). For a process that runs
    the Trainer (examples/launchers/run_mindformer.py); the swap lasts as long as the process."""
    register_cpu_wrapper()
    from mindspore.ops.operations import comm_ops

    comm_ops.Barrier.__call__ = _barrier_call


def hooks_left(model: Any) -> int:
    """Forward hooks, tensordiff attributes and tensordiff cell classes left on ``model``'s cells (0 after a capture)."""
    left = 0
    for _, cell in model.cells_and_names():
        left += len(getattr(cell, "_forward_pre_hook", {}) or {}) + len(getattr(cell, "_forward_hook", {}) or {})
        left += any(k.startswith("_td_") for k in vars(cell)) + type(cell).__module__.startswith("tensordiff")
    return left


# --------------------------------------------------------------------------------------------------
# graph mode: cell attribute swaps on a built model

GRAPH_FIXES: tuple[str, ...] = ("embedding", "outer", "rms_norm", "flash_attention", "repeat_kv")
# Graph fixes that are the global swaps of enable() (their replacements parse in graph mode).
_GRAPH_GLOBAL = ("embedding", "repeat_kv")

# (model, cell, attribute, original primitive, fix name, dotted path), in swap order.
_GRAPH_ORIGINALS: list[tuple[Any, Any, str, Any, str, str]] = []
# The models enable_graph was called on (compared with ``is``).
_GRAPH_MODELS: list[Any] = []
# The global fixes enable_graph turned on; turned off again when no model is left.
_GRAPH_OWNS: set[str] = set()


def _graph_cell_for(fix: str, prim: Any) -> Any:
    """The replacement cell for primitive ``prim`` (checked here, in Python, not at compile time)."""
    impl = _composites()
    if fix == "rms_norm":
        return impl["RmsNormCPU"](float(prim.epsilon))
    if fix == "outer":
        return impl["OuterCPU"]()
    layout, head_num, scale, sparse_mode, pre_tokens, next_tokens = _flash_attention_attrs(prim)
    if layout not in _GRAPH_LAYOUTS:
        raise NotImplementedError(f"mindformers_cpu graph flash_attention: layout {layout} is not supported "
                                  f"({', '.join(_GRAPH_LAYOUTS)} are); set use_flash_attention=False")
    return impl["FlashAttentionCPU"](head_num, scale, layout, sparse_mode, pre_tokens, next_tokens)


_GRAPH_PRIMS: dict[str, str] = {  # fix name -> primitive class in gen_ops_prim
    "outer": "Outer",
    "rms_norm": "RmsNorm",
    "flash_attention": "FlashAttentionScore",
}


def enable_graph(model: Any, fixes: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> dict[str, str]:
    """Make a built MindFormers ``model`` compile and train in GRAPH_MODE (and under ``mindspore.jit``) on the CPU.

    Of ``GRAPH_FIXES`` (all by default, minus ``exclude``): swaps each Ascend-only primitive attribute of the
    model's cells for an ``nn.Cell`` composite (``outer``, ``rms_norm``, ``flash_attention``), and turns on the
    global fixes ``embedding`` and ``repeat_kv`` of ``enable()`` where they are off (their replacements parse
    in graph mode; ``disable()`` turns them off too). The cells also run in PyNative, with the same numbers.
    Idempotent: a swapped attribute is not swapped again. Every replacement is built (and checked) before
    anything is swapped. Returns ``{dotted attribute path: fix name}`` of the cell swaps this call made.
    """
    wanted = _select(fixes, exclude, GRAPH_FIXES, "graph fix")
    classes = {_gen_prim(fix, _GRAPH_PRIMS[fix]): fix for fix in wanted if fix in _GRAPH_PRIMS}
    planned = []
    for path, cell in model.cells_and_names():
        prefix = f"{path}." if path else ""
        for attr, value in list(vars(cell).items()):
            fix = classes.get(type(value))
            if fix is not None:
                planned.append((cell, attr, value, fix, prefix + attr, _graph_cell_for(fix, value)))
    globals_off = [fix for fix in wanted if fix in _GRAPH_GLOBAL and fix not in _ORIGINALS]
    enable(globals_off)
    _GRAPH_OWNS.update(globals_off)
    for cell, attr, original, fix, path, replacement in planned:
        del cell.__dict__[attr]  # Cell.__setattr__ keeps primitives in __dict__ (and in _primitives, left as is)
        cell.insert_child_to_cell(attr, replacement)
        _GRAPH_ORIGINALS.append((model, cell, attr, original, fix, path))
    if not any(m is model for m in _GRAPH_MODELS):
        _GRAPH_MODELS.append(model)
    return {path: fix for _c, _a, _o, fix, path, _r in planned}


def _restore_graph(entries: list[tuple[Any, Any, str, Any, str, str]]) -> None:
    """Undo ``entries`` (newest first) and drop them from the ledger."""
    for _model, cell, attr, original, _fix, _path in reversed(entries):
        del cell._cells[attr]
        object.__setattr__(cell, attr, original)
    _GRAPH_ORIGINALS[:] = [e for e in _GRAPH_ORIGINALS if not any(e is u for u in entries)]


def _release_graph_globals() -> None:
    if not _GRAPH_MODELS and _GRAPH_OWNS:
        disable(sorted(_GRAPH_OWNS))
        _GRAPH_OWNS.clear()


def disable_graph(model: Any = None) -> None:
    """Undo ``enable_graph`` for ``model`` (default: every model): each attribute ``is`` the original again.

    When no model is left, the global fixes that ``enable_graph`` turned on are turned off.
    """
    _restore_graph([e for e in _GRAPH_ORIGINALS if model is None or e[0] is model])
    _GRAPH_MODELS[:] = [m for m in _GRAPH_MODELS if model is not None and m is not model]
    _release_graph_globals()


def graph_swaps(model: Any = None) -> dict[str, str]:
    """The active graph swaps of ``model`` (default: all models): ``{dotted attribute path: fix name}``."""
    return {path: fix for owner, _c, _a, _o, fix, path in _GRAPH_ORIGINALS if model is None or owner is model}


@contextlib.contextmanager
def mindformers_cpu_graph(model: Any, fixes: Sequence[str] | None = None,
                          exclude: Sequence[str] = ()) -> Iterator[dict[str, str]]:
    """``enable_graph(model, fixes, exclude)`` for the block; on exit the swaps it made are undone.

    Yields the swaps made (``{dotted attribute path: fix name}``).
    """
    new_model = not any(m is model for m in _GRAPH_MODELS)
    start = len(_GRAPH_ORIGINALS)
    swaps = enable_graph(model, fixes, exclude)
    added = _GRAPH_ORIGINALS[start:]
    try:
        yield swaps
    finally:
        _restore_graph(added)
        if new_model:
            _GRAPH_MODELS[:] = [m for m in _GRAPH_MODELS if m is not model]
        _release_graph_globals()
