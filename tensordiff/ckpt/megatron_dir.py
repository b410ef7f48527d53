"""Megatron-LM ``--save`` folders read as one full (TP=1, PP=1) model, with the optimizer's state.

    DIR/latest_checkpointed_iteration.txt     the last iteration saved ("release" also read)
    DIR/iter_{J:07d}/                         --ckpt-format torch_dist: a PyTorch distributed checkpoint
        .metadata, __R_K.distcp, common.pt, metadata.json
    DIR/iter_{J:07d}/mp_rank_{tp:02d}[_{pp:03d}]/   --ckpt-format torch: one folder per model-parallel rank
        model_optim_rng.pt [, distrib_optim.pt]

``iterations(path)`` lists the saved iterations; ``load_dir(path, iteration=None)`` returns ``(tensors, skipped,
info)``: the model under megatron-core's parameter names (``decoder.layers.0.self_attention.linear_qkv.weight``),
the optimizer's moments as ``optimizer.exp_avg.<name>`` / ``optimizer.exp_avg_sq.<name>`` (full, the parameter's
shape) and ``optimizer.fp32_param.<name>`` where the main parameters are kept in another dtype than the model's —
from every layout Megatron-LM (core_v0.16.1) writes: per parameter (torch_dist ``fully_reshardable``, the plain
optimizer's), per gradient bucket (torch_dist ``dp_reshardable``, its default with the distributed optimizer;
``distrib_optim.pt``), the buckets rebuilt and checked against the saved chunks and main parameters; and
``info``: iteration, format, tp, pp, the optimizer's step and its param groups' hyper-parameters
(``optimizer_groups``: betas, eps, weight_decay, wd_mult...), the scheduler's state, whether RNG states are saved, the
saved ``args`` as plain values.

Nothing is unpickled: ``.metadata`` goes through torch's weights-only unpickler allowing only torch.distributed.
checkpoint's metadata classes, each tensor item of a ``.distcp`` file is read from its byte range with
``torch.load(weights_only=True)``, ``common.pt`` and the ``.pt`` files through ``frameworks/torch_safe.py``. Torch is
imported only when a folder is read. A folder that cannot be read, or not joined unambiguously, is one line naming
what is missing or why.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from .._text import listing
from ..errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"iter_(\d{7})")
_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")

#: tensor-parallel layout of megatron-core's GPT parameters (by the name's ending): column-parallel ones are cut
#: along dim 0 (their biases too), row-parallel weights along dim 1 (their biases replicated); the rest replicated
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
           "mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
#: megatron-core's sharded-state-dict keys of the local layer spec's norms (stored under Transformer Engine's names)
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_STATES = ("exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------------------------------------- folders
def iterations(path: str) -> dict[int, str]:
    """The checkpointed iterations of a ``--save`` folder: iteration -> its ``iter_NNNNNNN`` folder (sorted)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder; pass a Megatron-LM --save folder")
    found = {int(m.group(1)): os.path.join(path, d) for d in os.listdir(path)
             if (m := _ITER.fullmatch(d)) and os.path.isdir(os.path.join(path, d))}
    return dict(sorted(found.items()))


def _tracker(path: str) -> str | None:
    tracker = os.path.join(path, TRACKER)
    if not os.path.exists(tracker):
        return None
    try:
        with open(tracker, encoding="utf-8") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{tracker}: cannot read it ({err}); it names the iteration to load") from None
    if text != "release" and not text.isdigit():
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'; pass the "
                              "iter_NNNNNNN folder itself")
    return text


def iteration_folder(path: str, iteration: int | None = None) -> str:
    """The ``iter_NNNNNNN`` (or ``release``) folder to read: ``iteration``'s, else the tracker's; ``path`` may be that
    folder itself."""
    base = os.path.basename(os.path.normpath(path))
    if iteration is None and (_ITER.fullmatch(base) or base == "release"):
        return path
    if iteration is not None:
        folder = os.path.join(path, f"iter_{iteration:07d}")
        if not os.path.isdir(folder):
            saved = listing(str(i) for i in iterations(path)) or "none"
            raise CheckpointError(f"{path}: no iteration {iteration} (iter_{iteration:07d} is missing; saved: {saved})")
        return folder
    text = _tracker(path)
    if text is not None:
        folder = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}")
        if not os.path.isdir(folder):
            raise CheckpointError(f"{path}: {TRACKER} names {text}, but {folder} is missing; pass an iter_NNNNNNN "
                                  "folder that exists")
        return folder
    iters = [os.path.basename(f) for f in iterations(path).values()]
    raise CheckpointError(f"{path}: a folder without {TRACKER}"
                          + (f"; pass one of its iteration folders ({listing(iters)})" if iters else
                             " or iter_NNNNNNN folders: not a Megatron-LM --save folder"))


def format_of(folder: str) -> str:
    """'torch_dist' or 'torch' for an iteration folder."""
    names = os.listdir(folder)
    if ".metadata" in names or "common.pt" in names or any(n.endswith(".distcp") for n in names):
        return "torch_dist"
    if any(_RANK.fullmatch(n) for n in names):
        return "torch"
    raise CheckpointError(f"{folder}: holds neither a distributed checkpoint (.metadata, *.distcp, common.pt) nor "
                          f"mp_rank_NN folders (holds {listing(sorted(names)) or 'nothing'}); not a Megatron-LM "
                          "checkpoint iteration")


