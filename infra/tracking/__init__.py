"""MLflow: the client side of a run (tracking, traces, registry, run index) and the server's options."""
