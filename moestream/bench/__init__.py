"""`moestream bench`: timed runs (run.py) and the benchmark routings they may swap in (routing.py)."""

from moestream.bench.routing import TraceRouting, UniformRouting, apply_routing, use_routing
from moestream.bench.run import BenchResult, run_bench

__all__ = ["BenchResult", "TraceRouting", "UniformRouting", "apply_routing", "run_bench", "use_routing"]
