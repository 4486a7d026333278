"""Adapters to the outside world (engines, tools, training backends, stores, tracking)."""