def load_dir(path: str, iteration: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Any]]:
    """(tensors, skipped entries: name -> what, info) of a Megatron-LM ``--save`` folder (or one iteration folder)."""
    folder = iteration_folder(path, iteration)
    fmt = format_of(folder)
    tensors, skipped, info = _load_dist(folder) if fmt == "torch_dist" else _load_torch(folder)
    info = {"iteration": info.pop("iteration", None), "format": fmt, **info, "folder": folder}
    return tensors, skipped, info


# ------------------------------------------------------------------------------------------------ helpers
def _plain(value: Any, depth: int = 0) -> Any:
    """A saved value as plain data (numbers, strings, bools, None; lists of them); anything else as its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and depth < 2 and all(v is None or isinstance(v, (bool, int, float, str))
                                                            for v in value):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def _args_dict(args: Any) -> dict[str, Any]:
    if args is None:
        return {}
    items = vars(args) if hasattr(args, "__dict__") and not isinstance(args, dict) else args
    if not isinstance(items, dict):
        return {"repr": repr(args)}
    return {str(k): _plain(v) for k, v in sorted(items.items()) if not str(k).startswith("_")}


def _scheduler(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict):
        return {}
    return {str(k): _plain(v) for k, v in state.items()}


def _step(optimizer: Any) -> int | None:
    """Adam's step count from a saved optimizer state dict (its param groups', or its per-parameter states')."""
    if not isinstance(optimizer, dict):
        return None
    inner = optimizer.get("optimizer", optimizer)
    steps = set()
    for group in inner.get("param_groups", []) if isinstance(inner, dict) else []:
        if isinstance(group, dict) and group.get("step") is not None:
            steps.add(float(group["step"]))
    for key, state in (inner.get("state", {}) or {}).items() if isinstance(inner, dict) else []:
        if isinstance(state, dict) and "step" in state:
            steps.add(float(np.asarray(_np(state["step"]))))
        elif key == "common_step" and state is not None:  # megatron-core's torch_dist: one step for all parameters
            steps.add(float(np.asarray(_np(state))))
    return int(max(steps)) if steps else None


#: the hyper-parameters of an optimizer param group that decide an Adam update (the learning rate is the schedule's)
_GROUP_KEYS = ("betas", "eps", "weight_decay", "wd_mult", "lr_mult", "decoupled_weight_decay", "amsgrad")


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    """The saved optimizer's param groups, hyper-parameters only (``betas``, ``eps``, ``weight_decay``, ``wd_mult``...;
    megatron-core keeps one group per (weight decay, lr) class: the 1-D parameters and biases have ``wd_mult`` 0)."""
    if not isinstance(optimizer, dict):
        return []
    inner = optimizer.get("optimizer", optimizer)
    out = []
    for group in inner.get("param_groups", []) if isinstance(inner, dict) else []:
        if isinstance(group, dict):
            item = {k: _plain(group[k]) for k in _GROUP_KEYS if k in group}
            if isinstance(item.get("betas"), (list, tuple)):
                item["betas"] = [float(b) for b in item["betas"]]
            out.append(item)
    return out


def _np(value: Any) -> Any:
    from ..frameworks import torch as ftorch

    return ftorch.to_numpy(value) if hasattr(value, "detach") else value


def _is_tensor(value: Any) -> bool:
    return type(value).__name__ in ("Tensor", "Parameter") and hasattr(value, "detach")


def _local_names(tensors: dict[str, np.ndarray], args: dict[str, Any]) -> dict[str, np.ndarray]:
    """Transformer Engine's fused-norm names back to the local spec's when the run says it used the local spec."""
    if args.get("transformer_impl") != "local":
        return tensors
    out = {}
    for name, value in tensors.items():
        for te, local in _TE_NORMS.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
                break
        out[name] = value
    return out


