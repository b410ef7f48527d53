"""Line up the records of two captures, in documented passes.

1. rules: the mapping file's rename rules (regex on B's module name -> A's), which may
   also rename slots and name layout transforms for B's tensors; they come first so that
   a tensor stored differently under the same name gets its transform;
2. exact: same phase, module name, call index, kind and slot (after the mapping's
   ``strip_b`` prefixes);
3. wrapper prefixes: names equal once ``module.`` / ``_orig_mod.`` wrappers are dropped
   (Megatron's Float16Module, DDP, torch.compile);
4. tensor: a gradient pairs with the other side's gradient of the same forward tensor,
   whichever module name each side recorded that tensor under first;
5. order: what is left, per phase, matched in execution order where kind and shape agree
   (off with ``order_fallback: false`` in the mapping, or ``--no-order``).

Whatever is still unmatched is reported as unmatched, never as passing.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .._yaml import load_yaml
from ..errors import MappingError
from ..mappings import rename_rules
from ..record import PHASES, Record
from ..transforms import Op, parse_op

_WRAPPERS = ("module.", "_orig_mod.")
MatchHow = Literal["exact", "prefix", "rule", "tensor", "order", ""]
_PARAM_KINDS = ("param", "grad")


@dataclass(frozen=True)
class Pair:
    """A record of A and its counterpart in B (either may be None: unmatched)."""

    a: Record | None
    b: Record | None
    how: MatchHow = ""
    """Which pass matched it: 'exact', 'prefix', 'rule', 'tensor', 'order', or '' for unmatched."""
    ops: tuple[Op, ...] = ()
    """transforms that bring B's tensor into A's layout."""

    @property
    def matched(self) -> bool:
        return self.a is not None and self.b is not None


@dataclass
class Rule:
    b: re.Pattern
    a: str
    phases: frozenset[str] | None = None
    kinds: frozenset[str] | None = None
    slots: dict[str, str] = field(default_factory=dict)
    only_slots: frozenset[str] | None = None
    inputs: tuple[Op, ...] = ()
    outputs: tuple[Op, ...] = ()
    params: dict[str, tuple[Op, ...]] = field(default_factory=dict)

    def target(self, rec: Record, module: str | None = None) -> tuple[tuple, tuple[Op, ...]] | None:
        """Where B's record goes in A (and B's transforms), or None; ``module``: B's name with the mapping's prefixes stripped."""
        if self.phases is not None and rec.phase not in self.phases:
            return None
        if self.kinds is not None and rec.kind not in self.kinds:
            return None
        if self.only_slots is not None and rec.kind not in _PARAM_KINDS and rec.slot not in self.only_slots:
            return None
        m = self.b.fullmatch(rec.module if module is None else module)
        if not m:
            return None
        name = m.expand(self.a)
        slot = self.slots.get(rec.slot, rec.slot)
        if rec.kind in _PARAM_KINDS:
            ops = self.params.get(rec.slot, ())
        else:
            ops = self.inputs if rec.kind in ("input", "grad_input") else self.outputs
        return (rec.phase, name, rec.call, rec.kind, slot), ops


@dataclass(frozen=True)
class Ignore:
    """Records left out on purpose: a module regex, optionally only some kinds or slots."""

    module: re.Pattern
    kinds: frozenset[str] | None = None
    slots: frozenset[str] | None = None

    def hits(self, rec: Record, module: str | None = None) -> bool:
        """``module``: the record's module name as the rules see it (B's with the mapping's prefixes stripped)."""
        return (self.module.fullmatch(rec.module if module is None else module) is not None
                and (self.kinds is None or rec.kind in self.kinds)
                and (self.slots is None or rec.slot in self.slots))


