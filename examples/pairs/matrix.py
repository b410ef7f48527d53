"""The agreement matrix: clean pairs of independently written programs across architecture and code-style axes, and
the same pairs with one fault injected, each captured with ``tensordiff capture --auto`` and compared with
``tensordiff diff`` exactly as a user runs them (no ``--mapping``: the diff picks a built-in one or needs none).

    python examples/pairs/matrix.py                   # the whole matrix (benchmarks/agreement_matrix.py prints it)
    python examples/pairs/matrix.py --sample          # the fixed sample CI runs
    python examples/pairs/matrix.py --only gpt2       # pairs whose name holds 'gpt2'
    python examples/pairs/matrix.py --only dist-      # the distributed layouts (torchrun, msrun)

A clean pair must end ``agree`` (exit 0); a fault must end ``diverged`` (exit 1) with its first divergence inside
the module the fault is in, in the expected phase. Shared by ``tests/test_agreement_matrix.py`` and
``benchmarks/agreement_matrix.py``.

The distributed layouts (``layout_cases``) run examples/distributed/mcore_train.py under torchrun (gloo, CPU) and
examples/distributed/ms_train.py under msrun, one capture file per rank, each diffed against the single-process
run of the same model as a user runs it: ``tensordiff diff ref.h5 'run.rank*.h5' --first-divergence``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.pairs.models import Arch, Side, Style, fault_effect  # noqa: E402
from tensordiff import dtypes  # noqa: E402

DIST = os.path.join(ROOT, "examples", "distributed")


@dataclass(frozen=True)
class Layout:
    """A distributed run of one of the scripts in examples/distributed, against the single-process run of the same
    model (``model`` options on both, ``--fault`` on the distributed run only)."""

    launcher: str
    """'torchrun' (megatron-core, examples/distributed/mcore_train.py) or 'msrun' (MindFormers, ms_train.py)."""
    nproc: int
    args: tuple[str, ...] = ()
    """the layout: --tp 2 --sp, --dp 2 --ddp megatron, --pp 2, ..."""
    model: tuple[str, ...] = ()
    """options of the model itself, given to the reference too: --bias, --pos learned, --groups 4."""
    fault: str = "none"

    @property
    def script(self) -> str:
        return os.path.join(DIST, "mcore_train.py" if self.launcher == "torchrun" else "ms_train.py")

    def reference(self) -> Layout:
        return Layout(self.launcher, 1, (), self.model)

    def describe(self) -> str:
        opts = " ".join(self.args + self.model + (() if self.fault == "none" else ("--fault", self.fault)))
        return f"{self.launcher} x{self.nproc} {os.path.basename(self.script)} {opts}".rstrip()


@dataclass(frozen=True)
class Case:
    """A pair of sides on one architecture; ``b.fault`` set for a fault case."""

    name: str
    arch: Arch
    a: Side
    b: Side
    sample: bool = False
    """part of the fixed sample CI runs."""
    mindformers: tuple[str, str, str, bool] | None = None
    """a megatron-core vs MindSpore/MindFormers pair, run end to end by examples/megatron_vs_mindformers/run.py:
    (its --family, its --fault or 'none', the MindSpore side's mode: 'pynative', 'graph' (GRAPH_MODE) or 'jit' (a
    mindspore.jit train step run from PyNative), whether the MindFormers model is given a ``loss_mask=`` (False: labels
    and no loss mask, ``--no-loss-mask``: it builds its own))."""
    bitwise: bool = False
    """the two sides compute bit for bit the same (one stack, the same arithmetic written another way): a fault
    below every tolerance is then found by same-stack exactness ('eps-tiny')."""
    layout: Layout | None = None
    """a distributed run (its rank files merged on read) against the single-process run: the layout, the model, the
    fault; ``a`` and ``b`` then only name the framework."""

    @property
    def fault(self) -> str:
        if self.layout is not None:
            return "" if self.layout.fault == "none" else self.layout.fault
        if self.mindformers is not None:
            return "" if self.mindformers[1] == "none" else self.mindformers[1]
        return self.b.fault


#: Where each fault must be found, in A's names, by A's family: (phase, module prefix).
_WHERE = {
    "mcore": {"norm-eps": ("forward", "decoder.layers.1.pre_mlp_layernorm"),
              "eps-tiny": ("forward", "decoder.layers.1.pre_mlp_layernorm"), "act": ("forward", "decoder.layers.1.mlp"),
              "rope-base": ("forward", "decoder.layers.0.self_attention", "rotary_pos_emb"),
              "dropout": ("forward", "decoder.layers.0.self_attention"),
              "attn-scale": ("forward", "decoder.layers.0.self_attention"),
              "weight": ("weights", "decoder.layers.0.self_attention.linear_qkv")},
    "plain": {"norm-eps": ("forward", "transformer.h.1.ln_2"), "eps-tiny": ("forward", "transformer.h.1.ln_2"),
              "act": ("forward", "transformer.h.1.mlp"),
              "rope-base": ("forward", "transformer.h.0.attn"), "dropout": ("forward", "transformer.h.0.attn"),
              "attn-scale": ("forward", "transformer.h.0.attn"), "weight": ("weights", "transformer.h.0.attn.c_attn")},
    "hf-gpt2": {"norm-eps": ("forward", "transformer.h.1.ln_2"), "eps-tiny": ("forward", "transformer.h.1.ln_2"),
                "act": ("forward", "transformer.h.1.mlp"),
                "dropout": ("forward", "transformer.h.0.attn"), "attn-scale": ("forward", "transformer.h.0.attn"),
                "weight": ("weights", "transformer.h.0.attn.c_attn")},
    "hf": {"norm-eps": ("forward", "model.layers.1.post_attention_layernorm"),
           "eps-tiny": ("forward", "model.layers.1.post_attention_layernorm"), "act": ("forward", "model.layers.1.mlp"),
           "rope-base": ("forward", "model.layers.0.self_attn", "model.rotary_emb"),
           "dropout": ("forward", "model.layers.0.self_attn"), "attn-scale": ("forward", "model.layers.0.self_attn"),
           "weight": ("weights", "model.layers.0.self_attn.q_proj")},
}


#: megatron-core vs MindFormers faults (examples/megatron_vs_mindformers/mindspore_side.py): (phase, module)
_WHERE_MF = {"split-with-size": ("backward", "decoder.layers.1.self_attention"),
             "fc1-unconverted": ("weights", "decoder.layers.0.mlp.linear_fc1"),
             "gelu-approx": ("forward", "decoder.layers.0.mlp"),
             "ln-eps": ("forward", "decoder.layers.0.input_layernorm")}


#: distributed faults (examples/distributed/*.py), by launcher: (phase, module prefix or the first divergence's
#: location), as tests/test_distributed.py and tests/test_distributed_ms.py assert them
_WHERE_DIST = {
    "torchrun": {"qkv-split": ("weights", "decoder.layers.0.self_attention.linear_qkv"),
                 "fc1-split": ("weights", "decoder.layers.0.mlp.linear_fc1"),
                 "sp-noreduce": ("param_grad", "decoder.layers.0.input_layernorm"),
                 "dp-sum": ("param_grad", "in the data-parallel gradient reduction"),
                 "bf16-allreduce": ("param_grad", "in the data-parallel gradient reduction"),
                 "pp-batch-first": ("forward", "decoder.layers.1"),
                 "pp-layer-offset": ("weights", "decoder.layers.1"),
                 "tied-noreduce": ("param_grad", "embedding.word_embeddings")},
    "msrun": {"dp-sum": ("param_grad", "in the gradient reduction")},
}


#: The cause the top hint must name, by fault (a weight scaled after loading is a checkpoint difference, and a
#: constant factor of A's weight: either names it).
_HINT = {"norm-eps": ("norm-epsilon",), "eps-tiny": ("norm-epsilon",), "act": ("activation",), "rope-base": ("rope",),
         "dropout": ("dropout",), "attn-scale": ("attention-scale",), "weight": ("checkpoint", "factor"),
         "split-with-size": ("layout",),
         "fc1-unconverted": ("layout",), "gelu-approx": ("activation",), "ln-eps": ("norm-epsilon",),
         "qkv-split": ("layout",), "fc1-split": ("layout",), "sp-noreduce": ("tp-partial",), "dp-sum": ("factor",),
         "bf16-allreduce": ("dtype",), "pp-batch-first": ("pp-boundary",), "pp-layer-offset": ("pp-layer-offset",),
         "tied-noreduce": ("pp-tied",)}


def expected_hint(case: Case) -> tuple[str, ...]:
    """The causes the top hint of a fault may name."""
    return _HINT[case.fault]


def expected(case: Case) -> tuple[str, ...]:
    """(phase, module prefixes the first divergence may be in, or locations it may name)."""
    if case.layout is not None:
        return _WHERE_DIST[case.layout.launcher][case.fault]
    if case.mindformers is not None:
        return _WHERE_MF[case.fault]
    family = case.a.family
    table = _WHERE.get(family) or _WHERE["hf"]
    return table[case.fault]


LLAMA = Arch(groups=2)
GPT2 = Arch(norm="LayerNorm", act="gelu", pos="learned", bias="all", tied=True)
S = Style


def clean_pairs() -> list[Case]:
    """Clean pairs over the axes: biases (none, all, qkv), tied/untied, MHA/GQA/MQA, LayerNorm/RMSNorm, GELU/SwiGLU,
    RoPE/learned positions, dropout modules at p=0 on one side, masks passed in or built inside, positional or keyword
    calls, SDPA or manual attention, q/k norms."""
    mc = Side("mcore")
    return [
        Case("mcore-vs-hf-llama-gqa-sdpa", LLAMA, mc, Side("hf-llama"), sample=True),
        Case("mcore-vs-hf-llama-mha-eager-mask", Arch(), Side("mcore", S(call="pos")),
             Side("hf-llama", S(attn="eager", mask="passed"))),
        Case("mcore-vs-hf-llama-mqa-tied-bias", Arch(groups=1, tied=True, bias="all"), mc, Side("hf-llama", S(attn="eager"))),
        Case("mcore-vs-hf-mistral-gqa-mask", LLAMA, mc, Side("hf-mistral", S(mask="passed"))),
        Case("mcore-vs-hf-qwen2-qkv-bias-eager", Arch(groups=2, bias="qkv"), mc, Side("hf-qwen2", S(attn="eager")), sample=True),
        Case("mcore-vs-hf-qwen3-qk-norm", Arch(groups=2, qk_norm=True), mc, Side("hf-qwen3")),
        Case("mcore-vs-hf-gpt2-eager", GPT2, mc, Side("hf-gpt2", S(attn="eager")), sample=True),
        Case("mcore-vs-hf-gpt2-sdpa-untied", replace(GPT2, tied=False), mc, Side("hf-gpt2")),
        Case("plain-sdpa-vs-manual-dropout", Arch(norm="LayerNorm", act="gelu", pos="learned", bias="all"),
             Side("plain"), Side("plain", S(attn="eager", dropout_modules=True)), sample=True),
        Case("plain-rope-gqa-kw-vs-pos-mask", LLAMA, Side("plain"), Side("plain", S(call="pos", mask="passed")),
             bitwise=True),
        Case("plain-sdpa-vs-manual-dropout-rope", LLAMA, Side("plain", S(attn="eager", dropout_modules=True)),
             Side("plain")),
        Case("mcore-pos-vs-kw", LLAMA, Side("mcore", S(call="pos")), mc, sample=True, bitwise=True),
        Case("hf-llama-sdpa-vs-eager", LLAMA, Side("hf-llama"), Side("hf-llama", S(attn="eager", mask="passed"))),
        Case("hf-gpt2-eager-vs-sdpa", GPT2, Side("hf-gpt2", S(attn="eager")), Side("hf-gpt2")),
    ]


#: The dtypes users train in: every generated pair runs in each (BF16 on the CPU: torch has its kernels).
DTYPES = ("float32", "bfloat16")
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def _tag(case: Case, **changed: str) -> str:
    """A generated variant's name: the base pair's, then what differs from it, e.g. ``mcore-vs-hf-gpt2-eager[bf16,
    untied]``."""
    return case.name + (f"[{','.join(changed.values())}]" if changed else "")


def generated_pairs(base: list[Case] | None = None) -> list[Case]:
    """Every base pair (``clean_pairs``) crossed with the generated dimensions: the dtype (``DTYPES``), tied and untied
    embeddings (both sides alike), and, where one side is a Hugging Face model and the other is not, its attention
    implementation (eager and SDPA). The argument order is a dimension of every run (``Runner.run`` diffs both
    ways). The base pair itself is the variant with its own choices, in FP32 (its name unchanged)."""
    out = []
    for case in base if base is not None else clean_pairs():
        hf_b = case.b.family.startswith("hf-") and not case.a.family.startswith("hf-")
        attns = (case.b.style.attn, "eager" if case.b.style.attn == "sdpa" else "sdpa") if hf_b else (case.b.style.attn,)
        for dtype in DTYPES:
            for tied in (case.arch.tied, not case.arch.tied):
                for attn in attns:
                    changed = {}
                    if dtype != "float32":
                        changed["dtype"] = _SHORT[dtype]
                    if tied != case.arch.tied:
                        changed["tied"] = "tied" if tied else "untied"
                    if attn != case.b.style.attn:
                        changed["attn"] = attn
                    b = replace(case.b, style=replace(case.b.style, attn=attn))
                    out.append(replace(case, name=_tag(case, **changed), arch=replace(case.arch, dtype=dtype, tied=tied),
                                       b=b, sample=case.sample and not changed))
    return out


def fault_cases(pairs: list[Case]) -> list[Case]:
    """Each pair's faults, where they apply; never one whose change is below one rounding of the pair's dtype
    (``models.fault_effect``: GELU's tanh form in BF16, a 1% epsilon change in BF16): the two programs compute the
    same numbers in that dtype, and "agree" is the right answer."""
    out = []
    for case in pairs:
        for fault in ("norm-eps", "act", "rope-base", "dropout", "attn-scale", "weight", "eps-tiny"):
            effect = fault_effect(fault, case.arch)
            if effect is not None and effect < dtypes.resolution(case.arch.dtype):
                continue
            if fault == "rope-base" and case.arch.pos != "rope":
                continue
            if fault == "attn-scale" and case.b.family == "hf-gpt2":
                continue  # GPT-2's SDPA path takes no scale: only its eager one could be changed
            if fault == "eps-tiny" and not case.bitwise:
                continue  # a difference below every tolerance: found by same-stack exactness only
            if fault not in (_WHERE.get(case.a.family) or _WHERE["hf"]):
                continue
            out.append(Case(f"{case.name}+{fault}", case.arch, case.a, replace(case.b, fault=fault),
                            sample=case.sample and fault in ("norm-eps", "dropout", "eps-tiny"), bitwise=case.bitwise))
    return out


#: MindFormers families whose model takes labels and an optional ``loss_mask=`` (parallel_core GPTModel, Qwen3)
LOSS_MASK_FAMILIES = ("llama", "llama-stacked", "qwen3")


def mindformers_cases() -> list[Case]:
    """megatron-core against MindFormers' parallel_core GPTModel (interleaved and stacked fc1), TrainingQwen3 (GQA,
    qk-norm), the legacy Llama, and a hand-written MindSpore GPT-2 port, PyNative and GRAPH_MODE; their faults."""
    mc = Side("mcore")
    py, graph, jit = "pynative", "graph", "jit"
    runs = [("llama", "none", py), ("llama-stacked", "none", py), ("qwen3", "none", py),
            ("llama-legacy", "none", py), ("gpt2", "none", py), ("llama", "none", graph),
            ("llama-legacy", "none", graph), ("llama", "split-with-size", py), ("llama", "fc1-unconverted", py),
            ("qwen3", "fc1-unconverted", graph), ("gpt2", "gelu-approx", py), ("gpt2", "ln-eps", py),
            ("gpt2", "gelu-approx", graph), ("llama", "none", jit), ("gpt2", "gelu-approx", jit)]
    out = []
    for fam, fault, mode in runs:
        # the loss-mask dimension: a clean MindFormers GPTModel run (the families that take one) also called with
        # labels and no loss_mask=, as users commonly call it
        for loss_mask in (True, False) if fault == "none" and fam in LOSS_MASK_FAMILIES and mode != jit else (True,):
            out.append(Case(f"mcore-vs-mindformers-{fam}{'' if mode == py else '-' + mode}"
                            + ("" if loss_mask else "[no-loss-mask]") + ("" if fault == "none" else f"+{fault}"),
                            Arch(), mc, Side("mindformers"), mindformers=(fam, fault, mode, loss_mask)))
    return out


def layout_cases() -> list[Case]:
    """Distributed layouts against one process: megatron-core under torchrun (TP, TP+SP, biases and learned
    positions, DP by hand and with megatron's DDP, PP, TP x PP, TP x DP) and MindFormers under msrun (DP); the faults
    the scripts inject (a converter's TP splits, unreduced SP norm gradients, DP sum for mean, a BF16 all-reduce, a
    stage's hand-over batch first, stage-local layer numbers)."""
    t, m = "torchrun", "msrun"
    clean = [  # name, launcher, processes, layout, model, sample, faults
        ("tp2", t, 2, ("--tp", "2"), (), True, ("qkv-split", "fc1-split")),
        ("tp4", t, 4, ("--tp", "4"), ("--groups", "4"), False, ()),
        ("tp2-sp", t, 2, ("--tp", "2", "--sp"), (), False, ("sp-noreduce",)),
        ("tp4-sp", t, 4, ("--tp", "4", "--sp"), ("--groups", "4"), False, ()),
        ("tp2-bias", t, 2, ("--tp", "2"), ("--bias",), False, ()),
        ("tp2-sp-bias-learned", t, 2, ("--tp", "2", "--sp"), ("--bias", "--pos", "learned"), False, ()),
        ("dp2", t, 2, ("--dp", "2"), (), False, ("dp-sum", "bf16-allreduce")),
        ("dp2-ddp-megatron", t, 2, ("--dp", "2", "--ddp", "megatron"), (), False, ("bf16-allreduce",)),
        ("pp2", t, 2, ("--pp", "2"), (), False, ("pp-batch-first", "pp-layer-offset")),
        ("tp2xpp2", t, 4, ("--tp", "2", "--pp", "2"), (), False, ()),
        ("tp2xdp2", t, 4, ("--tp", "2", "--dp", "2"), (), False, ("dp-sum",)),
        ("ms-dp2", m, 2, (), (), False, ("dp-sum",)),
    ]
    out = []
    for name, launcher, nproc, args, model, sample, faults in clean:
        side = Side("mcore" if launcher == t else "mindformers")
        for fault in ("none",) + faults:
            out.append(Case(f"dist-{name}" + ("" if fault == "none" else f"+{fault}"), Arch(), side, side,
                            sample=sample and fault in ("none", "qkv-split"),
                            layout=Layout(launcher, nproc, args, model, fault)))
        # tied embeddings (Megatron-LM's default) on every megatron-core layout of one kind of parallelism (TP, PP,
        # DP), against the tied single-process run; across pipeline stages, the embedding group's all-reduce left out
        kinds = {a for a in args if a in ("--tp", "--pp", "--dp", "--sp", "--ddp")}
        if launcher == t and len(kinds) == 1 and "--bias" not in model and "--groups" not in model and nproc == 2:
            tied = Layout(launcher, nproc, args, model + ("--tied",))
            out.append(Case(f"dist-{name}[tied]", Arch(tied=True), side, side, layout=tied))
            if "--pp" in kinds:
                out.append(Case(f"dist-{name}[tied]+tied-noreduce", Arch(tied=True), side, side,
                                layout=replace(tied, fault="tied-noreduce")))
    return out


def all_cases() -> list[Case]:
    """The generated clean pairs, the faults of each base pair in every dtype, the MindFormers pairs and the
    distributed layouts; a few of them make the fixed sample CI runs (``sample``)."""
    pairs = generated_pairs()
    base = {c.name for c in clean_pairs()}
    in_dtypes = [c for c in pairs if c.name in base or c.name.endswith(f"[{_SHORT['bfloat16']}]")]
    sample_bf16 = {"mcore-vs-hf-llama-gqa-sdpa[bf16]", "hf-llama-sdpa-vs-eager[bf16]"}
    pairs = [replace(c, sample=True) if c.name in sample_bf16 else c for c in pairs]
    faults = [replace(f, sample=True) if f.name == "mcore-vs-hf-llama-gqa-sdpa[bf16]+norm-eps" else f
              for f in fault_cases(in_dtypes)]
    return pairs + faults + mindformers_cases() + layout_cases()


# --------------------------------------------------------------------------------------------------- running
def _key(*parts: object) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass
class Outcome:
    case: str
    fault: str
    exit_code: int
    outcome: str
    passed: bool
    found: str = ""
    """where the first divergence was named: 'phase module kind.slot'."""
    hint: str = ""
    accounted: dict[str, int] = field(default_factory=dict)
    """records accounted for by each rule."""
    unaccounted: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    coverage: str = ""
    wall_s: float = 0.0
    """seconds spent on this case in this run: the captures it needed that were not cached yet, and its diffs."""
    pair_found: tuple[str, ...] = ()
    """the first divergence's two tensors (A's, B's label)."""
    orders: str = ""
    """the exit codes of ``diff A B`` and ``diff B A`` ('0/0')."""


class Runner:
    """Captures each side once (a clean A is shared by its faults) and diffs the pairs."""

    def __init__(self, out: str, steps: int = 2, verbose: bool = False):
        self.out, self.steps, self.verbose = os.path.abspath(out), steps, verbose
        os.makedirs(self.out, exist_ok=True)
        self.env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.seconds: dict[str, float] = {}
        """capture path -> seconds its capture took in this run (cached ones: absent)."""
        self.train_args: list[str] = []
        """more options for train.py (benchmarks/agreement_gpu.py: --device, --optim), part of a capture's key."""
        self.logs: dict[str, str] = {}
        """capture path -> the training script's output (its loss lines)."""
        self._weights_lock = threading.Lock()
        self.failed: dict[Layout, str] = {}
        """distributed runs that failed in this run, with why (not run again for the next case that needs them)."""

    def weights(self, arch: Arch) -> str:
        path = os.path.join(self.out, f"w-{_key(asdict(arch))}.safetensors")
        with self._weights_lock:  # run_all's threads capture both sides of one model at once: written once
            if not os.path.exists(path):
                from safetensors.torch import save_file

                from examples.pairs.models import random_state

                save_file(random_state(arch), path + ".tmp")
                os.replace(path + ".tmp", path)
        return path

    def capture(self, arch: Arch, side: Side) -> str:
        extra = [self.train_args] if self.train_args else []  # the key of a plain capture stays what it was
        path = os.path.join(self.out, f"c-{_key(asdict(arch), side.as_dict(), self.steps, *extra)}.h5")
        if os.path.exists(path):
            return path
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "tensordiff", "capture", "--auto", "-o", path + ".part.h5", "--steps",
               str(self.steps), "--", sys.executable, os.path.join(HERE, "train.py"), "--arch",
               json.dumps(asdict(arch)), "--side", json.dumps(side.as_dict()), "--weights", self.weights(arch),
               "--steps", str(self.steps), *self.train_args]
        proc = subprocess.run(cmd, env=self.env, cwd=self.out, capture_output=True, text=True, timeout=900)
        self.logs[path] = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                                    if " step " in line or line.startswith("tensordiff:"))[-2000:]
        if proc.returncode != 0:
            raise RuntimeError(f"capture of {side.as_dict()} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        os.replace(path + ".part.h5", path)
        self.seconds[path] = time.perf_counter() - t0
        return path

    def capture_layout(self, layout: Layout) -> str:
        """Runs ``layout``'s script under its launcher (one process: plainly) with --capture; the rank files are kept
        in a folder of their own, named by the run, and reused. Returns what ``tensordiff diff`` takes: the file, or
        the rank files' pattern."""
        folder = os.path.join(self.out, f"d-{_key(asdict(layout), self.steps)}")
        name = "run.h5" if layout.nproc == 1 else "run.rank*.h5"
        if os.path.isdir(folder):
            return os.path.join(folder, name)
        if layout in self.failed:
            raise RuntimeError(self.failed[layout])
        t0 = time.perf_counter()
        part = folder + ".part"
        shutil.rmtree(part, ignore_errors=True)  # what a killed run left
        os.makedirs(part)
        script = [layout.script, "--capture", os.path.join(part, "run.h5"), "--steps", str(self.steps),
                  *layout.args, *layout.model] + ([] if layout.fault == "none" else ["--fault", layout.fault])
        bindir = os.path.dirname(sys.executable)
        if layout.nproc == 1:
            cmd = [sys.executable, *script]
        elif layout.launcher == "torchrun":
            cmd = [shutil.which("torchrun", path=bindir) or "torchrun", "--standalone", "--nproc_per_node",
                   str(layout.nproc), *script]
        else:
            cmd = [shutil.which("msrun", path=bindir) or "msrun", "--worker_num", str(layout.nproc),
                   "--local_worker_num", str(layout.nproc), "--master_port", str(_free_port()), "--join", "True",
                   "--log_dir", os.path.join(part, "logs"), *script]
        env = dict(self.env, OMP_NUM_THREADS="1", PATH=bindir + os.pathsep + self.env.get("PATH", ""))
        for var in ("TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS", "TENSORDIFF_DISABLE"):
            env.pop(var, None)
        proc = subprocess.run(cmd, env=env, cwd=part, capture_output=True, text=True, timeout=900)
        wanted = ["run.h5"] if layout.nproc == 1 else [f"run.rank{r}.h5" for r in range(layout.nproc)]
        missing = [f for f in wanted if not os.path.exists(os.path.join(part, f))]
        if proc.returncode != 0 or missing:
            self.failed[layout] = (f"{layout.describe()} failed ({proc.returncode}; missing {missing}):\n"
                                   f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            raise RuntimeError(self.failed[layout])
        os.replace(part, folder)
        self.seconds[os.path.join(folder, name)] = time.perf_counter() - t0
        return os.path.join(folder, name)

    def run(self, case: Case) -> Outcome:
        t0 = time.perf_counter()
        if case.mindformers is not None:
            outcome = self._run_mindformers(case)
            return replace(outcome, wall_s=time.perf_counter() - t0)
        try:
            if case.layout is not None:
                a, b = self.capture_layout(case.layout.reference()), self.capture_layout(case.layout)
            else:
                a, b = self.capture(case.arch, case.a), self.capture(case.arch, case.b)
        except RuntimeError as err:
            return Outcome(case.name, case.fault, -1, "error", False, reasons=[str(err)[-1500:]],
                           wall_s=time.perf_counter() - t0)
        captured = sum(self.seconds.get(path, 0.0) for path in {a, b})
        t0 = time.perf_counter()
        straight = self._diff(case, a, b, False)
        back = self._diff(case, b, a, True)  # the argument order is a dimension of every pair
        return replace(symmetric(straight, back), wall_s=captured + time.perf_counter() - t0)

    def _diff(self, case: Case, a: str, b: str, reversed_: bool, extra: list[str] | None = None) -> Outcome:
        report = os.path.join(self.out, f"r-{_key(case.name, reversed_)}.json")
        if os.path.exists(report):
            os.remove(report)  # never judge a report an earlier run left
        proc = subprocess.run([sys.executable, "-m", "tensordiff", "diff", a, b, "--first-divergence", "--json",
                               report, *(extra or [])], env=self.env, cwd=self.out, capture_output=True, text=True,
                              timeout=900)
        if self.verbose:
            print(proc.stdout[-6000:])
        if proc.returncode not in (0, 1, 3) or not os.path.exists(report):
            return Outcome(case.name, case.fault, proc.returncode, "error", False,
                           reasons=[(proc.stdout + proc.stderr)[-800:]])
        with open(report, encoding="utf-8") as fh:
            doc = json.load(fh)
        return judge(case, doc, proc.returncode, reversed_)

    def _run_mindformers(self, case: Case) -> Outcome:
        assert case.mindformers is not None
        family, fault, mode, loss_mask = case.mindformers
        out = os.path.join(self.out, f"mf-{_key(case.name)}")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "megatron_vs_mindformers", "run.py"), "--family", family,
               "--fault", fault, "--out", out] + ([] if mode == "pynative" else [f"--{mode}"]) \
            + ([] if loss_mask else ["--no-loss-mask"])
        proc = subprocess.run(cmd, env=self.env, cwd=self.out, capture_output=True, text=True, timeout=1800)
        report = os.path.join(out, "report.json")
        if not os.path.exists(report):
            return Outcome(case.name, case.fault, proc.returncode, "error", False,
                           reasons=[(proc.stdout + proc.stderr)[-800:]])
        with open(report, encoding="utf-8") as fh:
            straight = judge(case, json.load(fh), proc.returncode)
        from examples.megatron_vs_mindformers.run import SETUP

        mapping = SETUP[family][2]  # the other order with run.py's own mapping (a built-in one: picked, none given)
        back = self._diff(case, os.path.join(out, "mindspore.h5"), os.path.join(out, "megatron.h5"), True,
                          ["--mapping", mapping] if mapping else [])
        return symmetric(straight, back)

    def run_all(self, cases: list[Case], jobs: int = 2) -> list[Outcome]:
        # captures first, two at a time (each training process uses one thread), then the diffs
        sides = list({_key(asdict(c.arch), s.as_dict()): (c.arch, s) for c in cases for s in (c.a, c.b)
                      if c.mindformers is None and c.layout is None}.values())
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda item: self.capture(*item), sides))
        # distributed runs: those of up to 2 processes two at a time; one of more processes takes the machine alone
        layouts = list(dict.fromkeys(lay for c in cases if c.layout is not None
                                     for lay in (c.layout.reference(), c.layout)))
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(self._try_layout, [lay for lay in layouts if lay.nproc <= 2]))
        for lay in layouts:
            if lay.nproc > 2:
                self._try_layout(lay)
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(self.run, cases))

    def _try_layout(self, layout: Layout) -> None:
        with contextlib.suppress(RuntimeError):  # run() reports the failure (kept in self.failed) as the outcome
            self.capture_layout(layout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def symmetric(straight: Outcome, back: Outcome) -> Outcome:
    """One outcome of a pair diffed in both argument orders: it passes when both do and they say the same: the
    verdict, the first divergence (the same two tensors), the top hint and what was accounted by which rule."""
    same = {"exit code": (straight.exit_code, back.exit_code), "outcome": (straight.outcome, back.outcome),
            "first divergence": (set(straight.pair_found), set(back.pair_found)),
            "top hint": (straight.hint, back.hint), "accounted": (straight.accounted, back.accounted)}
    differ = [f"the other argument order gives another {what}: {x!r} vs {y!r}" for what, (x, y) in same.items()
              if x != y and not (what == "top hint" and _same_hint(x, y))]
    reasons = straight.reasons + [f"in the other order: {r}" for r in back.reasons if r not in straight.reasons]
    return replace(straight, passed=straight.passed and back.passed and not differ, reasons=differ + reasons,
                   unaccounted=straight.unaccounted + [f"(other order) {u}" for u in back.unaccounted],
                   orders=f"{straight.exit_code}/{back.exit_code}")


#: The share a hint explains, measured on either capture's norm, may differ by this many points between the orders.
HINT_SHARE_POINTS = 2


def _same_hint(x: str, y: str) -> bool:
    """'rope 93%' and 'rope 92%': one cause, shares within ``HINT_SHARE_POINTS``."""
    (cx, _, px), (cy, _, py) = x.rpartition(" "), y.rpartition(" ")
    try:
        return cx == cy and abs(float(px.rstrip("%")) - float(py.rstrip("%"))) <= HINT_SHARE_POINTS
    except ValueError:
        return False


def judge(case: Case, doc: dict, code: int, reversed_: bool = False) -> Outcome:
    """``reversed_``: the report of ``diff B A`` (A then holds case.b's capture, unless the diff swapped them back
    to put the mapping's first side first)."""
    first = doc.get("first_divergence")
    accounted: dict[str, int] = {}
    unaccounted = []
    for row in doc["rows"]:
        if row["verdict"] != "unmatched" or row["linked"] or row["not_recorded"]:
            continue
        if row.get("accounted"):
            rule = row["accounted"]["rule"]
            accounted[rule] = accounted.get(rule, 0) + 1
        else:
            unaccounted.append(f"step {row['step']} {row['phase']}: {row['a'] or ''} | {row['b'] or ''}")
    cov = ", ".join(f"{p} {c['share_a']:.0%}·{c['share_b']:.0%}" for p, c in doc.get("coverage", {}).items())
    hints = doc.get("hints") or []
    hint = f"{hints[0]['cause']} {hints[0]['explained']:.0%}" if hints else ""
    found = f"{first['phase']} {first['tensor_a']}" if first else ""
    if first and case.layout is not None and first["module_a"] not in first.get("location", ""):
        found += f" ({first['location']})"  # found by where, not by module: the gradient reduction
    if case.fault:
        if reversed_ and not doc.get("swapped") and case.layout is None and case.mindformers is None:
            case = replace(case, a=case.b)  # A is B's family: the fault's place in its names
        phase, *modules = expected(case)
        passed = (code == 1 and first is not None and first["phase"] == phase
                  and any(first["module_a"] == m or first["module_a"].startswith(m + ".")
                          or m in first.get("location", "") for m in modules))
        if case.layout is not None:  # as tests/test_distributed.py asserts them: made at step 0
            passed = passed and first is not None and first["step"] == 0
        passed = passed and bool(hints) and hints[0]["cause"] in expected_hint(case)  # the right cause first
    else:
        passed = code == 0 and doc["outcome"] == "agree"
    reasons = list(doc.get("inconclusive_reasons") or [])
    if case.layout is not None:  # what the cross-rank check found, if anything
        reasons += [f"rank inconsistency: {r}" for r in doc.get("rank_inconsistencies") or []]
    pair_found = (first["tensor_a"], first["tensor_b"]) if first else ()
    return Outcome(case.name, case.fault, code, doc["outcome"], passed, found, hint, accounted, unaccounted,
                   reasons, cov, pair_found=pair_found)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "matrix"))
    p.add_argument("--sample", action="store_true", help="only the fixed sample CI runs")
    p.add_argument("--only", help="only cases whose name holds one of these (comma-separated)")
    p.add_argument("--clean", action="store_true", help="clean pairs only")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    cases = all_cases()
    if args.sample:
        cases = [c for c in cases if c.sample]
    if args.only:
        cases = [c for c in cases if any(o in c.name for o in args.only.split(","))]
    if args.clean:
        cases = [c for c in cases if not c.fault]
    results = Runner(args.out, verbose=args.verbose).run_all(cases)
    layouts = {c.name: c.layout for c in cases if c.layout is not None}
    for r in results:
        mark = "PASS" if r.passed else "FAIL"
        print(f"{mark} {r.case:50s} exit {r.orders or r.exit_code} {r.outcome:12s} {r.wall_s:5.0f} s  {r.found} {r.hint}")
        if r.case in layouts:
            print(f"      {layouts[r.case].describe()}")
        if not r.passed:
            for line in (r.unaccounted[:12] + r.reasons[:4]):
                print(f"      {line}")
    clean = [r for r in results if not r.fault]
    faults = [r for r in results if r.fault]
    print(f"clean pairs agree: {sum(r.passed for r in clean)}/{len(clean)}; "
          f"faults found at their place with the right hint first: {sum(r.passed for r in faults)}/{len(faults)}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
