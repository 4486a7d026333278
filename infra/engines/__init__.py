"""Generation engines behind ``aepo_core.interfaces.Engine``: in-process transformers (``hf``)."""

from infra.engines.hf import GenerationStats, HFEngine, sample_next, sampling_distribution

__all__ = ["GenerationStats", "HFEngine", "sample_next", "sampling_distribution"]
