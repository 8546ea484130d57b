"""Step profiling: where every millisecond of a training step goes (``StepProfiler``)."""

from lightning_embcache.profiling.callback import StepProfiler
from lightning_embcache.profiling.timeline import PHASES

__all__ = ["StepProfiler", "PHASES"]
