"""The embedded default job (``make demo`` / ``cooper demo``): Cooper's reward-hacking result in
miniature, on CPU, from nothing.

See :mod:`cooper_mcore.demo.pipeline` for the stages, :mod:`cooper_mcore.demo.config` for the
settings and presets, :mod:`cooper_mcore.demo.report` for the report.
"""

from cooper_mcore.demo.config import DemoConfig, load_demo_config
from cooper_mcore.demo.pipeline import run_demo

__all__ = ["DemoConfig", "load_demo_config", "run_demo"]
