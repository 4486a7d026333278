"""Deterministic kernels for a run that asks for them (``train.deterministic``).

Bit-identical replay and resume are tested on CPU in float32. On CUDA several backward kernels (index_add and
scatter-add in embeddings' and attention's backward, cuBLAS split-K reductions with its default workspace) sum in
an order that varies from run to run, so two runs of the same step differ in the last bits. PyTorch's switch
(https://pytorch.org/docs/stable/notes/randomness.html) picks deterministic kernels, and cuBLAS needs a fixed
workspace, which it reads from ``CUBLAS_WORKSPACE_CONFIG`` when CUDA initializes: so this runs before anything
touches the device (the policy load, the numerics probe).

Cost: the deterministic kernels are slower where they replace atomics (PyTorch's notes; not measured here), and
``:4096:8`` keeps eight 4 MiB cuBLAS workspaces per stream. An op with no deterministic kernel warns
(``warn_only``) instead of failing a long run: the warning names it.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

CUBLAS_WORKSPACE = ":4096:8"
"""The cuBLAS workspace setting PyTorch documents for deterministic cuBLAS (CUDA ≥ 10.2)."""


def use_deterministic_algorithms(enabled: bool) -> None:
    """When ``enabled``: deterministic kernels from now on in this process (warning on ops that have none), and
    cuBLAS's fixed workspace unless the environment already sets one. Nothing when not (a run that did not ask
    keeps torch's defaults)."""
    if not enabled:
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            log.warning("train.deterministic: CUDA is already initialized, so CUBLAS_WORKSPACE_CONFIG=%s set now "
                        "may not reach cuBLAS; export it before starting the run", CUBLAS_WORKSPACE)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=True)
