"""The Python tool's sandbox: the tool (``tool``), what confinement this machine allows (``capabilities``), starting
one call (``launcher``) in its cgroup (``cgroups``), and the runner that runs inside it (``runner``)."""