# ----------------------------------------------------------------------------------------------- torch_dist
def _load_dist(folder: str) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Any]]:
    from ..frameworks import torch_safe

    meta_path = os.path.join(folder, ".metadata")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{folder}: no .metadata file (a torch_dist checkpoint keeps its index there); the save "
                              "did not finish, or the folder was copied in part")
    common_path = os.path.join(folder, "common.pt")
    if not os.path.exists(common_path):
        raise CheckpointError(f"{folder}: no common.pt (megatron-core keeps the iteration, args and optimizer groups "
                              "there); the save did not finish, or the folder was copied in part")
    for name in os.listdir(folder):  # any other pickle in the folder is never read
        if name.endswith((".pt", ".pth", ".pkl", ".pickle")) and name != "common.pt":
            raise CheckpointError(f"{os.path.join(folder, name)}: an unexpected pickle in a torch_dist folder; "
                                  "tensordiff reads only .metadata, *.distcp and common.pt; fix: remove it or pass a "
                                  "clean copy of the folder")
    meta = torch_safe.load_dcp_metadata(meta_path)
    try:
        common = torch_safe.load(common_path)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{common_path}: not a readable torch file ({str(err).splitlines()[0][:160]})") from None
    if not isinstance(common, dict):
        raise CheckpointError(f"{common_path}: holds a {type(common).__name__}, not megatron-core's common state dict")
    args = _args_dict(common.get("args"))

    storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
               for idx, info in meta.storage_data.items()}
    files: dict[str, bytes] = {}

    def item_bytes(fqn: str, offset: tuple | None) -> tuple[bytes, str]:
        info = storage.get((fqn, offset))
        if info is None:
            raise CheckpointError(f"{meta_path}: no storage entry for {fqn} at offset {offset}; the metadata is "
                                  "damaged or from another save")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{os.path.join(folder, info.relative_path)}: item {fqn} is stored transformed "
                                  f"({listing(map(str, info.transform_descriptors))}), which tensordiff does not read; "
                                  "save without checkpoint compression/extensions")
        file = os.path.join(folder, info.relative_path)
        if info.relative_path not in files:
            if not os.path.exists(file):
                raise CheckpointError(f"{file}: missing; the metadata stores {fqn} there (a partial copy of the "
                                      "checkpoint?)")
            with open(file, "rb") as fh:
                files[info.relative_path] = fh.read()
        data = files[info.relative_path]
        if info.offset + info.length > len(data):
            raise CheckpointError(f"{file}: {len(data)} bytes, but the metadata stores {fqn} up to byte "
                                  f"{info.offset + info.length}; the file is truncated")
        return data[info.offset: info.offset + info.length], file

    from ..frameworks import torch as ftorch

    def chunk(fqn: str, offsets: tuple, sizes: tuple, dtype: Any) -> np.ndarray:
        blob, file = item_bytes(fqn, offsets)
        if blob[:4] == b"PK\x03\x04":  # a torch.save of the chunk (DCP's default serialisation)
            value = torch_safe.load_bytes(blob, shown_as=f"{file} ({fqn})")
            if not _is_tensor(value):
                raise CheckpointError(f"{file}: item {fqn} holds a {type(value).__name__}, not a tensor")
            arr = ftorch.to_numpy(value.contiguous())
        else:  # raw bytes (DCP's safetensors-style serialisation)
            arr = np.frombuffer(blob, dtype=_numpy_dtype(dtype)).reshape(sizes)
        if tuple(arr.shape) != tuple(sizes):
            arr = arr.reshape(sizes)
        return arr

    tensors: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    chunks: dict[str, list[tuple[int, int]]] = {}  # 1-D tensors: their chunks (offset, size), the bucket layout's check
    dist_optim: dict[str, Any] = {}  # the distributed optimizer's own state (param groups, step) of dp_reshardable
    rng = False
    for fqn, md in meta.state_dict_metadata.items():
        kind = type(md).__name__
        if kind == "BytesStorageMetadata":  # megatron's ShardedObjects: _extra_state, rng_state, ...
            if fqn.startswith("rng_state"):
                rng = True
            if re.fullmatch(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/shard_0_1", fqn):
                blob, file = item_bytes(fqn, None)
                value = torch_safe.load_bytes(blob, shown_as=f"{file} ({fqn})")
                if isinstance(value, list) and len(value) == 1:  # a ShardedObject is saved as its list of one
                    value = value[0]
                if isinstance(value, dict):
                    dist_optim[fqn.split("/")[0]] = value
            skipped[fqn.split("/")[0]] = "object"
            continue
        if len(md.size) == 1:
            chunks[fqn] = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md.chunks)
        shape = tuple(md.size)
        dtype = md.properties.dtype
        full = np.zeros(shape, dtype=_numpy_dtype(dtype))
        covered = 0
        for c in md.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            full[region] = chunk(fqn, offsets, sizes, dtype)
            covered += int(np.prod(sizes))
        if covered != int(np.prod(shape)):
            raise CheckpointError(f"{meta_path}: {fqn} {list(shape)} is covered by chunks of {covered} of its "
                                  f"{int(np.prod(shape))} elements; a shard is missing")
        tensors[fqn] = full

    model: dict[str, np.ndarray] = {}
    optim: dict[str, np.ndarray] = {}
    buckets: dict[str, np.ndarray] = {}
    for fqn, value in tensors.items():
        m = re.fullmatch(r"optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)", fqn)
        if m:
            optim.update(_unstack(f"optimizer.{m.group(1)}.", m.group(2), value))
        elif fqn.startswith("optimizer.distributed."):  # the distributed optimizer's bucket layout (dp_reshardable)
            buckets[fqn] = value
        elif fqn.startswith("optimizer."):
            skipped[fqn] = "optimizer buffer"
        else:
            model.update(_unstack("", fqn, value))
    model = _local_names(model, args)
    optim = _local_names(optim, args)
    note = None
    if buckets:
        fqns = _module_order([f for f in tensors if not f.startswith("optimizer.")], tensors)
        order = _local_names({f: tensors.get(f, np.zeros(0)) for f in fqns}, args)
        got, note = _dp_reshardable(buckets, chunks, list(order), model, args, folder)
        if note:
            skipped.update(dict.fromkeys(buckets, "optimizer buffer"))
        optim.update(got)
    out = dict(model)
    for name, value in optim.items():
        kind, param = name.split(".", 2)[1], name.split(".", 2)[2]
        if kind in ("param", "fp32_param"):
            if param in model and model[param].dtype == value.dtype:
                continue  # the main parameters are the model's own (same dtype)
            kind = "fp32_param"
        out[f"optimizer.{kind}.{param}"] = value
    opt_common = common.get("optimizer")
    step = _step(opt_common)
    groups = _groups(opt_common)
    for state in dist_optim.values():  # dp_reshardable keeps the param groups (and the step) beside the buckets
        step = step if step is not None else _step(state)
        groups = groups or _groups(state)
    info = {"iteration": common.get("iteration"), "tp": args.get("tensor_model_parallel_size"),
            "pp": args.get("pipeline_model_parallel_size"), "step": step, "optimizer_groups": groups,
            "scheduler": _scheduler(common.get("opt_param_scheduler")), "rng_state": rng or "rng_state" in common,
            "checkpoint_version": _plain(common.get("checkpoint_version")), "args": args}
    if isinstance(opt_common, dict) and opt_common.get("param_state_sharding_type"):
        info["optimizer_layout"] = opt_common["param_state_sharding_type"]
    if note:
        info["optimizer_note"] = note
    elif any(v == "optimizer buffer" for v in skipped.values()):
        info["optimizer_note"] = (f"optimizer entries of an unknown layout "
                                  f"({listing(sorted(k for k, v in skipped.items() if v == 'optimizer buffer')[:3])}): "
                                  "not mapped to parameter names")
    return out, skipped, info


