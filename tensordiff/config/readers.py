"""Read one run's configuration, whatever holds it (sniffed from the content, not the name):

* a Megatron-LM log: the ``------------------------ arguments ------------------------`` block Megatron-LM prints at
  start-up (``  name ........ value`` lines, values as Python prints them), and its ``padded vocab`` line;
* a Megatron-LM flags file or command line (``--num-layers 2 --hidden-size 64 ... --swiglu``; absent flags take
  Megatron-LM's defaults);
* a Megatron-LM checkpoint folder (``--save``): the arguments it saved;
* a MindFormers YAML (``model.model_config``, ``optimizer``, ``lr_schedule``, ``runner_wrapper``, ``runner_config``);
* a Hugging Face ``config.json``;
* a tensordiff capture: the model config it recorded (only what it recorded: no defaults).

Framework-free: plain text, YAML, JSON (and HDF5 through ``tensordiff.store``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from typing import Any

from .._yaml import load_yaml
from ..errors import ConfigError, TensordiffError
from .normalize import hf_settings, megatron_settings, mindformers_settings
from .settings import Settings
from .table import MEGATRON_STORE_FALSE

_ARGS_START = re.compile(r"^-{3,}\s*arguments\s*-{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,}\s*end of arguments\s*-{3,}\s*$")
_ARG_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s+\.{2,}\s?(.*)$")
_PADDED = re.compile(r"padded vocab \(size:\s*(\d+)\) with\s*(\d+) dummy tokens \(new size:\s*(\d+)\)")
#: Arguments that show a Megatron-LM flags file is one.
_MEGATRON_NAMES = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr",
                   "ffn_hidden_size", "train_iters", "global_batch_size", "tensor_model_parallel_size"}
_MAX_BYTES = 64 << 20


def literal(text: str) -> Any:
    """A value as Python prints it: ``ast.literal_eval`` where it parses, else the string itself."""
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def read_config(path: str) -> Settings:
    """The normalized configuration of one run (see the module's docstring for what it reads)."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file or folder; give a Megatron-LM log or flags file, a MindFormers YAML, a "
                          "config.json, a Megatron-LM checkpoint folder or a capture")
    if os.path.isdir(path):
        return _megatron_checkpoint(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if head.startswith(b"\x89HDF"):
            return _capture(path)
        fh.seek(0)
        raw = fh.read(_MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise ConfigError(f"{path}: over {_MAX_BYTES >> 20} MiB, not a configuration; give the log, YAML or JSON itself")
    try:
        text = raw.decode("utf-8", errors="replace")
    except Exception:  # pragma: no cover - decode with replace does not raise
        text = ""
    if "\x00" in text:
        raise ConfigError(f"{path}: a binary file, not a configuration; give a Megatron-LM log or flags file, a "
                          "MindFormers YAML or a config.json")
    lines = text.splitlines()
    if any(_ARGS_START.match(line.strip()) for line in lines):
        return _megatron_log(path, lines)
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return _hf(path, text)
    flags = _flags(text)
    if flags is not None:
        return megatron_settings(flags[0], path, "Megatron-LM flags", set_keys=flags[1])
    doc = None
    if path.endswith((".yaml", ".yml")) or re.search(r"^(model|optimizer|runner_config|lr_schedule)\s*:", text, re.M):
        try:
            doc = load_yaml(text, path, "MindFormers YAML")
        except TensordiffError as err:
            raise ConfigError(str(err).replace("MindFormers YAML", "MindFormers YAML (the run's configuration)")) \
                from None
    if isinstance(doc, dict) and isinstance(doc.get("model"), dict):
        return mindformers_settings(doc, path)
    if isinstance(doc, dict):
        raise ConfigError(f"{path}: a YAML file without a 'model:' section, not a MindFormers run configuration; give "
                          "the YAML run_mindformer.py --config reads")
    if re.search(r"\biteration\s+\d+\s*/", text) or "megatron" in text.lower():
        raise ConfigError(f"{path}: a log without Megatron-LM's argument block ('---- arguments ----'); give the log "
                          "of rank 0 from its start, or the command's flags")
    raise ConfigError(f"{path}: not a configuration tensordiff reads; give a Megatron-LM log (its argument block) or "
                      "flags file, a MindFormers YAML, a config.json, a Megatron-LM checkpoint folder or a capture")


# ------------------------------------------------------------------------------------------------ Megatron-LM
def parse_arguments_block(lines: list[str]) -> dict[str, Any] | None:
    """The arguments of the first ``---- arguments ----`` block of a Megatron-LM log (None: no block)."""
    start = next((i for i, line in enumerate(lines) if _ARGS_START.match(line.strip())), None)
    if start is None:
        return None
    out: dict[str, Any] = {}
    for line in lines[start + 1:]:
        if _ARGS_END.match(line.strip()):
            break
        # a log line may carry a prefix (a timestamp, a rank): the argument is the part with the dots
        m = _ARG_LINE.match(re.sub(r"^.*?\]\s*", "", line) if "]" in line.split("..")[0] else line)
        if m:
            out[m.group(1)] = literal(m.group(2))
    return out


def _megatron_log(path: str, lines: list[str]) -> Settings:
    args = parse_arguments_block(lines) or {}
    if not args:
        raise ConfigError(f"{path}: its argument block ('---- arguments ----') holds no '  name ..... value' line; give "
                          "the log as Megatron-LM wrote it")
    for line in lines:
        m = _PADDED.search(line)
        if m:
            args.setdefault("padded_vocab_size", int(m.group(3)))
            break
    return megatron_settings(args, path, "Megatron-LM log", set_keys=None)


def _flags(text: str) -> tuple[dict[str, Any], set[str]] | None:
    """Megatron-LM flags (``--num-layers 2 --swiglu ...``) as arguments and the names given; None when ``text`` is not
    a flags file."""
    joined = re.sub(r"\\\r?\n", " ", text)
    try:
        tokens = shlex.split(joined, comments=True)
    except ValueError:
        return None
    args: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--") or len(tok) < 3:
            continue
        name, eq, inline = tok[2:].partition("=")
        dest = name.replace("-", "_")
        if eq:
            value: Any = literal(inline)
        elif i < len(tokens) and not tokens[i].startswith("--"):
            values = []
            while i < len(tokens) and not tokens[i].startswith("--"):
                values.append(literal(tokens[i]))
                i += 1
            value = values[0] if len(values) == 1 else values
        else:
            value = True
        if dest in MEGATRON_STORE_FALSE and value is True:
            args[MEGATRON_STORE_FALSE[dest]] = False
        args[dest] = value  # argparse: a later flag wins
    if len(args) < 2 or not (_MEGATRON_NAMES & set(args)):
        return None
    return args, set(args) | {MEGATRON_STORE_FALSE[k] for k in args if k in MEGATRON_STORE_FALSE}


def _megatron_checkpoint(path: str) -> Settings:
    from ..ckpt.megatron_dir import load_dir

    try:
        info = load_dir(path)[2]
    except TensordiffError as err:
        raise ConfigError(f"{path}: a folder, read as a Megatron-LM checkpoint: {err}") from None
    args = info.get("args") or {}
    if not isinstance(args, dict) or not args or set(args) == {"repr"}:
        raise ConfigError(f"{path}: a Megatron-LM checkpoint without its saved arguments ('args'); give the run's log "
                          "or its flags instead")
    return megatron_settings(args, path, "Megatron-LM checkpoint", set_keys=None)


# ------------------------------------------------------------------------------------------------ HF, captures
def _hf(path: str, text: str) -> Settings:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid JSON ({str(err).split(':')[0]}); give a Hugging Face config.json") \
            from None
    if not isinstance(doc, dict) or not ({"model_type", "architectures", "hidden_size", "num_hidden_layers"} & set(doc)):
        raise ConfigError(f"{path}: JSON, but not a Hugging Face config.json (no model_type, architectures or "
                          "hidden_size); give the model's config.json")
    return hf_settings(doc, path)


def _capture(path: str) -> Settings:
    from ..store import CaptureFile

    try:
        with CaptureFile(path) as cap:
            config = cap.attrs.get("model_config")
            framework = cap.framework
    except TensordiffError as err:
        raise ConfigError(str(err)) from None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            config = None
    if not isinstance(config, dict) or not config:
        raise ConfigError(f"{path}: a capture that recorded no model config (older tensordiff, or a model without a "
                          "config); give the run's log, flags or YAML instead")
    kind = f"capture ({framework})"
    if "num_hidden_layers" in config or "rope_theta" in config or "model_type" in config:
        return hf_settings(config, path, kind=kind, defaults=False)
    if "num_heads" in config or "n_kv_heads" in config or "theta" in config or "rms_norm_eps" in config:
        return mindformers_settings({"model": {"model_config": config}}, path, kind=kind, defaults=False)
    return megatron_settings(_core_to_args(config), path, kind, set_keys=None, defaults=False)


def _core_to_args(config: dict[str, Any]) -> dict[str, Any]:
    """megatron-core config fields (what a capture records) as Megatron-LM argument names."""
    args = dict(config)
    if "layernorm_epsilon" in args:
        args["norm_epsilon"] = args.pop("layernorm_epsilon")
    if "gated_linear_unit" in args:
        args["swiglu"] = bool(args.pop("gated_linear_unit"))
    if "share_embeddings_and_output_weights" in args:
        args["untie_embeddings_and_output_weights"] = not args.pop("share_embeddings_and_output_weights")
    if "num_query_groups" in args:
        args["group_query_attention"] = True
    if "padded_vocab_size" not in args and isinstance(args.get("vocab_size"), int):
        args["padded_vocab_size"] = args["vocab_size"]  # GPTModel's vocab_size: the padded one
    return args


def run_settings(log: str | None, command: list[str] | None) -> Settings | None:
    """A training run's settings from what ``locate`` and ``runs`` are given, or None when nothing says them: its log
    (Megatron-LM prints every argument at start-up), else its command (Megatron-LM flags, or the YAML a MindFormers
    command's ``--config`` names)."""
    if log:
        try:
            return read_config(log)
        except TensordiffError:
            pass
    if not command:
        return None
    if "--config" in command[:-1]:
        try:
            return read_config(command[command.index("--config") + 1])
        except TensordiffError:
            return None
    flags = _flags(shlex.join(command))
    return None if flags is None else megatron_settings(flags[0], shlex.join(command[:3]) + " ...",
                                                        "Megatron-LM command", set_keys=flags[1])
