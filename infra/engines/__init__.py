"""Generation engines behind ``aepo_core.interfaces.Engine``: in-process transformers (``hf``)."""
