"""Propose a mapping file for a pair of captures no built-in mapping fits (``tensordiff map A B -o mapping.yaml``).

Evidence, strongest first:

1. **values**: at the first step both runs hold the same checkpoint, so each of B's parameters equals one
   of A's under a known transform (as is, transposed, interleaved rows, a flat reshape), or several of
   B's parameters of one parent module join into one of A's (``chunk``, ``qkv_groups``: q/k/v onto a
   fused ``linear_qkv``, gate/up onto ``linear_fc1``). Equal values under a transform are not a guess.
   Where only statistics were stored, the permutation-invariant statistics (numel, L2, mean, min,
   max) stand in for the values, and the transform is taken from the shapes;
2. **the module tree**: a module without parameters of its own (a decoder layer, an MLP) maps to the
   smallest module of A that holds the images of all its parameter modules;
3. **class, position and shape**: a parameter-free leaf (an activation, a dropout) maps to the module of
   A in its parent's image with the same class or leaf name and output shape;
4. **layouts**: each rule's activations get ``swap01`` when A's output is B's with the first two
   dimensions swapped ([S, B, H] vs [B, S, H]).

Per-layer names become one rule with ``{i}`` when A's layer numbers are B's. What stays unmatched is
listed with the reason and written, commented out, under ``ignore:``: the user decides.
Nothing here imports a framework.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..mapping.derive import DERIVED, derive
from ..mapping.names import common_parent, inside, parent
from ..record import Record
from ..store import open_capture
from ..transforms import Chunk, QkvGroups, Split, parse_op
from .autoselect import _config, _first, orient, picked_name
from .result import DiffOptions, DiffResult

#: Two parameters are the same checkpoint tensor when their relative L2 difference is below this
#: (a BF16 copy of an FP32 tensor differs by about 2e-3).
SAME = 1e-2
_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")
_HEAD_DIMS = (128, 64, 256, 96, 80, 160, 32, 16, 8, 4, 2, 1)


@dataclass
class Param:
    rec: Record
    x: np.ndarray | None

    @property
    def module(self) -> str:
        return self.rec.module

    @property
    def stats(self) -> tuple[float, ...]:
        r = self.rec
        return (float(r.numel), r.l2, r.mean, r.min, r.max)


@dataclass
class ModuleMatch:
    """B's module(s) onto A's module, with the evidence."""

    b: tuple[str, ...]
    a: str
    how: str
    """'value' (a parameter equal under ``param_ops``), 'join' (B's parameters joined), 'tree', 'class'."""
    join: str = ""
    param_ops: dict[str, str] = field(default_factory=dict)
    """B's parameter slot -> the transform that makes it A's ('' for as is)."""
    slots: dict[str, str] = field(default_factory=dict)
    """B's parameter slot -> A's, where the names differ."""
    activations: list[str] = field(default_factory=list)
    """ops on B's inputs and outputs: 'swap01' when A's are B's with the first two dimensions swapped."""
    outputs: list[str] = field(default_factory=list)
    """ops on B's outputs only, after ``activations``: the row reordering its weight needed, on the features."""
    input_slots: dict[str, str] = field(default_factory=dict)
    """B's argument -> A's, paired in order by dtype kind and shape, where the names differ (an input-only rule)."""


@dataclass
class Proposal:
    matches: list[ModuleMatch]
    unmatched_a: dict[str, str]
    """A's module -> why it has no counterpart."""
    unmatched_b: dict[str, str]
    params_by_value: int = 0
    params_total_a: int = 0
    params_total_b: int = 0
    stats_only: bool = False
    step: int = 0
    path_a: str = ""
    path_b: str = ""
    left_a: dict[str, list[Record]] = field(default_factory=dict)
    """After a trial diff with the proposed rules: A's module pattern -> its records with no counterpart."""
    left_b: dict[str, list[Record]] = field(default_factory=dict)
    trial: DiffResult | None = None
    not_compared: list[str] = field(default_factory=list)
    """Pairs the trial diff found but could not compare (their shapes differ under the proposed rules)."""
    builtin: str = ""
    """A built-in mapping ``diff`` picks for these captures by itself (its note), or '' when none fits."""
    builtin_trial: DiffResult | None = None
    """The same trial diff with that built-in mapping: what the proposal competes with."""
    findings: list[str] = field(default_factory=list)
    """What the values say against the configs (a fused QKV that matches only in another layout than the configs
    predict): said, never learnt as a mapping."""
    derived: dict = field(default_factory=dict)
    """The mapping derived from the two configs and B's module tree (``mapping.derive``), when one is: written
    instead of the value-based proposal (structure first; a wrong conversion then shows as a divergence)."""

    def yaml(self) -> str:
        return _render_derived(self) if self.derived else _render(self)


def _rel_l2(x: np.ndarray, y: np.ndarray) -> float:
    x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    den = float(np.linalg.norm(x64))
    return float(np.linalg.norm(x64 - y64)) / den if den > 0 else float(np.linalg.norm(y64))


def _close_stats(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    if a[0] != b[0]:
        return False
    scale = max(abs(a[1]), 1e-12)
    return all(abs(x - y) <= SAME * max(abs(x), abs(y), scale / max(a[0], 1.0) ** 0.5, 1e-12)
               for x, y in zip(a[1:], b[1:]))


def _one_to_one(pa: Param, pb: Param, heads: tuple[int, int] | None = None) -> str | None:
    """The transforms that make B's parameter A's ('' as is, else e.g. 'transpose, qkv_grouped(heads=4)'), or None
    when they are not the same tensor."""
    sa, sb = tuple(pa.rec.shape), tuple(pb.rec.shape)
    if not _close_stats(pa.stats, pb.stats):
        return None
    if pa.x is None or pb.x is None:  # statistics only: the shapes say which transform
        if sa == sb:
            return ""
        if len(sa) == 2 and sa == sb[::-1]:
            return "transpose"
        return "flat" if pa.rec.numel == pb.rec.numel else None
    rows = ["deinterleave", "interleave"]
    if heads:
        h, g = heads
        rows.append(f"qkv_grouped(heads={h}, groups={g})" if g != h else f"qkv_grouped(heads={h})")
    candidates: list[str] = []
    if sa == sb:
        candidates += [""] + rows
    if len(sa) == 2 and sa == sb[::-1]:
        candidates += ["transpose"] + [f"transpose, {r}" for r in rows]
    if pa.x.size == pb.x.size and sa != sb:
        candidates.append("flat")
    for text in candidates:
        try:
            if text == "flat":
                y = pb.x.reshape(sa)
            else:
                y = pb.x
                for op in filter(None, (t.strip() for t in _split_ops(text))):
                    y = parse_op(op, "map")(y)
        except Exception:
            continue
        if y.shape == pa.x.shape and _rel_l2(pa.x, y) <= SAME:
            return text
    return None


def _split_ops(text: str) -> list[str]:
    """'transpose, qkv_grouped(heads=4, groups=2)' -> ['transpose', 'qkv_grouped(heads=4, groups=2)']."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur] if cur.strip() else out


def _activation_ops(param_ops: dict[str, str]) -> list[str]:
    """Output features follow a Linear weight's rows: a row reordering of the weight reorders the last dim."""
    for text in param_ops.values():
        for op in _split_ops(text):
            op = op.strip()
            if op.startswith(("qkv_grouped", "deinterleave", "interleave")):
                name, _, args = op.partition("(")
                args = args.rstrip(")")
                return [f"{name}({args + ', ' if args else ''}dim=-1)"]
    return []


def _splits_for(shape_a: tuple[int, ...], shapes_b: list[tuple[int, ...]], heads_hint: tuple[int, int] | None
                ) -> Iterable[Split]:
    """Joins that turn parts of ``shapes_b`` (along dim 0) into ``shape_a``."""
    rows = [s[0] for s in shapes_b if s]
    if len(rows) != len(shapes_b) or sum(rows) != shape_a[0] or any(s[1:] != shape_a[1:] for s in shapes_b):
        return
    if len(set(rows)) == 1:
        yield Chunk(len(rows), 0)
    if len(rows) == 3 and rows[1] == rows[2]:
        q, k = rows[0], rows[1]
        seen = set()
        options = [heads_hint] if heads_hint else []
        options += [(q // hd, k // hd) for hd in _HEAD_DIMS if q % hd == 0 and k % hd == 0]
        for heads, groups in options:
            if heads <= 0 or groups <= 0 or heads % groups or (heads, groups) in seen:
                continue
            seen.add((heads, groups))
            yield QkvGroups(heads, groups, 0)


def _config_heads(attrs: dict) -> tuple[int, int] | None:
    cfg = _config(attrs)
    heads = _first(cfg, "num_attention_heads", "num_heads", "n_head")
    groups = _first(cfg, "num_query_groups", "num_key_value_heads", "n_kv_heads") or heads
    return (int(heads), int(groups)) if heads else None


def _out_shape(records: list[Record], module: str) -> tuple[int, ...] | None:
    for r in records:
        if r.phase == "forward" and r.module == module and r.kind == "output" and r.slot == "0":
            return tuple(r.shape)
    return None


def _in_shape(records: list[Record], module: str) -> tuple[int, ...] | None:
    """The shape of the module's first floating-point argument (for a module whose output was not recorded)."""
    from .. import dtypes

    for r in records:
        if r.phase == "forward" and r.module == module and r.kind == "input" and dtypes.is_float(r.dtype):
            return tuple(r.shape)
    return None


def propose(path_a: str, path_b: str, step: int | None = None) -> Proposal:
    """A proposed mapping of B's names onto A's, from the two captures' first common step (or ``step``)."""
    with open_capture(path_a) as ca, open_capture(path_b) as cb:
        common = sorted(set(ca.steps) & set(cb.steps))
        chosen = step if step is not None else (common[0] if common else None)
        from ..errors import UsageError

        if chosen is None or chosen not in common:
            raise UsageError(f"{path_a} (steps {ca.steps}) and {path_b} (steps {cb.steps}) have no step "
                             f"{'in common' if step is None else step} to propose a mapping from")
        recs_a, recs_b = ca.records(chosen), cb.records(chosen)
        params_a = [Param(r, ca.array(r) if r.has_data else None) for r in recs_a if r.phase == "weights"]
        params_b = [Param(r, cb.array(r) if r.has_data else None) for r in recs_b if r.phase == "weights"]
        heads = _config_heads(dict(ca.attrs)) or _config_heads(dict(cb.attrs))
        megatron = "megatron_core_version" in ca.attrs
        prop = Proposal([], {}, {}, params_total_a=len(params_a), params_total_b=len(params_b), step=chosen,
                        path_a=path_a, path_b=path_b,
                        stats_only=any(p.x is None for p in params_a + params_b))
        _match(prop, params_a, params_b, recs_a, recs_b, heads, megatron)
        _, builtin, note = orient(dict(ca.attrs), dict(cb.attrs), recs_a, recs_b, None, True)  # in either order
        if builtin is not None and note.startswith(DERIVED):
            mc, hf = (ca, cb) if "megatron_core_version" in ca.attrs else (cb, ca)
            prop.derived = derive(_config(dict(mc.attrs)), _config(dict(hf.attrs)), mc.records(chosen),
                                  hf.records(chosen)).doc
    prop.findings = list(dict.fromkeys(prop.findings))  # a weight's and its bias's finding are one
    _trial(prop)
    if builtin is not None:
        from .engine import diff

        prop.builtin = note
        try:
            prop.builtin_trial = diff(path_a, path_b, DiffOptions(mapping=builtin, steps=[chosen], auto_mapping=False,
                                                                  order_fallback=False))
        except Exception:  # the proposal stands on its own; the comparison is a courtesy
            prop.builtin_trial = None
    return prop


def _trial(prop: Proposal) -> None:
    """Diff the step with the proposed rules: what stays without a counterpart goes, commented out, into the YAML."""
    from ..mapping import RenameRules
    from .engine import diff

    rules = RenameRules.from_text(_render(prop, with_left=False), "proposed mapping")
    try:
        prop.trial = diff(prop.path_a, prop.path_b, DiffOptions(mapping=rules, steps=[prop.step], auto_mapping=False,
                                                                order_fallback=False))
    except Exception:
        return
    for row in prop.trial.rows:
        if row.verdict in ("shape", "skipped") and row.pair.a is not None:
            prop.not_compared.append(f"{row.pair.a.label} vs B's {row.pair.b.label if row.pair.b else '?'}: {row.note}")
        if row.verdict != "unmatched" or row.linked or row.accounted is not None:
            continue  # compared under another name, or accounted for by a rule: nothing for the user to ignore
        rec = row.pair.a or row.pair.b
        assert rec is not None
        side = prop.left_a if row.pair.a is not None else prop.left_b
        side.setdefault(_generalise((rec.module,), rec.module)[0][0], []).append(rec)


def _digits(name: str) -> list[str]:
    return _NUM.findall(name)


def _joins_to(split: Split, parts: list[np.ndarray | None], pa: Param) -> bool:
    """``parts`` joined by ``split`` are A's parameter ``pa`` (the same checkpoint tensor)."""
    try:
        joined = split.join(parts)  # type: ignore[arg-type]
    except Exception:
        return False
    return pa.x is not None and joined.shape == pa.x.shape and _rel_l2(pa.x, joined) <= SAME


def _shown(split: Split) -> str:
    """A split as a mapping file writes it (its default dim left out)."""
    return str(split).replace(", dim=0", "").replace("(dim=0)", "")


def _expected_qkv(pa: Param, heads: tuple[int, int] | None, megatron: bool) -> QkvGroups | None:
    """The layout the configs predict for three parameters joined into A's ``pa``: megatron-core's fused
    ``linear_qkv`` holds each query group's q heads, then its k, then its v (``qkv_groups``) with the heads and
    groups its config records; None where the configs do not say."""
    if not megatron or heads is None or not pa.module.endswith("linear_qkv") or len(pa.rec.shape) < 1:
        return None
    h, g = heads
    return QkvGroups(h, g, 0) if h > 0 and g > 0 and h % g == 0 else None


def _join_as_expected(prop: Proposal, pa: Param, params_b: list[Param], combo: tuple[int, ...],
                      expected: QkvGroups, by_module: dict[tuple[str, str], ModuleMatch],
                      order_b: dict[str, int]) -> str:
    """Three of B's parameters that join into A's fused QKV as the configs predict: in the order whose values fit,
    or, where no order fits, in B's forward order with a finding that the values fit another layout (or none): the
    mapping follows the configs, never the values, so that a wrong conversion is found at the weights. Returns what
    decided the join ('values': they fit the predicted layout; 'configs': they do not), '' when the shapes cannot be
    that layout."""
    orders = [o for o in itertools.permutations(combo)
              if _fits_shape(expected, pa, [tuple(params_b[j].rec.shape) for j in o])]
    if not orders or pa.x is None:
        return ""
    text = _shown(expected)
    for order in orders:
        if _joins_to(expected, [params_b[j].x for j in order], pa):
            names = tuple(params_b[j].module for j in order)
            by_module[(names[0], pa.module)] = ModuleMatch(names, pa.module, "join", join=text)
            return "values"
    order = min(orders, key=lambda o: [order_b.get(params_b[j].module, 1 << 30) for j in o])
    names = tuple(params_b[j].module for j in order)
    other = ""
    shapes = [tuple(params_b[j].rec.shape) for j in order]
    for split in _splits_for(tuple(pa.rec.shape), shapes, None):
        if str(split) != str(expected) and _joins_to(split, [params_b[j].x for j in order], pa):
            shown = _shown(split)
            if isinstance(split, QkvGroups) and split.groups == 1:
                shown = "[Q | K | V] (q, k and v one block each)"
            other = f" they match only if joined as {shown}"
            break
    prop.findings.append(
        f"{', '.join(names)} joined into A's {pa.module} as the configs predict ({text}: megatron-core's layout with "
        f"{expected.heads} heads in {expected.groups} query groups) do not match its values;"
        + (other + ": the conversion may be wrong" if other else " nor under any other layout tried: the checkpoints "
           "differ") + ". The mapping follows the configs, so `diff` shows it at the weights.")
    by_module[(names[0], pa.module)] = ModuleMatch(names, pa.module, "join", join=text)
    return "configs"


def _fits_shape(split: QkvGroups, pa: Param, shapes: list[tuple[int, ...]]) -> bool:
    """``shapes`` (along dim 0) are q, k, v of ``split``'s heads and groups for A's ``pa``."""
    total = pa.rec.shape[0]
    per = split.heads + 2 * split.groups
    if total % per or any(s[1:] != tuple(pa.rec.shape[1:]) for s in shapes):
        return False
    hd = total // per
    return [s[0] for s in shapes] == [split.heads * hd, split.groups * hd, split.groups * hd]


def _match(prop: Proposal, params_a: list[Param], params_b: list[Param], recs_a: list[Record],
           recs_b: list[Record], heads: tuple[int, int] | None, megatron: bool = False) -> None:
    used_a: set[int] = set()
    used_b: set[int] = set()
    by_module: dict[tuple[str, str], ModuleMatch] = {}  # (b module, a module) -> match

    # 1. one B parameter = one A parameter, under a transform. Equal values with several candidates (norm weights
    #    that are all ones) narrow to the same layer numbers and parameter name, then pair in forward order
    order_a, order_b = _forward_order(recs_a), _forward_order(recs_b)

    def take(i: int, j: int, how: str) -> None:
        used_a.add(i)
        used_b.add(j)
        pa, pb = params_a[i], params_b[j]
        m = by_module.setdefault((pb.module, pa.module), ModuleMatch((pb.module,), pa.module, "value"))
        if how:
            m.param_ops[pb.rec.slot] = how
        if pa.rec.slot != pb.rec.slot:
            m.slots[pb.rec.slot] = pa.rec.slot

    ties: dict[tuple[int, ...], list[tuple[int, dict[int, str]]]] = {}
    for j, pb in enumerate(params_b):
        hits = [(i, how) for i, pa in enumerate(params_a) if i not in used_a
                for how in [_one_to_one(pa, pb, heads)] if how is not None]
        if not hits:
            continue
        same_digits = [h for h in hits if _digits(params_a[h[0]].module) == _digits(pb.module)] or hits
        narrowed = [h for h in same_digits if params_a[h[0]].rec.slot == pb.rec.slot] or same_digits
        if len(narrowed) == 1:
            take(narrowed[0][0], j, narrowed[0][1])
        else:
            ties.setdefault(tuple(sorted(i for i, _ in narrowed)), []).append((j, dict(narrowed)))
    for candidates, tied in ties.items():
        free = sorted((i for i in candidates if i not in used_a), key=lambda i: order_a.get(params_a[i].module, 1 << 30))
        tied.sort(key=lambda m: order_b.get(params_b[m[0]].module, 1 << 30))
        for (j, hows), i in zip(tied, free):
            take(i, j, hows[i])
    prop.params_by_value = len(used_b)

    # 2. several B parameters of one parent module (same slot) joined into one A parameter
    for i, pa in enumerate(params_a):
        if i in used_a or pa.x is None:
            continue
        groups: dict[tuple[str, str], list[int]] = {}
        for j, pb in enumerate(params_b):
            if j not in used_b and pb.x is not None and pb.rec.slot == pa.rec.slot:
                groups.setdefault((parent(pb.module), pb.rec.slot), []).append(j)
        done = False
        expected = _expected_qkv(pa, heads, megatron)
        for members in groups.values():
            for n in (3, 2, 4):
                for combo in itertools.combinations(members, n):
                    if sum(params_b[j].rec.numel for j in combo) != pa.rec.numel:
                        continue
                    joined_by = (_join_as_expected(prop, pa, params_b, combo, expected, by_module, order_b)
                                 if expected is not None and n == 3 else "")
                    if joined_by:
                        used_a.add(i)
                        used_b.update(combo)
                        prop.params_by_value += 3 if joined_by == "values" else 0
                        done = True
                        break
                    for order in itertools.permutations(combo):
                        shapes = [tuple(params_b[j].rec.shape) for j in order]
                        for split in _splits_for(tuple(pa.rec.shape), shapes, heads):
                            if _joins_to(split, [params_b[j].x for j in order], pa):
                                names = tuple(params_b[j].module for j in order)
                                by_module[(names[0], pa.module)] = ModuleMatch(names, pa.module, "join",
                                                                               join=_shown(split))
                                used_a.add(i)
                                used_b.update(order)
                                prop.params_by_value += len(order)
                                done = True
                                break
                        if done:
                            break
                    if done:
                        break
                if done:
                    break
            if done:
                break

    matches = list(by_module.values())
    image: dict[str, str] = {}  # B module -> A module
    for m in matches:
        for b in m.b:
            image[b] = m.a

    # 3. containers: a B module whose parameter modules all map inside one A module maps to the smallest such
    modules_b = _forward_modules(recs_b)
    modules_a = _forward_modules(recs_a)
    taken_a = {m.a for m in matches} | {""}
    for mod in sorted(modules_b, key=lambda n: -n.count(".")):  # deepest first
        if mod in image or mod == "":
            continue
        inner = [a for b, a in image.items() if inside(b, mod) and b != mod]
        if not inner:
            continue
        target = common_parent(inner)
        while target and target not in modules_a:
            target = parent(target)
        if target in taken_a or target not in modules_a:
            continue
        matches.append(ModuleMatch((mod,), target, "tree"))
        image[mod] = target
        taken_a.add(target)

    # 4. parameter-free leaves: same class or leaf name and output shape, inside the image of the parent
    classes_a = {r.module: r.module_class for r in recs_a if r.phase == "forward"}
    classes_b = {r.module: r.module_class for r in recs_b if r.phase == "forward"}
    for mod in modules_b:
        if mod in image or mod == "":
            continue
        parent_image = _image_of_parent(mod, image)
        if parent_image is None:
            continue
        shape_b = _out_shape(recs_b, mod)
        leaf = mod.rsplit(".", 1)[-1]
        options = [a for a in modules_a if a not in taken_a and inside(a, parent_image) and a != parent_image
                   and (classes_a.get(a) == classes_b.get(mod) or a.rsplit(".", 1)[-1] == leaf)
                   and shape_b is not None and _out_shape(recs_a, a) in (shape_b, _swapped(shape_b))]
        if len(options) == 1:
            matches.append(ModuleMatch((mod,), options[0], "class"))
            image[mod] = options[0]
            taken_a.add(options[0])

    # 5. layouts of activations, and arguments paired by order, kind and shape where their names differ
    if "" in modules_a and "" in modules_b and not any(m.b == ("",) for m in matches):
        matches.append(ModuleMatch(("",), "", "tree"))
    for m in matches:
        m.outputs = _activation_ops(m.param_ops)
        m.input_slots = _pair_inputs(_inputs(recs_a, m.a), _inputs(recs_b, m.b[0])) if len(m.b) == 1 else {}
        sa = _out_shape(recs_a, m.a) or _in_shape(recs_a, m.a)
        found = [_out_shape(recs_b, b) or _in_shape(recs_b, b) for b in m.b]
        parts = [p for p in found if p is not None]
        if sa is None or len(parts) != len(found):
            continue
        sb = parts[0]
        if len(parts) > 1 and all(len(p) == len(sb) for p in parts):
            sb = sb[:-1] + (sum(p[-1] for p in parts),)
        if sa != sb and len(sa) >= 2 and sa == _swapped(sb):
            m.activations.append("swap01")

    prop.matches = matches
    mapped_a = {m.a for m in matches}
    for mod in modules_a:
        if mod and mod not in mapped_a and not any(inside(mod, a) and a for a in mapped_a if _is_leaf_image(a, matches)):
            prop.unmatched_a[mod] = _why(mod, classes_a.get(mod, ""), params_a)
    for mod in modules_b:
        if mod and mod not in image:
            prop.unmatched_b[mod] = _why(mod, classes_b.get(mod, ""), params_b)


def _inputs(records: list[Record], module: str) -> list[Record]:
    return [r for r in records if r.phase == "forward" and r.module == module and r.kind == "input" and r.call == 0]


def _pair_inputs(ins_a: list[Record], ins_b: list[Record]) -> dict[str, str]:
    """B's argument names -> A's where they differ. Arguments of one name pair by name; floating-point ones by
    order and shape (or swapped shape); integer and boolean ones (ids, positions, labels, masks look alike) only
    when they are both the first argument, or the only one of their dtype and shape on each side."""
    from .. import dtypes

    names_a = {r.slot for r in ins_a}
    used = {r.slot for r in ins_b if r.slot in names_a}
    out: dict[str, str] = {}

    def fits(ra: Record, rb: Record) -> bool:
        return tuple(ra.shape) in (tuple(rb.shape), _swapped(tuple(rb.shape)))

    for pos_b, rb in enumerate(ins_b):
        if rb.slot in names_a:
            continue
        free = [ra for ra in ins_a if ra.slot not in used]
        if dtypes.is_float(rb.dtype):
            hit = next((ra for ra in free if dtypes.is_float(ra.dtype) and fits(ra, rb)), None)
        else:
            alike_a = [ra for ra in ins_a if ra.dtype == rb.dtype and tuple(ra.shape) == tuple(rb.shape)]
            alike_b = [x for x in ins_b if x.dtype == rb.dtype and tuple(x.shape) == tuple(rb.shape)]
            first = pos_b == 0 and ins_a and ins_a[0] in free and ins_a[0].dtype == rb.dtype and fits(ins_a[0], rb)
            hit = ins_a[0] if first else (alike_a[0] if len(alike_a) == 1 and len(alike_b) == 1
                                          and alike_a[0] in free else None)
        if hit is not None:
            used.add(hit.slot)
            out[rb.slot] = hit.slot
    return out


def _is_leaf_image(a: str, matches: list[ModuleMatch]) -> bool:
    """Whether ``a`` is matched by value or join (its submodules hold nothing of its own to compare)."""
    return any(m.a == a and m.how in ("value", "join") for m in matches)


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[1], shape[0]) + shape[2:] if len(shape) >= 2 else shape


def _image_of_parent(mod: str, image: dict[str, str]) -> str | None:
    up = parent(mod)
    while True:
        if up in image:
            return image[up]
        if up == "":
            return None
        up = parent(up)


def _forward_order(records: list[Record]) -> dict[str, int]:
    """Module -> the rank of its first forward record (execution order)."""
    out: dict[str, int] = {}
    for r in sorted(records, key=lambda r: r.seq):
        if r.phase == "forward" and r.module not in out:
            out[r.module] = len(out)
    return out


def _forward_modules(records: list[Record]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        if r.phase == "forward":
            seen.setdefault(r.module, None)
    return list(seen)


def _why(mod: str, cls: str, params: list[Param]) -> str:
    own = [p for p in params if p.module == mod]
    what = f"{cls}, " if cls else ""
    if own:
        return f"{what}its parameters match none of the other side's by value (another checkpoint, or a transform " \
               "tensordiff does not know)"
    return f"{what}no parameters, and nothing in its parent's place on the other side with its class or name and " \
           "output shape"


# ------------------------------------------------------------------------------------------- YAML
def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


_PLACEHOLDERS = "ijklmn"


def _generalise(b: tuple[str, ...], a: str) -> tuple[tuple[str, ...], str]:
    """Layer numbers that A and B share become placeholders ``{i}``, ``{j}``, ... on both sides."""
    digits_b = _digits(b[0])
    digits_a = _digits(a)
    if (not digits_b or any(_digits(x) != digits_b for x in b[1:]) or len(digits_b) > len(_PLACEHOLDERS)
            or [d for d in digits_a if d in digits_b] != digits_a or len(set(digits_b)) != len(digits_b)
            or not digits_a):
        return b, a  # each of A's numbers must be one of B's, in order
    name_of = {d: _PLACEHOLDERS[k] for k, d in enumerate(digits_b)}

    def generic(name: str) -> str:
        return _NUM.sub(lambda m: "{" + name_of[m.group(0)] + "}", name)

    return tuple(generic(x) for x in b), generic(a)


def _side_names(p: Proposal) -> tuple[str, str]:
    """The two sides' names in the file: the captures' file names (``mcore.h5`` -> mcore), else a and b."""
    def stem(path: str) -> str:
        base = re.sub(r"(\.rank\*)?\.h5$", "", path.replace("\\", "/").rsplit("/", 1)[-1])
        return re.sub(r"[^A-Za-z0-9_-]", "_", base)

    a, b = stem(p.path_a), stem(p.path_b)
    return (a, b) if a and b and a != b and a[0].isalpha() and b[0].isalpha() else ("a", "b")


def _render_derived(p: Proposal) -> str:
    """The derived mapping as a pair file, with what the values said against it."""
    import yaml

    lines = ["# Derived by `tensordiff map` from the two captures' configs and B's module tree: each module's role from",
             "# its parameters' shapes, the configs' sizes and the order it ran; values did not choose the layout, so a",
             "# wrong conversion shows as a divergence. tensordiff diff derives the same mapping by itself; edit it, then:",
             f"#   tensordiff diff {p.path_a} {p.path_b} --mapping THIS_FILE",
             *[f"# FINDING: {f}" for f in p.findings]]
    return "\n".join(lines) + "\n" + yaml.safe_dump(p.derived, sort_keys=False, width=120, default_flow_style=None)


def _render(p: Proposal, with_left: bool = True) -> str:
    side_a, side_b = _side_names(p)
    lines = [
        "# Proposed by `tensordiff map` from two captures; read it, edit it, then:",
        f"#   tensordiff diff {p.path_a} {p.path_b} --mapping THIS_FILE",
        f"# Evidence: {p.params_by_value} of B's {p.params_total_b} parameters matched A's by value at step {p.step}"
        + (" (statistics only: transforms taken from the shapes)" if p.stats_only else "")
        + "; the rest of the rules follow the module tree, classes and shapes.",
        f"# Each rule renames {side_b}'s modules (B) onto {side_a}'s (A); {{i}} is a layer number (docs/mapping.md).",
        *([f"# A mapping tensordiff diff picks by itself fits these captures already: {picked_name(p.builtin)}; "
           "tensordiff diff uses it without --mapping. Prefer it."]
          if p.builtin else []),
        *[f"# FINDING: {f}" for f in p.findings],
        "# Make a mapping from a pair known to be good (the same model, correctly converted): one proposed from a pair",
        "# whose conversion is wrong would fit the wrong layout where the configs do not fix it.",
        "tensordiff_mapping: 2",
        "description: proposed by tensordiff map",
        f"sides: [{side_a}, {side_b}]",
        "modules:",
        "  order_fallback: false",
        "  rules:",
    ]
    seen: set[str] = set()
    for m in sorted(p.matches, key=lambda m: (m.a.count("."), m.a)):
        bs, a = _generalise(m.b, m.a)
        key = repr((bs, a, m.join, sorted(m.param_ops.items()), sorted(m.slots.items()), tuple(m.activations), tuple(m.outputs),
                    sorted(m.input_slots.items())))
        if key in seen:
            continue
        seen.add(key)
        why = {"value": "parameters equal by value", "join": "parameters joined, equal by value",
               "tree": "holds the images of its submodules", "class": "same class or name and output shape"}[m.how]
        b_text = _q(bs[0]) if len(bs) == 1 else "[" + ", ".join(_q(x) for x in bs) + "]"
        if m.input_slots:
            lines.append(f"    - {side_b}: {b_text}    # arguments named differently, paired by order, dtype and shape")
            lines.append(f"      {side_a}: {_q(a)}")
            lines.append("      kinds: [input, grad_input]")
            lines.append("      only_slots: [" + ", ".join(_q(k) for k in m.input_slots) + "]")
            lines.append("      slots: {" + ", ".join(f"{_q(k)}: {_q(v)}" for k, v in m.input_slots.items()) + "}")
            if m.activations:
                lines.append(f"      activations: [{', '.join(_q(x) for x in m.activations)}]")
        if m.b == ("",) and m.how == "tree":
            continue  # the roots pair by name already; only their arguments needed a rule
        lines.append(f"    - {side_b}: {b_text}    # {why}")
        lines.append(f"      {side_a}: {_q(a)}")
        if m.join:
            lines.append(f"      split: {_q(m.join)}")
        if m.slots:
            lines.append("      slots: {" + ", ".join(f"{_q(k)}: {_q(v)}" for k, v in m.slots.items()) + "}")
        ops = {k: v for k, v in m.param_ops.items() if v and v != "flat"}
        if ops:
            lines.append("      params: {" + ", ".join(f"{_q(k)}: [{', '.join(_q(o.strip()) for o in _split_ops(v))}]"
                                                  for k, v in ops.items()) + "}")
        if m.outputs:
            if m.activations:
                lines.append(f"      inputs: [{', '.join(_q(x) for x in m.activations)}]")
            lines.append(f"      outputs: [{', '.join(_q(x) for x in m.activations + m.outputs)}]")
        elif m.activations:
            lines.append(f"      activations: [{', '.join(_q(x) for x in m.activations)}]")
    if not with_left:
        return "\n".join(lines) + "\n"
    if p.not_compared:
        lines.append("# Pairs found but not compared (their shapes differ: a transform is missing, or the tensors differ in "
                     "kind, e.g. a per-token loss against a mean); add the transform, or ignore one side:")
        lines += [f"#   {x}" for x in p.not_compared]
    if p.left_a or p.left_b:
        lines.append("# Records with no counterpart on the other side (a trial diff of step "
                     f"{p.step} with the rules above); uncomment what should be left out, or write a rule:")
        lines.append("#   ignore:")
    for side, name, left, unmatched in (("a", side_a, p.left_a, p.unmatched_a), ("b", side_b, p.left_b, p.unmatched_b)):
        if not left:
            continue
        lines.append(f"#     {name}:    # {side.upper()}")
        for pattern, recs in left.items():
            module = recs[0].module
            why = unmatched.get(module, "")
            if why:
                lines.append(f"#       - {_q(pattern)}    # {why}")
                continue
            kinds = sorted({r.kind for r in recs})
            slots = sorted({r.slot for r in recs})
            lines.append(f"#       - {{module: {_q(pattern)}, kinds: [{', '.join(kinds)}], "
                         f"slots: [{', '.join(_q(x) for x in slots)}]}}")
    return "\n".join(lines) + "\n"
