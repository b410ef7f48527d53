"""A megatron-core <-> Hugging Face mapping derived from the two recorded configs and the HF module tree.

No family list decides the names: each HF decoder layer's modules get their role from their parameters' shapes
against the configs' sizes and from the order they ran in (``hidden -> (heads + 2 groups) * head_dim``: a fused
QKV; ``hidden -> heads * head_dim`` then two ``hidden -> groups * head_dim``: q, k, v; ``hidden -> 2 ffn``: a fused
gate/up; two ``hidden -> ffn``: gate then up; ``ffn -> hidden``: down; ``hidden -> experts``: a router; a
``[hidden]`` weight: a norm, the first before attention, the second before the MLP; ``[head_dim]``: q then k norm;
a norm class with no parameters: a parameter-free norm). megatron-core's names are its own (one framework).

What the configs cannot say is in ``CONVENTIONS``, by the HF ``model_type``: the order of a fused QKV's rows and a
norm that multiplies by ``1 + w`` (Gemma). Where megatron-core has no counterpart for what the HF layer computes
(a norm after attention or after the MLP, attention sinks), ``derive`` says so in one line (``Derived.cannot``)
instead of letting the diff report a false divergence.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..record import Record
from .modules import RenameRules, parse
from .names import common_parent, inside, parent, unwrap
from .pairfile import PairFile


@dataclass(frozen=True)
class Convention:
    """What a family's config does not say."""

    qkv: str = "concat"
    """a fused QKV's rows: 'concat' ([all q | all k | all v]: Phi-3) or 'heads' (per head [q_h, k_h, v_h], megatron's
    own order when groups = heads: GPT-NeoX)."""
    norm_offset: float = 0.0
    """the norm multiplies by ``offset + w`` (Gemma: 1): a converted megatron weight is ``w + offset``."""
    gate_up: str = "stacked"
    """experts held as one tensor: their gate and up columns 'stacked' ([gate | up]) or 'interleaved' (GPT-OSS)."""


#: HF ``model_type`` -> what its config does not say (every other family: the defaults).
CONVENTIONS: dict[str, Convention] = {
    "gemma": Convention(norm_offset=1.0),
    "gemma2": Convention(norm_offset=1.0),
    "gemma3": Convention(norm_offset=1.0),
    "gemma3_text": Convention(norm_offset=1.0),
    "gpt_neox": Convention(qkv="heads"),
    "gpt_oss": Convention(gate_up="interleaved"),
}

#: How a derived mapping's note begins (``tensordiff map`` and the report recognise it).
DERIVED = "derived from the captures"
_INDEXED = re.compile(r"^(.*)\.(\d+)$")
_NORM_CLASS = re.compile(r"norm", re.IGNORECASE)


@dataclass
class Layer:
    """The roles found in one HF decoder layer (names relative to the layer)."""

    norms: list[str] = field(default_factory=list)
    attention: str = ""
    q: str = ""
    k: str = ""
    v: str = ""
    qkv: str = ""
    q_norm: str = ""
    k_norm: str = ""
    o: str = ""
    mlp: str = ""
    gate: str = ""
    up: str = ""
    gate_up: str = ""
    fc1: str = ""
    down: str = ""
    router: str = ""
    experts: dict[int, tuple[str, str, str]] = field(default_factory=dict)
    """expert number -> (gate, up, down), or ('', fc1, down) without a gate; fused gate/up as (gate_up, '', down)."""
    expert_fused: bool = False
    packed: str = ""
    """one module holding every expert's weights as [experts, ...] tensors (GPT-OSS)."""
    packed_slots: dict[str, str] = field(default_factory=dict)
    """its parameter slot -> role: 'gate_up' / 'down' as x @ W ('_xw') or W @ x ('_wx'), 'gate_up_bias', 'down_bias'."""
    sinks: str = ""
    """the attention module's per-head parameter (attention sinks: megatron's learnable softmax offset)."""
    mla: dict[str, str] = field(default_factory=dict)
    """multi-latent attention (DeepSeek): megatron's module name -> HF's (linear_q_down_proj, linear_q_up_proj or
    linear_q_proj, linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm)."""
    shared: tuple[str, str, str] = ("", "", "")
    """the MoE block's shared expert: (gate, up, down)."""
    problems: list[str] = field(default_factory=list)
    """what does not fit the roles the configs predict: no mapping is derived."""
    cannot: list[str] = field(default_factory=list)
    """what megatron-core's layer cannot compute: no mapping is derived, and the diff says why."""

    def signature(self) -> tuple:
        return (tuple(self.norms), self.attention, self.q, self.k, self.v, self.qkv, self.q_norm, self.k_norm, self.o,
                self.mlp, self.gate, self.up, self.gate_up, self.fc1, self.down, self.router,
                tuple(sorted(self.experts.items())), self.expert_fused, self.packed, tuple(self.packed_slots.items()),
                self.sinks, tuple(sorted(self.mla.items())), self.shared)


