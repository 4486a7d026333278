"""The run services: they compose the adapters of infra/ into a policy runtime, a trainer, evaluation, the
rollout study and SFT (flows → tasks → infra.run → infra/<outside system> → aepo_core)."""
