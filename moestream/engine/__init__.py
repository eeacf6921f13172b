"""The top of the stack: configuration (config.py), the plan (plan.py), the build path (build.py)
and the Engine with its public API (engine.py)."""

from moestream.engine.config import BankConfig, EngineConfig, RuntimeConfig, WarmStartConfig
from moestream.engine.engine import Engine, RunMetrics, load

__all__ = ["BankConfig", "Engine", "EngineConfig", "RunMetrics", "RuntimeConfig", "WarmStartConfig", "load"]