@dataclass
class Derived:
    rules: RenameRules | None
    note: str
    cannot: list[str] = field(default_factory=list)
    """what megatron-core cannot express of this HF model, one line each."""
    doc: dict[str, Any] = field(default_factory=dict)
    """the pair file the rules were parsed from (``tensordiff map`` writes it)."""


def _int(cfg: dict[str, Any], *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and v:
            return int(v)
    return None


def _is_norm(tree: _Tree, mod: str, hidden: int) -> bool:
    """A norm over the hidden size: a ``[hidden]`` weight and nothing 2-D, or a norm class with no parameters."""
    params = tree.params.get(mod, {})
    if params:
        return params.get("weight") == (hidden,)
    return bool(_NORM_CLASS.search(tree.cls.get(mod, ""))) and not tree.under(mod)


def _rel(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else name


class _Tree:
    """One step's records of the HF side: parameter shapes per module, classes, forward order."""

    def __init__(self, records: list[Record]):
        self.params: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
        self.cls: dict[str, str] = {}
        self.order: dict[str, int] = {}
        for r in sorted(records, key=lambda r: r.seq):
            mod = unwrap(r.module)
            if r.module_class:
                self.cls.setdefault(mod, r.module_class)
            if r.phase == "weights" and r.kind == "param":
                self.params[mod][r.slot] = tuple(r.shape)
            elif r.phase == "forward" and mod not in self.order:
                self.order[mod] = len(self.order)
        self.modules = sorted(set(self.cls) | set(self.params), key=lambda m: (self.order.get(m, 1 << 30), m))

    def under(self, prefix: str) -> list[str]:
        return [m for m in self.modules if m.startswith(prefix + ".")]

    def weight(self, mod: str) -> tuple[int, ...] | None:
        return self.params.get(mod, {}).get("weight")


def _layer_stack(tree: _Tree, layers: int | None) -> tuple[str, int] | None:
    """(the module list holding the decoder layers, how many): the numbered parent whose children number ``layers``
    (or the most), the shortest name first."""
    count: dict[str, set[int]] = defaultdict(set)
    for mod in tree.params:
        for prefix in _prefixes(mod):
            m = _INDEXED.match(prefix)
            if m:
                count[m.group(1)].add(int(m.group(2)))
    fits = [(len(ix), p) for p, ix in count.items() if ix == set(range(len(ix))) and (layers is None or len(ix) == layers)]
    if not fits:
        return None
    n, stack = min(fits, key=lambda t: (-t[0], len(t[1])))
    return stack, n


def _prefixes(name: str) -> list[str]:
    segs = name.split(".")
    return [".".join(segs[:k]) for k in range(1, len(segs) + 1)]


def _roles(tree: _Tree, prefix: str, sizes: dict[str, int]) -> Layer:
    """The roles of one layer's modules, from shapes and forward order."""
    h, hd, nh, ng = sizes["hidden"], sizes["head_dim"], sizes["heads"], sizes["groups"]
    ffn, moe_ffn, experts = sizes.get("ffn"), sizes.get("moe_ffn"), sizes.get("experts")
    layer = Layer()
    mods = tree.under(prefix)
    expert_of: dict[str, int] = {}
    for mod in mods:  # modules inside a numbered child of a list in the layer: [... .experts.3.w1]
        segs = _rel(mod, prefix).split(".")
        number = next((int(x) for x in segs[1:] if x.isdigit()), None)
        if number is not None:
            expert_of[mod] = number
    linears: list[tuple[str, int, int]] = []
    in_h: list[str] = []
    vectors: list[tuple[str, int]] = []  # norms: their place (in the attention or not) decides their role, below
    for mod in mods:
        rel = _rel(mod, prefix)
        packed = _packed_roles(tree.params.get(mod, {}), h, moe_ffn, experts)
        if packed:
            layer.packed, layer.packed_slots = rel, packed
            continue
        w = tree.weight(mod)
        cls = tree.cls.get(mod, "")
        if w is None:
            if _NORM_CLASS.search(cls) and not tree.under(mod) and not tree.params.get(mod):
                vectors.append((rel, 0))  # a parameter-free norm (OLMo)
            continue
        if len(w) == 1:
            if mod not in expert_of:
                vectors.append((rel, w[0]))
            continue
        if len(w) != 2:
            continue
        out, inp = w
        if mod in expert_of:
            e = expert_of[mod]
            g, u, d = layer.experts.get(e, ("", "", ""))
            if inp == h and out == 2 * (moe_ffn or 0):
                g, layer.expert_fused = rel, True
            elif inp == h and out == moe_ffn:
                if not g:
                    g = rel
                else:
                    u = rel
            elif inp == moe_ffn and out == h:
                d = rel
            layer.experts[e] = (g, u, d)
            continue
        linears.append((rel, out, inp))
    taken: set[str] = set()
    if sizes.get("kv_lora"):
        taken = _mla_roles(layer, linears, sizes)
    # attention first: q, k, v, o as four projections in the order they ran, else one fused QKV and o
    sep = [] if layer.mla else [x for x in linears if (x[2] == h and x[1] in (nh * hd, ng * hd))
                                or (x[2] == nh * hd and x[1] == h)]
    if layer.mla:
        pass
    elif len(sep) >= 4 and [x[1] for x in sep[:3]] == [nh * hd, ng * hd, ng * hd] and sep[3][1:] == (h, nh * hd):
        (layer.q, _, _), (layer.k, _, _), (layer.v, _, _), (layer.o, _, _) = sep[:4]
        taken = {x[0] for x in sep[:4]}
    else:
        fused = next((x for x in linears if x[2] == h and x[1] == (nh + 2 * ng) * hd), None)
        out_proj = next((x for x in linears if fused and linears.index(x) > linears.index(fused) and x[2] == nh * hd
                         and x[1] == h), None)
        if fused and out_proj:
            layer.qkv, layer.o = fused[0], out_proj[0]
        taken = {layer.qkv, layer.o} - {""}
    shared_ffn = sizes.get("shared_ffn")
    shared_in: list[str] = []
    for rel, out, inp in linears:
        if rel in taken:
            continue
        if shared_ffn and inp == h and out == shared_ffn and shared_ffn != ffn:
            shared_in.append(rel)
        elif shared_ffn and inp == shared_ffn and out == h and shared_ffn != ffn:
            layer.shared = (*layer.shared[:2], rel)
        elif inp == h and ffn and out == 2 * ffn:
            layer.gate_up = rel
        elif inp == h and ffn and out == ffn:
            in_h.append(rel)
        elif inp == h and experts and out == experts:
            layer.router = rel
        elif ffn and inp == ffn and out == h:
            layer.down = rel
        else:
            layer.problems.append(f"{rel}: a [{out}, {inp}] weight of no role the configs predict")
    if len(in_h) == 2:
        layer.gate, layer.up = in_h
    elif len(in_h) == 1:
        layer.fc1 = in_h[0]
    if len(shared_in) == 2:
        layer.shared = (shared_in[0], shared_in[1], layer.shared[2])
    elif shared_in:
        layer.problems.append(f"{shared_in[0]}: a shared expert's projection without its pair")
    attn = [x for x in (layer.q, layer.k, layer.v, layer.qkv, layer.o, *layer.mla.values()) if x]
    layer.attention = common_parent([prefix + "." + x for x in attn]) if len(attn) >= 2 else ""
    layer.attention = _rel(layer.attention, prefix) if layer.attention.startswith(prefix + ".") else ""
    mla_norms = [n for n in ("q_layernorm", "kv_layernorm") if n not in layer.mla and sizes.get(
        "q_lora" if n == "q_layernorm" else "kv_lora")]
    for rel, size in vectors:
        if layer.mla and layer.attention and inside(rel, layer.attention):  # MLA: q's then kv's latent norm
            want = [n for n in mla_norms if size == sizes["q_lora" if n == "q_layernorm" else "kv_lora"]]
            if want:
                layer.mla[want[0]] = rel
                mla_norms.remove(want[0])
            else:
                layer.problems.append(f"{rel}: a [{size}] norm in the multi-latent attention of no latent size")
        elif layer.attention and inside(rel, layer.attention):  # q then k norm, in the order they ran
            if size != hd:
                layer.cannot.append(f"{rel} normalises [{size}] (q or k of all heads at once); megatron-core's "
                                    f"qk_layernorm normalises each head's [{hd}] on its own")
            elif not layer.q_norm:
                layer.q_norm = rel
            else:
                layer.k_norm = rel
        elif size in (h, 0):
            layer.norms.append(rel)
    if layer.attention:
        layer.sinks = next((slot for slot, shape in tree.params.get(f"{prefix}.{layer.attention}", {}).items()
                            if shape == (nh,) and slot != "bias"), "")
    mlp = [x for x in (layer.gate, layer.up, layer.gate_up, layer.fc1, layer.down, layer.router, layer.packed,
                       *layer.shared) if x]
    mlp += [x for parts in layer.experts.values() for x in parts if x]
    layer.mlp = _rel(common_parent([prefix + "." + x for x in mlp]), prefix) if len(mlp) >= 2 else ""
    if layer.mlp == "" or not (prefix + "." + layer.mlp).startswith(prefix + "."):
        layer.mlp = ""
    return layer


def _mla_roles(layer: Layer, linears: list[tuple[str, int, int]], sizes: dict[str, int]) -> set[str]:
    """Multi-latent attention's projections, by shape in the order they ran: q's down (hidden -> q latent) and up
    (q latent -> heads x (nope + rope)) projections, or one q projection without a q latent; kv's down projection
    (hidden -> kv latent + rope) and up projection (kv latent -> heads x (nope + v)); the output projection."""
    h, nh = sizes["hidden"], sizes["heads"]
    q_lora, kv_lora, rope = sizes.get("q_lora"), sizes["kv_lora"], sizes["qk_rope"]
    qh, kvh = sizes["qk_nope"] + rope, sizes["qk_nope"] + sizes["v_head"]
    want = ([("linear_q_down_proj", h, q_lora), ("linear_q_up_proj", q_lora, nh * qh)] if q_lora else
            [("linear_q_proj", h, nh * qh)]) + [("linear_kv_down_proj", h, kv_lora + rope),
                                                ("linear_kv_up_proj", kv_lora, nh * kvh),
                                                ("linear_proj", nh * sizes["v_head"], h)]
    found: dict[str, str] = {}
    for rel, out, inp in linears:
        role = next((r for r, i, o in want if r not in found and (i, o) == (inp, out)), None)
        if role:
            found[role] = rel
    if len(found) != len(want):
        return set()
    layer.o = found.pop("linear_proj")
    layer.mla = found
    return {layer.o, *found.values()}


def _packed_roles(params: dict[str, tuple[int, ...]], h: int, ffn: int | None,
                  experts: int | None) -> dict[str, str]:
    """A module's [experts, ...] parameters as expert roles (slot -> role), when it holds every expert's MLP."""
    if not experts or not ffn or not any(len(s) == 3 and s[0] == experts for s in params.values()):
        return {}
    shapes = {(experts, h, 2 * ffn): "gate_up_xw", (experts, 2 * ffn, h): "gate_up_wx", (experts, ffn, h): "down_xw",
              (experts, h, ffn): "down_wx", (experts, 2 * ffn): "gate_up_bias", (experts, h): "down_bias"}
    roles = {slot: shapes[shape] for slot, shape in params.items() if shape in shapes}
    return roles if len(roles) == len(params) else {}


def _sizes(cfg_a: dict[str, Any], cfg_b: dict[str, Any]) -> dict[str, int] | None:
    hidden = _int(cfg_b, "hidden_size", "n_embd") or _int(cfg_a, "hidden_size")
    heads = _int(cfg_b, "num_attention_heads", "n_head") or _int(cfg_a, "num_attention_heads")
    if not hidden or not heads:
        return None
    groups = _int(cfg_b, "num_key_value_heads") or _int(cfg_a, "num_query_groups") or heads
    head_dim = _int(cfg_b, "head_dim") or _int(cfg_a, "kv_channels") or hidden // heads
    out = {"hidden": hidden, "heads": heads, "groups": groups, "head_dim": head_dim}
    ffn = _int(cfg_b, "intermediate_size", "n_inner") or _int(cfg_a, "ffn_hidden_size")
    moe_ffn = _int(cfg_b, "moe_intermediate_size") or _int(cfg_a, "moe_ffn_hidden_size")
    experts = _int(cfg_b, "num_local_experts", "num_experts", "n_routed_experts") or _int(cfg_a, "num_moe_experts")
    for key, value in (("ffn", ffn), ("moe_ffn", moe_ffn or ffn if experts else None), ("experts", experts)):
        if value:
            out[key] = value
    shared = (_int(cfg_b, "n_shared_experts") or 0) * (moe_ffn or 0) or _int(cfg_a, "moe_shared_expert_intermediate_size")
    if shared and experts:
        out["shared_ffn"] = shared
    kv_lora = _int(cfg_b, "kv_lora_rank") or _int(cfg_a, "kv_lora_rank")
    if kv_lora:  # multi-latent attention (DeepSeek)
        out.update(kv_lora=kv_lora, qk_nope=_int(cfg_b, "qk_nope_head_dim") or _int(cfg_a, "qk_head_dim") or 0,
                   qk_rope=_int(cfg_b, "qk_rope_head_dim") or _int(cfg_a, "qk_pos_emb_head_dim") or 0,
                   v_head=_int(cfg_b, "v_head_dim") or _int(cfg_a, "v_head_dim") or 0)
        q_lora = _int(cfg_b, "q_lora_rank") or _int(cfg_a, "q_lora_rank")
        if q_lora:
            out["q_lora"] = q_lora
    return out


def derive(cfg_a: dict[str, Any], cfg_b: dict[str, Any], records_a: list[Record],
           records_b: list[Record]) -> Derived:
    """The ``modules`` rules mapping B (a Hugging Face decoder) onto A (megatron-core ``GPTModel``), or None with the
    reason in ``note``."""
    sizes = _sizes(cfg_a, cfg_b)
    if sizes is None:
        return Derived(None, "the captures recorded no hidden size and head count to derive a mapping from")
    tree = _Tree(records_b)
    found = _layer_stack(tree, _int(cfg_b, "num_hidden_layers", "n_layer") or _int(cfg_a, "num_layers"))
    if found is None:
        return Derived(None, "no list of decoder layers found among B's modules")
    stack, n = found
    layers = [_roles(tree, f"{stack}.{i}", sizes) for i in range(n)]
    conv = CONVENTIONS.get(str(cfg_b.get("model_type", "")), Convention())
    capped = [f"{f}: {cfg_b[f]:g}" for f in ("attn_logit_softcapping", "final_logit_softcapping")
              if isinstance(cfg_b.get(f), (int, float)) and not isinstance(cfg_b.get(f), bool) and cfg_b[f]]
    parallel = [f for f in ("use_parallel_residual", "parallel_attn") if cfg_b.get(f) is True]
    if parallel:  # the config says it: attention and MLP both read the layer's input, their outputs summed
        return Derived(None, "megatron-core cannot express it", [
            f"{parallel[0]}: True, a parallel residual (attention and MLP both read the layer's input, their outputs "
            "added to it together); a megatron-core layer runs them one after the other"])
    for i, layer in enumerate(layers):
        missing = [what for what, ok in (("attention q/k/v", layer.qkv or layer.q or layer.mla), ("attention output", layer.o),
                                        ("MLP", layer.mlp)) if not ok]
        if missing or layer.problems:
            return Derived(None, f"{stack}.{i}: " + "; ".join([f"no {m} found by shape" for m in missing]
                                                             + layer.problems))
        if len(layer.norms) > 2:
            layer.cannot.append(f"{len(layer.norms)} norms ({', '.join(layer.norms)}); a megatron-core layer has two "
                                "(before attention, before the MLP): a norm after attention or after the MLP has no "
                                "counterpart there")
        if layer.cannot:
            soft = [f"{', '.join(capped)}: tanh soft-capping of the logits; megatron-core has none"] if capped else []
            return Derived(None, "megatron-core cannot express it", [f"{stack}.{i}: {c}" for c in layer.cannot] + soft)
    if capped:
        return Derived(None, "megatron-core cannot express it", [
            f"{', '.join(capped)}: tanh soft-capping of the logits; megatron-core has none"])
    base = parent(stack)
    outside = [m for m in tree.modules if not m.startswith(stack + ".") and m != stack]
    last = tree.order.get(f"{stack}.{n - 1}", 0)
    embed = next((m for m in outside if len(tree.weight(m) or ()) == 2 and (tree.weight(m) or (0, 0))[1] ==
                  sizes["hidden"] and "Embedding" in tree.cls.get(m, "")), "")
    final_norm = next((m for m in outside if inside(m, base) and tree.order.get(m, -1) > last
                       and _is_norm(tree, m, sizes["hidden"])), "")
    head = next((m for m in outside if not inside(m, base) and tree.order.get(m, -1) > last
                 and "Linear" in tree.cls.get(m, "")), "")
    rules: list[dict[str, Any]] = [{"hf": "", "mcore": "", "kinds": ["input"], "only_slots": ["input_ids"],
                                    "slots": {"input_ids": "0"}}]
    if embed:
        rules.append({"hf": embed, "mcore": "embedding.word_embeddings"})
    rules.append({"hf": base, "mcore": "decoder", "kinds": ["output", "grad_output"],
                  "slots": {"last_hidden_state": "0"}, "outputs": ["swap01"]})
    norm_ops = {"params": {"weight": [f"offset(value={conv.norm_offset:g})"]}} if conv.norm_offset and not \
        cfg_a.get("layernorm_zero_centered_gamma") else {}
    signature = {lay.signature() for lay in layers}
    indices = ["{i}"] if len(signature) == 1 else [str(i) for i in range(n)]
    for idx in indices:
        layer = layers[0 if idx == "{i}" else int(idx)]
        p, m = f"{stack}.{idx}", f"decoder.layers.{idx}"
        rules += _layer_rules(layer, p, m, sizes, conv, norm_ops)
    if final_norm:
        rules.append({"hf": final_norm, "mcore": "decoder.final_layernorm", "activations": ["swap01"], **norm_ops})
    if head:
        rules.append({"hf": head, "mcore": "output_layer", "activations": ["swap01"]})
    ignore_mcore: list[Any] = [{"module": "", "kinds": ["output", "grad_output"]},
                               {"module": "embedding.embedding_dropout", "kinds": ["grad_input"]}]
    ignore_hf: list[Any] = [{"module": "", "kinds": ["output", "grad_output"]}]
    for idx in indices:
        layer = layers[0 if idx == "{i}" else int(idx)]
        if not layer.experts and not layer.packed:
            continue
        # Routed tokens: each side orders an expert's tokens its own way (HF [B*S], megatron's dispatcher [S*B],
        # sorted by expert), and the routers return different things (HF the logits, megatron the top-k
        # probabilities and the routing map): the experts and routers are compared by their parameters and gradients,
        # the MoE block by its output
        activations = ["input", "output", "grad_input", "grad_output"]
        box = layer.packed or _rel(common_parent([f"{stack}.{idx}.{x}" for parts in layer.experts.values() for x in parts if x]),
                                   f"{stack}.{idx}")
        box = box.rsplit(".", 1)[0] if box.split(".")[-1].isdigit() else box
        ignore_hf += [{"module": f"{stack}.{idx}.{box}", "kinds": activations},
                      {"module": f"{stack}.{idx}.{box}.*", "kinds": activations},
                      {"module": f"{stack}.{idx}.{layer.router}", "kinds": ["output", "grad_output"]},
                      {"module": f"{stack}.{idx}.{layer.mlp}", "kinds": ["output", "grad_output"], "slots": ["1"]}]
        ignore_mcore += [{"module": f"decoder.layers.{idx}.mlp.experts", "kinds": activations},
                         {"module": f"decoder.layers.{idx}.mlp.experts.*", "kinds": activations},
                         {"module": f"decoder.layers.{idx}.mlp.router", "kinds": ["output", "grad_output"]}]
    description = "derived from the captures' configs and B's module tree"
    doc = {"tensordiff_mapping": 2, "sides": ["mcore", "hf"], "description": description,
           "modules": {"order_fallback": False, "ignore": {"mcore": ignore_mcore, "hf": ignore_hf}, "rules": rules}}
    pair = PairFile(name="derived", path="<derived mapping>", sides=("mcore", "hf"), description=description, _doc=doc)
    shape = _describe(layers, conv, sizes, norm_ops)
    return Derived(parse(pair), f"{DERIVED} ({shape})", doc=doc)


def _describe(layers: list[Layer], conv: Convention, sizes: dict[str, int], norm_ops: dict) -> str:
    """The derived layout in words: what any layer has (a dense first layer and MoE ones: both said)."""
    layer = layers[0]
    parts = [f"{sizes['heads']} heads, multi-latent attention" if layer.mla else
             f"{sizes['heads']} heads in {sizes['groups']} query groups"]
    if layer.qkv:
        parts.append("fused QKV " + ("[Q|K|V]" if conv.qkv == "concat" else "per head"))
    if any(lay.gate_up for lay in layers):
        parts.append("fused gate/up")
    moe = [lay for lay in layers if lay.experts or lay.packed]
    if moe:
        dense = len(layers) - len(moe)
        first_dense = dense and all(lay.experts or lay.packed for lay in layers[dense:])
        parts.append(f"{sizes.get('experts')} experts" + (" in one tensor" if moe[0].packed else "")
                     + ("" if not first_dense else " (the first layer dense)" if dense == 1 else
                        f" (the first {dense} layers dense)"))
    if layer.sinks:
        parts.append("attention sinks")
    if any(lay.shared[2] for lay in layers):
        parts.append("a shared expert")
    if norm_ops:
        parts.append(f"norms x({conv.norm_offset:g}+w)")
    if any(not n for n in layer.norms):
        parts.append("parameter-free norms")
    return ", ".join(parts)


def _layer_rules(layer: Layer, p: str, m: str, sizes: dict[str, int], conv: Convention,
                 norm_ops: dict) -> list[dict[str, Any]]:
    heads, groups = sizes["heads"], sizes["groups"]
    sw = {"activations": ["swap01"]}
    out: list[dict[str, Any]] = [
        {"hf": p, "mcore": m, "only_slots": ["0"], "slots": {"0": "hidden_states"}, "kinds": ["input", "grad_input"],
         "inputs": ["swap01"]},
        {"hf": p, "mcore": m, "only_slots": ["0"], "kinds": ["output", "grad_output"], "outputs": ["swap01"]}]
    mlp_norm = "pre_mlp_layernorm"
    for hf_norm, mc_norm in zip(layer.norms, ("input_layernorm", mlp_norm)):
        out.append({"hf": f"{p}.{hf_norm}", "mcore": f"{m}.{mc_norm}", **sw, **norm_ops})
    if layer.sinks:  # before the attention's own rule, which would take its parameters too
        out.append({"hf": f"{p}.{layer.attention}", "mcore": f"{m}.self_attention.core_attention",
                    "kinds": ["param", "grad", "grad_local"], "slots": {layer.sinks: "softmax_offset"}})
    if layer.attention:
        out.append({"hf": f"{p}.{layer.attention}", "mcore": f"{m}.self_attention", "only_slots": ["0", "hidden_states"],
                    "slots": {"hidden_states": "0"}, **sw})
    qkv = f"{m}.self_attention.linear_qkv"
    for mc_name, hf_name in sorted(layer.mla.items()):
        out.append({"hf": f"{p}.{hf_name}", "mcore": f"{m}.self_attention.{mc_name}", **sw,
                    **(norm_ops if mc_name.endswith("layernorm") else {})})
    if layer.mla:
        pass
    elif layer.qkv:
        if conv.qkv == "concat":
            op = f"qkv_grouped(heads={heads}, groups={groups}, dim=%d)"
            out.append({"hf": f"{p}.{layer.qkv}", "mcore": qkv, "inputs": ["swap01"],
                        "outputs": ["swap01", op % -1], "params": {"weight": [op % 0], "bias": [op % 0]}})
        else:
            out.append({"hf": f"{p}.{layer.qkv}", "mcore": qkv, **sw})
    else:
        out.append({"hf": [f"{p}.{layer.q}", f"{p}.{layer.k}", f"{p}.{layer.v}"], "mcore": qkv,
                    "split": f"qkv_groups(heads={heads}, groups={groups})", **sw})
    for hf_name, mc_name in ((layer.q_norm, "q_layernorm"), (layer.k_norm, "k_layernorm")):
        if hf_name:
            out.append({"hf": f"{p}.{hf_name}", "mcore": f"{m}.self_attention.{mc_name}", **sw, **norm_ops})
    out.append({"hf": f"{p}.{layer.o}", "mcore": f"{m}.self_attention.linear_proj", **sw})
    out.append({"hf": f"{p}.{layer.mlp}", "mcore": f"{m}.mlp", "only_slots": ["0"], **sw})
    fc1, fc2 = f"{m}.mlp.linear_fc1", f"{m}.mlp.linear_fc2"
    if layer.gate and layer.up:
        out.append({"hf": [f"{p}.{layer.gate}", f"{p}.{layer.up}"], "mcore": fc1, "split": "chunk(n=2)", **sw})
    elif layer.gate_up or layer.fc1:
        out.append({"hf": f"{p}.{layer.gate_up or layer.fc1}", "mcore": fc1, **sw})
    if layer.down:
        out.append({"hf": f"{p}.{layer.down}", "mcore": fc2, **sw})
    if layer.router:
        out.append({"hf": f"{p}.{layer.router}", "mcore": f"{m}.mlp.router", "kinds": ["param", "grad", "grad_local"]})
    sg, su, sd = layer.shared
    if sg and su and sd:
        box = common_parent([f"{p}.{sg}", f"{p}.{su}", f"{p}.{sd}"])
        se = f"{m}.mlp.shared_experts"
        out += [{"hf": box, "mcore": se, "only_slots": ["0"], **sw},
                {"hf": [f"{p}.{sg}", f"{p}.{su}"], "mcore": f"{se}.linear_fc1", "split": "chunk(n=2)", **sw},
                {"hf": f"{p}.{sd}", "mcore": f"{se}.linear_fc2", **sw}]
    if layer.packed:
        deint = ["deinterleave(dim=0)"] if conv.gate_up == "interleaved" else []
        how = {"gate_up_xw": ("linear_fc1", "weight", ["transpose", *deint]), "gate_up_wx": ("linear_fc1", "weight", deint),
               "down_xw": ("linear_fc2", "weight", ["transpose"]), "down_wx": ("linear_fc2", "weight", []),
               "gate_up_bias": ("linear_fc1", "bias", deint), "down_bias": ("linear_fc2", "bias", [])}
        slots = {slot: {"mcore": f"{m}.mlp.experts.local_experts.{{e}}.{how[role][0]}", "slot": how[role][1],
                        "ops": how[role][2]} for slot, role in layer.packed_slots.items()}
        out.append({"hf": f"{p}.{layer.packed}", "mcore": f"{m}.mlp.experts", "kinds": ["param", "grad", "grad_local"],
                    "experts": {"count": sizes["experts"], "slots": slots}})
    for e, (g, u, d) in sorted(layer.experts.items()):
        ex = f"{m}.mlp.experts.local_experts.{e}"
        if g and u:
            out.append({"hf": [f"{p}.{g}", f"{p}.{u}"], "mcore": f"{ex}.linear_fc1", "split": "chunk(n=2)",
                        "kinds": ["param", "grad", "grad_local"]})
        elif g or u:
            out.append({"hf": f"{p}.{g or u}", "mcore": f"{ex}.linear_fc1", "kinds": ["param", "grad", "grad_local"]})
        if d:
            out.append({"hf": f"{p}.{d}", "mcore": f"{ex}.linear_fc2", "kinds": ["param", "grad", "grad_local"]})
    return out