@dataclass
class RenameRules:
    """Rename rules from B's names to A's (a YAML file; see docs/mapping.md)."""

    rules: list[Rule] = field(default_factory=list)
    order_fallback: bool = True
    ignore_a: list[Ignore] = field(default_factory=list)
    ignore_b: list[Ignore] = field(default_factory=list)
    strip_b: tuple[str, ...] = ()
    """prefixes dropped from B's module names before matching (a wrapper A does not have)."""
    description: str = ""
    path: str = ""

    @classmethod
    def load(cls, path: str, variables: dict[str, str] | None = None) -> RenameRules:
        """Load a mapping file, or a built-in mapping by name (see ``rename_rules()``)."""
        if not os.path.exists(path) and path in rename_rules():
            path = rename_rules()[path]
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as err:
            raise MappingError(f"{path}: cannot read the mapping file ({err.strerror}); check the --mapping path") from None
        return cls.from_text(text, path, variables)

    @classmethod
    def from_text(cls, text: str, path: str = "<mapping>", variables: dict[str, str] | None = None) -> RenameRules:
        doc = load_yaml(text, path, "mapping file")
        if not isinstance(doc, dict) or "rules" not in doc:
            raise MappingError(f"{path}: a mapping file is a YAML mapping with a 'rules:' list (see docs/mapping.md)")
        values = {str(k): str(v) for k, v in (doc.get("vars") or {}).items()}
        values.update(variables or {})

        def subst(text: Any, where: str) -> str:
            def repl(m: re.Match) -> str:
                if m.group(1) not in values:
                    raise MappingError(f"{path}: {where} uses ${{{m.group(1)}}} but no value is set; add it under vars: or "
                                       f"pass --var {m.group(1)}=VALUE")
                return values[m.group(1)]
            return re.sub(r"\$\{(\w+)\}", repl, str(text))

        def ops(items: Any, where: str) -> tuple[Op, ...]:
            if items is None:
                return ()
            if isinstance(items, str):
                items = [items]
            return tuple(parse_op(subst(i, where), f"{path}: {where}") for i in items)

        def patterns(items: Any, where: str) -> list[Ignore]:
            out = []
            for item in items or []:
                spec = item if isinstance(item, dict) else {"module": item}
                if "module" not in spec:
                    raise MappingError(f"{path}: {where}: an entry is a module regex or {{module: REGEX, kinds: [...], "
                                       f"slots: [...]}}, got {item!r}")
                try:
                    pattern = re.compile(subst(spec["module"], where))
                except re.error as err:
                    raise MappingError(f"{path}: {where}: bad regular expression {spec['module']!r} ({err})") from None
                kinds = spec.get("kinds")
                slots = spec.get("slots")
                out.append(Ignore(pattern, frozenset(kinds) if kinds is not None else None,
                                  frozenset(str(x) for x in slots) if slots is not None else None))
            return out

        rules = []
        for i, raw in enumerate(doc["rules"] or []):
            where = f"rule {i + 1}"
            if not isinstance(raw, dict) or "a" not in raw or "b" not in raw:
                raise MappingError(f"{path}: {where} needs both 'a:' (A's module name) and 'b:' (a regex on B's module name)")
            try:
                pattern = re.compile(subst(raw["b"], where))
            except re.error as err:
                raise MappingError(f"{path}: {where}: bad regular expression {raw['b']!r} ({err})") from None
            phases = raw.get("phases")
            if phases is not None:
                unknown = set(phases) - set(PHASES)
                if unknown:
                    raise MappingError(f"{path}: {where}: unknown phase(s) {sorted(unknown)}; phases are {', '.join(PHASES)}")
            rules.append(
                Rule(
                    b=pattern,
                    a=subst(raw["a"], where),
                    phases=frozenset(phases) if phases is not None else None,
                    kinds=frozenset(raw["kinds"]) if raw.get("kinds") is not None else None,
                    slots={str(k): str(v) for k, v in (raw.get("slots") or {}).items()},
                    only_slots=frozenset(str(x) for x in raw["only_slots"]) if raw.get("only_slots") is not None else None,
                    inputs=ops(raw.get("inputs", raw.get("activations")), where),
                    outputs=ops(raw.get("outputs", raw.get("activations")), where),
                    params={str(k): ops(v, where) for k, v in (raw.get("params") or {}).items()},
                )
            )
        return cls(
            rules=rules,
            order_fallback=bool(doc.get("order_fallback", True)),
            ignore_a=patterns(doc.get("ignore_a"), "ignore_a"),
            ignore_b=patterns(doc.get("ignore_b"), "ignore_b"),
            strip_b=tuple(str(p) for p in (doc.get("strip_b") or [])),
            description=str(doc.get("description", "")),
            path=path,
        )


