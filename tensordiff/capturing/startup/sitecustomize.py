"""Run by Python at the start of the program ``tensordiff capture`` runs (this folder leads its PYTHONPATH).

- MindFormers logs INFO to stdout (about 70 lines of configuration and start-up for a Trainer run, more for larger
  models): its stdout shows warnings and errors, and the INFO lines of its callbacks (the loss of each step, as the
  Trainer's ``MFLossMonitor`` prints it: the run's progress); the log files under ``output/log`` keep every line.
- megatron-core warns at import that Transformer Engine or Apex is not installed, once per module, and about its
  own default ``cuda_graph_scope`` on every model built: hidden.

Nothing else changes: no number of the run, no other logger, no other warning. Any error here is ignored (the
training run comes first), and the ``sitecustomize`` this one shadows (a distribution's, a virtualenv's) runs after.
"""

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOGGER_MODULE = "mindformers.tools.logger"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Once ``mindformers.tools.logger`` is executed, its ``get_logger`` makes the stdout handler at WARNING unless
    the caller asks for a level."""

    def find_spec(self, name, path=None, target=None):
        if name != _LOGGER_MODULE:
            return None
        sys.meta_path.remove(self)  # once, and the real finders find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                made = module.get_logger

                def get_logger(logger_name="mindformers", **kwargs):
                    logger = made(logger_name, **kwargs)
                    for handler in logger.handlers:  # the stdout handler, not the files
                        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                                and _progress_only not in handler.filters:
                            handler.addFilter(_progress_only)
                    return logger

                get_logger.__wrapped__ = made  # type: ignore[attr-defined]
                get_logger.__doc__ = made.__doc__
                module.get_logger = get_logger
            except Exception:
                pass

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader object only
        return spec


def _progress_only(record) -> bool:
    """On MindFormers' stdout: warnings and errors, and the INFO lines of its callbacks (a step's loss)."""
    where = record.pathname.replace(os.sep, "/")
    return record.levelno >= logging.WARNING or "/callback/" in where


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)\b.* not installed", category=UserWarning)
    # megatron-core 0.16.1's TransformerConfig warns about its own default cuda_graph_scope on every model built
    warnings.filterwarnings("ignore", message=r"full scope is deprecated\. Use empty cuda_graph_scope", category=UserWarning)
    sys.meta_path.insert(0, _AfterImport())


def _chain() -> None:
    """Run the sitecustomize this one shadows, as Python would have."""
    saved = list(sys.path)
    mine = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
        importlib.import_module("sitecustomize")
    except ImportError:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    except Exception:
        pass
    finally:
        sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != _HERE]


try:
    if not os.environ.get("TENSORDIFF_FRAMEWORK_LOGS"):
        _quiet()
except Exception:
    pass
_chain()