# ----------------------------------------------------------------------- the distributed optimizer's buckets
def _module_order(fqns: list[str], tensors: dict[str, np.ndarray]) -> list[str]:
    """The model's parameters in module order (megatron-core's ``parameters()``, which its gradient buffer follows)
    from a torch_dist folder's keys: the stacked ``decoder.layers.X`` keys expanded layer by layer."""
    before: list[str] = []
    after: list[str] = []
    stacked: dict[str, list[str]] = {}
    for fqn in fqns:
        m = re.fullmatch(r"((?:.+\.)?layers)\.([^0-9].*)", fqn)
        if m:
            stacked.setdefault(m.group(1), []).append(m.group(2))
        else:
            (after if stacked else before).append(fqn)
    layers = []
    for prefix, rests in stacked.items():
        count = tensors[f"{prefix}.{rests[0]}"].shape[0]
        layers += [f"{prefix}.{i}.{rest}" for i in range(count) for rest in rests]
    return before + layers + after


def _pad(number: int, divisor: int) -> int:
    return -(-number // divisor) * divisor


def _bucket_layout(items: list[tuple[str, int]], unpadded: list[int] | None = None, bucket_size: int | None = None,
                   own_bucket: frozenset = frozenset()) -> tuple[list[list[tuple[str, int, int]]], list[int]]:
    """megatron-core's gradient-buffer layout with the distributed optimizer (``param_and_grad_buffer.py``): the
    parameters in reverse order, each starting at a multiple of 64 elements; a bucket closes once it holds
    ``bucket_size`` elements (or, given ``unpadded``, exactly the saved size of each bucket), the next starting at a
    multiple of 128; the shared embedding of a pipeline's end stages in a bucket of its own. Returns per bucket
    [(name, start in the bucket, numel)] and the buckets' unpadded sizes; ValueError where the sizes cannot match."""
    buckets: list[list[tuple[str, int, int]]] = []
    sizes: list[int] = []
    cur: list[tuple[str, int, int]] = []
    bucket_start = pos = end = 0

    def close(at: int) -> None:
        nonlocal cur, bucket_start, pos
        buckets.append(cur)
        sizes.append(at - bucket_start)
        cur = []
        bucket_start = pos = _pad(at, 128)

    for name, numel in reversed(items):
        start = _pad(pos, 64)
        if name in own_bucket and cur:
            close(start)
            start = pos
        end = start + numel
        cur.append((name, start - bucket_start, numel))
        length = end - bucket_start
        if unpadded is not None:
            if len(buckets) >= len(unpadded) or length > unpadded[len(buckets)]:
                raise ValueError(f"{name} ends at element {length} of bucket {len(buckets)}, past the "
                                 f"{unpadded[len(buckets)] if len(buckets) < len(unpadded) else 'no'} elements saved")
            done = length == unpadded[len(buckets)]
        else:
            done = bucket_size is not None and length >= bucket_size
        if done or name in own_bucket:
            close(end)
        else:
            pos = end
    if cur:
        close(end)
    if unpadded is not None and sizes != list(unpadded):
        raise ValueError(f"the parameters fill buckets of {listing(map(str, sizes))} elements, the checkpoint holds "
                         f"{listing(map(str, unpadded))}")
    return buckets, sizes


def _dtype_name(arr: np.ndarray) -> str:
    return str(arr.dtype)


def _check_main(out: dict[str, np.ndarray], model: dict[str, np.ndarray], where: str) -> str | None:
    """The main parameters found in the optimizer's buffers must be the model's weights (rounded to the model's dtype):
    the layout is taken as read only then."""
    for key, main in out.items():
        if not key.startswith("param."):
            continue
        name = key[len("param."):]
        weight = model[name].astype(np.float32)
        rounded = main.astype(model[name].dtype).astype(np.float32)
        tol = 1e-6 if model[name].dtype == np.float32 else 1e-2
        if not np.allclose(rounded, weight, rtol=tol, atol=tol * 1e-3):
            worst = float(np.max(np.abs(rounded - weight)))
            return (f"{where}: the distributed optimizer's main parameter for {name} differs from the saved weight "
                    f"(max |diff| {worst:.3g}): its buffer layout is not the one tensordiff rebuilds; optimizer state "
                    "not mapped to parameters")
    return None


_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((\S+?), (\S+?)\)"
                     r"\.bucket_idx_(\d+)\.(\w+)")