def _strip_wrappers(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        if name in ("module", "_orig_mod"):
            name, changed = "", True
    return name


def _pair_gradients_by_tensor(a_list: list[Record], b_list: list[Record],
                              partner: dict[int, tuple[Record, MatchHow, tuple[Op, ...]]], taken_b: set[int]) -> None:
    # a_list/b_list hold every record of the step, ignored ones included: a tensor may have
    # been seen first (and its gradient recorded) under a module the mapping leaves out
    """Gradients follow their tensor, not the name they were recorded under.

    A tensor passed from one module to the next is recorded once and linked (``same_as``)
    from its other names, and its gradient is recorded under the first name. The two
    frameworks may see the same tensor first under different names (a MindSpore
    ``activation_func`` cell's output is Megatron's ``linear_fc2`` input): two gradients
    pair when the forward tensors they belong to were paired under any of their names.
    """
    canon_a = {r.seq: (r.same_as if r.same_as >= 0 else r.seq) for r in a_list if r.phase == "forward"}
    canon_b = {r.seq: (r.same_as if r.same_as >= 0 else r.seq) for r in b_list if r.phase == "forward"}
    tensor_pairs: dict[int, list[tuple[int, tuple[Op, ...]]]] = {}  # canonical B seq -> [(canonical A seq, ops)]
    for a_seq, (rb, _, ops) in partner.items():
        if a_seq in canon_a and rb.seq in canon_b:
            tensor_pairs.setdefault(canon_b[rb.seq], []).append((canon_a[a_seq], ops))
    open_a: dict[int, Record] = {}
    for ra in a_list:
        if ra.phase == "backward" and ra.grad_of >= 0 and ra.seq not in partner:
            open_a.setdefault(ra.grad_of, ra)
    for rb in b_list:
        if rb.phase != "backward" or rb.grad_of < 0 or rb.seq in taken_b:
            continue
        for a_tensor, ops in tensor_pairs.get(rb.grad_of, ()):
            ra_open = open_a.pop(a_tensor, None)
            if ra_open is not None:
                partner[ra_open.seq] = (rb, "tensor", ops)
                taken_b.add(rb.seq)
                break


def align_step(recs_a: list[Record], recs_b: list[Record], mapping: RenameRules | None = None,
               order_fallback: bool = True) -> list[Pair]:
    """Pairs for one step, in A's order; unmatched B records appended per phase."""
    mapping = mapping or RenameRules()
    def b_name(r: Record) -> str:
        for prefix in mapping.strip_b:
            if r.module.startswith(prefix):
                return r.module[len(prefix):]
            if r.module == prefix.rstrip("."):
                return ""
        return r.module

    ignored_a = {r.seq for r in recs_a if any(i.hits(r) for i in mapping.ignore_a)}
    ignored_b = {r.seq for r in recs_b if any(i.hits(r, b_name(r)) for i in mapping.ignore_b)}
    a_list = [r for r in recs_a if r.seq not in ignored_a]
    b_list = [r for r in recs_b if r.seq not in ignored_b]
    partner: dict[int, tuple[Record, MatchHow, tuple[Op, ...]]] = {}  # a.seq -> (b, how, ops)
    taken_b: set[int] = set()

    def run_pass(key_a: Callable[[Record], tuple], keys_b: Callable[[Record], list[tuple[tuple, tuple[Op, ...]]]],
                 how: MatchHow) -> None:
        index: dict[tuple, Record] = {}
        for ra in a_list:
            if ra.seq not in partner:
                index.setdefault(key_a(ra), ra)
        for rb in b_list:
            if rb.seq in taken_b:
                continue
            for key, ops in keys_b(rb):
                hit_a = index.pop(key, None)
                if hit_a is not None:
                    partner[hit_a.seq] = (rb, how, ops)
                    taken_b.add(rb.seq)
                    break

    def by_rules(rb: Record) -> list[tuple[tuple, tuple[Op, ...]]]:
        out = []
        for rule in mapping.rules:
            hit = rule.target(rb, b_name(rb))
            if hit is not None:
                (phase, name, call, kind, slot), ops = hit
                out.append(((phase, _strip_wrappers(name), call, kind, slot), ops))
        return out

    def stripped(r: Record, name: str) -> tuple:
        return (r.phase, _strip_wrappers(name), r.call, r.kind, r.slot)

    # rules first: a rule may give a tensor of the same name a layout transform (interleaved fc1)
    if mapping.rules:
        run_pass(lambda r: stripped(r, r.module), by_rules, "rule")
    run_pass(lambda r: r.key, lambda r: [((r.phase, b_name(r), r.call, r.kind, r.slot), ())], "exact")
    run_pass(lambda r: stripped(r, r.module), lambda r: [(stripped(r, b_name(r)), ())], "prefix")

    _pair_gradients_by_tensor(recs_a, recs_b, partner, taken_b)

    if order_fallback and mapping.order_fallback:
        for phase in PHASES:
            rest_a = [r for r in a_list if r.phase == phase and r.seq not in partner]
            rest_b = [r for r in b_list if r.phase == phase and r.seq not in taken_b]
            if not rest_a or not rest_b:
                continue
            tok_a = [(r.kind, r.shape) for r in rest_a]
            tok_b = [(r.kind, r.shape) for r in rest_b]
            matcher = difflib.SequenceMatcher(a=tok_a, b=tok_b, autojunk=False)
            for block in matcher.get_matching_blocks():
                for i in range(block.size):
                    ra, rb = rest_a[block.a + i], rest_b[block.b + i]
                    partner[ra.seq] = (rb, "order", ())
                    taken_b.add(rb.seq)

    pairs: list[Pair] = []
    for phase in PHASES:
        for ra in recs_a:
            if ra.phase != phase:
                continue
            hit = partner.get(ra.seq)
            if hit:
                pairs.append(Pair(ra, hit[0], hit[1], hit[2]))
            elif ra.seq not in ignored_a:
                pairs.append(Pair(ra, None))
        for rb in recs_b:
            if rb.phase == phase and rb.seq not in taken_b and rb.seq not in ignored_b:
                pairs.append(Pair(None, rb))
    return pairs
