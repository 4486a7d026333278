"""Prefect tasks: thin, one verb each; they call infra and aepo_core and return small values."""