def _dp_reshardable(buckets: dict[str, np.ndarray], chunks: dict[str, list[tuple[int, int]]], order: list[str],
                    model: dict[str, np.ndarray], args: dict[str, Any],
                    folder: str) -> tuple[dict[str, np.ndarray], str | None]:
    """Megatron-LM's default torch_dist layout of the distributed optimizer (``dp_reshardable``): one 1-D tensor per
    gradient bucket and state (``optimizer.distributed.dp_group_idx_0.gbuf_idx_G.dtype_(P, G).bucket_idx_B.exp_avg``,
    the bucket's unpadded size), the parameters in it as in megatron-core's gradient buffer. Split per parameter:
    the layout is rebuilt from the model (``_bucket_layout``), each parameter must be one of the tensor's saved
    chunks, and the main parameters must be the saved weights."""
    parsed: dict[int, dict[int, dict[str, str]]] = {}
    dtypes: dict[int, str] = {}
    groups = set()
    for fqn in buckets:
        m = _BUCKET.fullmatch(fqn)
        if not m:
            return {}, f"{folder}: optimizer entry {fqn} is not megatron-core's dp_reshardable bucket; not mapped"
        groups.add(int(m.group(1)))
        dtypes[int(m.group(2))] = m.group(3).replace("torch.", "")
        parsed.setdefault(int(m.group(2)), {}).setdefault(int(m.group(5)), {})[m.group(6)] = fqn
    tp, pp = args.get("tensor_model_parallel_size") or 1, args.get("pipeline_model_parallel_size") or 1
    if tp * pp > 1 or groups != {0}:
        return {}, (f"{folder}: the distributed optimizer's dp_reshardable buckets of a TP={tp} PP={pp} run hold each "
                    "rank's local shards, which tensordiff does not map to full parameters; save with "
                    "--dist-ckpt-optim-fully-reshardable (per-parameter state)")
    names = [n for n in order if n in model]
    single = len({_dtype_name(model[n]) for n in names}) == 1 and len(parsed) == 1
    out: dict[str, np.ndarray] = {}
    for gbuf, per_bucket in sorted(parsed.items()):
        members = names if single else [n for n in names if _dtype_name(model[n]) == dtypes[gbuf]]
        idx = sorted(per_bucket)
        if idx != list(range(len(idx))):
            return {}, f"{folder}: gradient buffer {gbuf} has buckets {listing(map(str, idx))}: one is missing"
        sizes = [int(buckets[next(iter(per_bucket[b].values()))].shape[0]) for b in idx]
        try:
            layout, _ = _bucket_layout([(n, int(model[n].size)) for n in members], unpadded=sizes)
        except ValueError as err:
            return {}, (f"{folder}: gradient buffer {gbuf} ({dtypes[gbuf]}): {err}; the distributed optimizer's "
                        "buckets are not laid out as tensordiff rebuilds them: optimizer state not mapped")
        for b, placed in zip(idx, layout):
            for key, fqn in per_bucket[b].items():
                # each parameter is one saved chunk, or several (a parameter split between data-parallel ranks)
                starts = {o for o, _ in chunks.get(fqn, [])}
                ends = {o + n for o, n in chunks.get(fqn, [])}
                for name, start, numel in placed:
                    if start not in starts or start + numel not in ends:
                        return {}, (f"{folder}: {fqn} holds no chunk at [{start}, {start + numel}) where {name} "
                                    "belongs; the bucket layout is not megatron-core's: optimizer state not mapped")
                    if key in ("param",) + _STATES:
                        flat = buckets[fqn][start: start + numel]
                        out[f"{key}.{name}"] = np.ascontiguousarray(flat.reshape(model[name].shape))
    note = _check_main(out, model, folder)
    if note:
        return {}, note
    return {f"optimizer.{k}": v for k, v in out.items()}, None


def _numpy_dtype(dtype: Any) -> Any:
    from .. import dtypes

    name = str(dtype).replace("torch.", "")
    if name in dtypes.NUMPY_DTYPES:
        return dtypes.NUMPY_DTYPES[name]
    return np.dtype(name)


