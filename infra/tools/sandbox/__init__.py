"""The Python tool's sandbox: the tool, and the runner it starts inside a fresh namespace."""
