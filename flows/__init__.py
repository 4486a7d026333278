"""Prefect flows (train, evaluate, sweep) and the `aepo` CLI."""