def _unstack(prefix: str, key: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """megatron-core stacks a transformer block's layers along a leading axis (``decoder.layers.X`` [num_layers, ...]):
    one tensor per layer, ``decoder.layers.{i}.X``."""
    m = re.fullmatch(r"((?:.+\.)?layers)\.([^0-9].*)", key)
    if not m:
        return {prefix + key: value}
    return {f"{prefix}{m.group(1)}.{i}.{m.group(2)}": np.ascontiguousarray(value[i]) for i in range(value.shape[0])}


# ----------------------------------------------------------------------------------------------------- torch
def _load_torch(folder: str) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, Any]]:
    from ..frameworks import torch_safe

    ranks: dict[tuple[int, int], str] = {}
    for d in os.listdir(folder):
        m = _RANK.fullmatch(d)
        if m:
            ranks[(int(m.group(2) or 0), int(m.group(1)))] = os.path.join(folder, d)
    pp = max(p for p, _ in ranks) + 1
    tp = max(t for _, t in ranks) + 1
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for p in range(pp) for t in range(tp)
               if (p, t) not in ranks]
    if missing:
        raise CheckpointError(f"{folder}: {listing(missing)} missing of the {tp} x {pp} (TP x PP) rank folders; a "
                              "shard of the model is not there")
    states: dict[tuple[int, int], dict] = {}
    for key, d in sorted(ranks.items()):
        file = os.path.join(d, "model_optim_rng.pt")
        if not os.path.exists(file):
            raise CheckpointError(f"{d}: no model_optim_rng.pt (holds {listing(sorted(os.listdir(d))) or 'nothing'})")
        try:
            obj = torch_safe.load(file)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{file}: not a readable torch checkpoint ({str(err).splitlines()[0][:160]}); is "
                                  "it truncated?") from None
        if not isinstance(obj, dict):
            raise CheckpointError(f"{file}: holds a {type(obj).__name__}, not Megatron-LM's checkpoint dict")
        if "model" not in obj and any(re.fullmatch(r"model\d+", str(k)) for k in obj):
            raise CheckpointError(f"{file}: holds {listing(sorted(k for k in obj if str(k).startswith('model')))}: "
                                  "a virtual-pipeline checkpoint (several model chunks per stage), which tensordiff "
                                  "does not join; save the run without --num-layers-per-virtual-pipeline-stage")
        if not isinstance(obj.get("model"), dict):
            raise CheckpointError(f"{file}: no 'model' state dict (holds {listing(sorted(map(str, obj)))})")
        states[key] = obj
    first = states[(0, 0)]
    args = _args_dict(first.get("args"))
    saved_tp, saved_pp = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
    if saved_tp not in (None, tp) or saved_pp not in (None, pp):
        want_tp, want_pp = saved_tp or tp, saved_pp or pp
        gone = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if want_pp > 1 else "") for p in range(want_pp)
                for t in range(want_tp) if (p, t) not in ranks]
        raise CheckpointError(f"{folder}: {listing(gone) or 'no rank folder'} missing of the {want_tp} x {want_pp} "
                              f"(TP x PP) rank folders its saved args name (holds {tp} x {pp}); a partial copy")
    if args.get("expert_model_parallel_size", 1) not in (None, 1) or any(
            ".experts." in k for s in states.values() for k in s["model"]):
        raise CheckpointError(f"{folder}: a mixture-of-experts checkpoint (expert parallel), which tensordiff does not "
                              "join; convert it to TP=1 with Megatron-LM's tools/checkpoint first")

    skipped: dict[str, str] = {}
    per_stage: list[dict[str, np.ndarray]] = []
    stage_layers: list[int] = []
    for p in range(pp):
        shards: list[dict[str, np.ndarray]] = []
        for t in range(tp):
            out = {}
            for name, value in states[(p, t)]["model"].items():
                if _is_tensor(value):
                    out[str(name)] = _np(value.contiguous())
                else:
                    skipped[str(name)] = type(value).__name__
            shards.append(out)
        per_stage.append(_join_tp(shards, folder, p))
        layers = {int(m.group(1)) for k in per_stage[-1] if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
        stage_layers.append(max(layers) + 1 if layers else 0)
    num_layers = args.get("num_layers") or sum(stage_layers)
    if pp > 1 and (num_layers % pp or any(n != num_layers // pp for n in stage_layers)):
        raise CheckpointError(f"{folder}: the pipeline stages hold {listing(map(str, stage_layers))} layers of "
                              f"{num_layers}: an uneven split, which tensordiff does not renumber; save with layers "
                              "divisible by the pipeline size")
    model: dict[str, np.ndarray] = {}
    for p, stage in enumerate(per_stage):
        offset = p * (num_layers // pp) if pp > 1 else 0
        for name, value in stage.items():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            model[f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name] = value

    info: dict[str, Any] = {"iteration": first.get("iteration"), "tp": tp, "pp": pp,
                            "step": _step(first.get("optimizer")),
                            "optimizer_groups": _groups(first.get("optimizer")),
                            "scheduler": _scheduler(first.get("opt_param_scheduler")),
                            "rng_state": bool(first.get("rng_state")),
                            "checkpoint_version": _plain(first.get("checkpoint_version")), "args": args}
    optim, note = _torch_optimizer(folder, ranks, states, tp, pp, num_layers)
    if note:
        info["optimizer_note"] = note
    out = dict(model)
    for name, value in optim.items():
        kind, param = name.split(".", 2)[1], name.split(".", 2)[2]
        if kind == "param":
            if param in model and model[param].dtype == value.dtype:
                continue
            kind = "fp32_param"
        out[f"optimizer.{kind}.{param}"] = value
    return out, skipped, info


def _gated(shards: list[dict[str, np.ndarray]], name: str) -> bool:
    """Whether ``linear_fc1`` is gated (SwiGLU: [gate; up]): it has twice the rows of ``linear_fc2``'s columns."""
    fc2 = name.replace("linear_fc1.weight", "linear_fc2.weight").replace("linear_fc1.bias", "linear_fc2.weight")
    if fc2 not in shards[0]:
        return False
    return shards[0][name].shape[0] == 2 * shards[0][fc2].shape[1]


def _join_tp(shards: list[dict[str, np.ndarray]], folder: str, stage: int) -> dict[str, np.ndarray]:
    """One pipeline stage's tensor-parallel shards joined (megatron-core's partition dims)."""
    if len(shards) == 1:
        return shards[0]
    names = list(shards[0])
    for t, s in enumerate(shards[1:], 1):
        if set(s) != set(names):
            odd = sorted(set(s) ^ set(names))
            raise CheckpointError(f"{folder}: tensor-parallel rank {t} of stage {stage} holds other tensors than rank "
                                  f"0 ({listing(odd[:3])}); not shards of one model")
    out = {}
    for name in names:
        parts = [s[name] for s in shards]
        if name.endswith(_COLUMN):
            if "linear_fc1" in name and _gated(shards, name):  # rank r holds [gate_r; up_r]
                halves = [np.split(p, 2, axis=0) for p in parts]
                out[name] = np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
            else:
                out[name] = np.concatenate(parts, axis=0)
        elif name.endswith(_ROW):
            out[name] = np.concatenate(parts, axis=1)
        else:
            out[name] = parts[0]
    return out


def _torch_optimizer(folder: str, ranks: dict, states: dict, tp: int, pp: int,
                     num_layers: int) -> tuple[dict[str, np.ndarray], str | None]:
    """The optimizer's moments per parameter from ``distrib_optim.pt`` (the distributed optimizer: flat buffers laid
    out as megatron-core's gradient buffer) or from the ``optimizer`` entry (torch's state by parameter index)."""
    from ..frameworks import torch_safe

    per_stage: list[dict[str, np.ndarray]] = []
    for p in range(pp):
        shards = []
        for t in range(tp):
            model = {k: v for k, v in states[(p, t)]["model"].items() if _is_tensor(v)}
            file = os.path.join(ranks[(p, t)], "distrib_optim.pt")
            if os.path.exists(file):
                args = _args_dict(states[(p, t)].get("args"))
                own: frozenset = frozenset()
                if pp > 1 and not args.get("untie_embeddings_and_output_weights"):  # the shared embedding's own bucket
                    own = frozenset({"embedding.word_embeddings.weight" if p == 0 else "output_layer.weight"})
                got, note = _distrib_optim(torch_safe.load(file), model, file, args, p, own)
            else:
                got, note = _torch_optim_state(states[(p, t)].get("optimizer"), model, ranks[(p, t)])
            if note:
                return {}, note
            shards.append(got)
        joined = {}
        for kind in ("param",) + _STATES:
            sub = {k[len(kind) + 1:]: v for k, v in shards[0].items() if k.startswith(kind + ".")}
            if not sub:
                continue
            parts = [{k[len(kind) + 1:]: v for k, v in s.items() if k.startswith(kind + ".")} for s in shards]
            joined.update({f"{kind}.{k}": v for k, v in _join_tp(parts, folder, p).items()})
        per_stage.append(joined)
    out = {}
    for p, stage in enumerate(per_stage):
        offset = p * (num_layers // pp) if pp > 1 else 0
        for name, value in stage.items():
            kind, param = name.split(".", 1)
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", param)
            param = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else param
            out[f"optimizer.{kind}.{param}"] = value
    return out, None


def _bucket_size(args: dict[str, Any], stage: int, numel: int) -> int | None:
    """The gradient-bucket size megatron-core used (``DistributedDataParallel``): none without
    --overlap-grad-reduce and on pipeline stages after the first; else --ddp-bucket-size, the parameters over
    --ddp-num-buckets, or max(40M, 1M x DP)."""
    if not args.get("overlap_grad_reduce") or stage > 0:
        return None
    if args.get("ddp_num_buckets"):
        return numel // int(args["ddp_num_buckets"])
    if args.get("ddp_bucket_size"):
        return int(args["ddp_bucket_size"])
    return max(40000000, 1000000 * int(args.get("data_parallel_size") or 1))


def _distrib_optim(state: Any, model: dict, file: str, args: dict[str, Any],
                   stage: int = 0, own_bucket: frozenset = frozenset()) -> tuple[dict[str, np.ndarray], str | None]:
    """Split the distributed optimizer's gathered buffers (``save_parameter_state``: per gradient buffer, the
    buckets' unpadded contents one after another) into per-parameter tensors: the layout is rebuilt with
    ``_bucket_layout`` from the saved args' bucket size, its total checked against ``numel_unpadded`` and its main
    parameters against the saved weights."""
    if not isinstance(state, dict):
        return {}, f"{file}: holds a {type(state).__name__}, not the distributed optimizer's state"
    buffers = {k: v for k, v in state.items() if isinstance(k, int)}
    params = [(n, _np(v.contiguous()) if _is_tensor(v) else v) for n, v in model.items()
              if not n.endswith("_extra_state")]
    if not buffers or any(not isinstance(b, dict) or len(b) != 1 for b in buffers.values()):
        return {}, f"{file}: {len(buffers)} gradient buffers, not one dtype each: not mapped to parameters"
    single = len(buffers) == 1
    out: dict[str, np.ndarray] = {}
    for gbuf, by_dtype in sorted(buffers.items()):
        (dtype_key, world), = by_dtype.items()
        param_dtype = str(dtype_key[0] if isinstance(dtype_key, tuple) else dtype_key).replace("torch.", "")
        members = params if single else [(n, v) for n, v in params if _dtype_name(v) == param_dtype]
        if not isinstance(world, dict) or not all(k in world for k in ("param",) + _STATES):
            return {}, f"{file}: gradient buffer {gbuf} holds no param/exp_avg/exp_avg_sq: not mapped to parameters"
        size = _bucket_size(args, stage, sum(int(v.size) for _, v in params))
        layout, sizes = _bucket_layout([(n, int(v.size)) for n, v in members], bucket_size=size,
                                       own_bucket=own_bucket)
        total = int(world.get("numel_unpadded", -1))
        if sum(sizes) != total:
            return {}, (f"{file}: the parameters fill {sum(sizes)} elements in {len(sizes)} bucket(s) of "
                        f"{size or 'unlimited'} elements, the buffer holds {total}: another bucket layout "
                        "(--ddp-bucket-size?); optimizer state not mapped to parameters")
        shapes = dict(members)
        for key in ("param",) + _STATES:
            flat = _np(world[key])
            base = 0
            for placed, bucket_numel in zip(layout, sizes):
                for name, begin, numel in placed:
                    chunk = flat[base + begin: base + begin + numel]
                    out[f"{key}.{name}"] = np.ascontiguousarray(chunk.reshape(shapes[name].shape))
                base += bucket_numel
    note = _check_main(out, dict(params), file)
    return ({}, note) if note else (out, None)


def _torch_optim_state(optimizer: Any, model: dict, where: str) -> tuple[dict[str, np.ndarray], str | None]:
    """torch's optimizer state (by parameter index) of megatron-core's non-distributed optimizer: its param groups in
    order, each listing its parameters in the model's order (weights that decay first, then the 1-D parameters and
    biases megatron-core exempts); checked against each state's shape."""
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    if not isinstance(inner, dict) and isinstance(optimizer, dict) and "state" in optimizer:
        inner = optimizer  # megatron-core's FP32Optimizer saves torch's state dict itself
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        return {}, f"{where}: no optimizer state saved (--no-save-optim?)"
    params = [(n, v) for n, v in model.items() if not n.endswith("_extra_state")]
    groups = inner["param_groups"]
    exempt = [n for n, v in params if v.ndim == 1 or n.endswith(".bias")]
    decayed = [n for n, v in params if n not in exempt]
    order: list[str] = []
    if len(groups) == 1:
        order = [n for n, _ in params]
    elif len(groups) == 2 and [g.get("wd_mult") for g in groups] == [1.0, 0.0]:
        order = decayed + exempt
    indices = [i for g in groups for i in g.get("params", [])]
    shapes = dict(params)
    if len(order) != len(indices):
        return {}, f"{where}: {len(indices)} optimizer parameters in {len(groups)} groups; not mapped to the model's"
    out = {}
    for name, idx in zip(order, indices):
        st = inner["state"].get(idx, {})
        for key in _STATES:
            if key in st:
                value = _np(st[key])
                if value.shape != shapes[name].shape:
                    return {}, (f"{where}: optimizer state {idx} is {list(value.shape)}, parameter {name} "
                                f"{list(shapes[name].shape)}; the order is not megatron-core's: not mapped")
                out[f"{key}.{name}"] = value
    return out, None


def describe(info: dict[str, Any]) -> str:
    """One line: 'iteration 3, torch_dist, TP=1 PP=1, Adam step 3, lr 6.5e-04'."""
    sched = info.get("scheduler") or {}
    parts = [f"iteration {info.get('iteration')}", str(info.get("format")), f"TP={info.get('tp')} PP={info.get('pp')}"]
    if info.get("step") is not None:
        parts.append(f"optimizer step {info['step']}")
    if sched.get("num_steps") is not None:
        parts.append(f"scheduler at {sched['num_steps']} samples")
    return ", ".join(parts)


__all__ = ["describe", "format_of", "iteration_folder", "iterations", "load_dir"]
