"""The run services: they compose the adapters of infra/ into a policy runtime, a trainer, the resume search, the
checkpoints' location, evaluation, the rollout study and SFT (flows → tasks → infra.run → infra/<outside system> →
aepo_core)."""
