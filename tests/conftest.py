"""Session fixtures: a per-session model cache and the tiny random policy (float32, exact-ish).

Heavy imports stay inside the fixtures so that infra tests that need no model do not pay for torch/transformers.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import slowdown

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the HF hub from tests
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    from aepo_core.config import ModelConfig
    from infra.engines.hf import HFEngine


WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
"""How many pytest-xdist workers share this machine (``make test`` runs two; plain ``pytest`` one)."""
if WORKERS > 1:  # each worker (and every child it starts) computes on its share of the cores: OpenMP threads that
    # outnumber the cores spin against each other's (work ran up to 17x slower so on 2 cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))


SHARED = {
    "tests/infra/test_vllm_engine.py": "vllm", "tests/flows/test_vllm_flow.py": "vllm",
    "tests/flows/test_deployments.py": "server", "tests/flows/test_sweep_fanout.py": "server",
    "tests/flows/test_tracking_server.py": "server",
}
"""Modules whose tests share what a worker starts once (the vLLM build and servers; the session's server stack),
by the marker they carry: under xdist each group runs on one worker (each worker would start its own otherwise)."""


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _unit(nodeid: str) -> str:
    """The unit of work one xdist worker runs whole: a group of :data:`SHARED`, else the test's module (its module
    fixtures then run once)."""
    return SHARED.get(_module(nodeid), _module(nodeid))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test``'s workers take :func:`_unit` s in the order the collection puts them (heaviest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # (xdist would put the units with most tests first)
    return ByUnit(config, log)


def pytest_configure(config: pytest.Config) -> None:
    """The run's slowdown factor, measured once by the controller before any worker starts (workers inherit it)."""
    slowdown.factor()


def pytest_report_header(config: pytest.Config) -> str:
    return (f"slowdown factor {slowdown.factor():.2f} (tests/slowdown.py): per-test timeouts and child deadlines are "
            "scaled by it")


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's timeout (its own marker's, else the configured per-test one) × the slowdown factor, as a marker
    put first (pytest-timeout reads the closest)."""
    base = config.getoption("timeout", None)
    factor = slowdown.factor()
    if factor <= 1.0:
        return
    for item in items:
        own = item.get_closest_marker("timeout")
        seconds = own.args[0] if own is not None and own.args else base
        if seconds:
            item.add_marker(pytest.mark.timeout(float(seconds) * factor), append=False)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Timeouts scaled to the machine (:func:`_scale_timeouts`). One worker: the vLLM tests run last (`make test`
    builds .venv-vllm in the background meanwhile, Makefile). Under xdist: the heavy units first (the vLLM group
    waits for that build on one worker while the other works), so that the workers end together. Every module whose
    tests carry ``vllm`` or ``server`` is in :data:`SHARED`."""
    _scale_timeouts(config, items)
    for item in items:
        module = _module(item.nodeid)
        for marker in ("vllm", "server"):
            if item.get_closest_marker(marker) is not None and SHARED.get(module) != marker:
                raise pytest.UsageError(f"{module} has {marker} tests: list it in tests/conftest.py's SHARED")
    if WORKERS == 1:
        items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)  # stable: the rest keep their order
        return
    rank: dict[str, int] = {}
    for item in items:
        unit = _unit(item.nodeid)
        heavy = {"vllm": 0, "server": 1}.get(unit, 2 if item.get_closest_marker("slow") is not None else 3)
        rank[unit] = min(rank.get(unit, heavy), heavy)  # a module with one slow test is a heavy unit
    items.sort(key=lambda item: rank[_unit(item.nodeid)])


MLFLOW_STORES = ("mlflow.db", "mlruns", "mlartifacts")
"""What MLflow writes into the working directory when nothing points it elsewhere (its default tracking URI is
``sqlite:///mlflow.db`` in the cwd, its default artifact root ``./mlartifacts``; ``./mlruns`` before MLflow 3.7).
Every test's store belongs in its tmp_path: one appearing here means some code fell back to a default."""
_STORES_BEFORE = pytest.StashKey[dict[Path, int]]()
_STORES_LEFT = pytest.StashKey[list[str]]()


def _mlflow_stores() -> dict[Path, int]:
    """The MLflow stores in the repository root and the cwd, each with its modification time (ns)."""
    dirs = {Path(__file__).resolve().parents[1], Path.cwd().resolve()}
    return {d / name: (d / name).stat().st_mtime_ns for d in dirs for name in MLFLOW_STORES if (d / name).exists()}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STORES_BEFORE] = _mlflow_stores()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when it left an MLflow store in the repository root or the cwd (new, or written to). Under
    xdist the controller checks, once every worker is done."""
    if os.environ.get("PYTEST_XDIST_WORKER") or _STORES_BEFORE not in session.config.stash:
        return
    before = session.config.stash[_STORES_BEFORE]
    left = sorted(str(p) for p, mtime in _mlflow_stores().items() if before.get(p) != mtime)
    if not left:
        return
    session.config.stash[_STORES_LEFT] = left
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)  # last section, right above the counts
def pytest_terminal_summary(terminalreporter: Any) -> None:
    left = terminalreporter.config.stash.get(_STORES_LEFT, [])
    if left:
        terminalreporter.write_sep("=", "FAILED: MLflow store left in the working directory", red=True, bold=True)
        terminalreporter.write_line(f"this test run left {', '.join(left)}: some code used MLflow's default tracking "
                                    "URI or artifact root (the cwd) instead of its test's own store", red=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is not None:
        from vllm_build import wait

        wait()  # for `make test`'s background build of .venv-vllm, if one runs


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory per test session: conversions happen here, never in the user's ~/.cache."""
    return tmp_path_factory.mktemp("aepo-models")


@pytest.fixture(scope="session")
def tiny_cfg(model_cache: Path) -> ModelConfig:
    from aepo_core.config import ModelConfig

    return ModelConfig(name="tiny-random", dtype="float32", cache_dir=str(model_cache), init_seed=0)


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg: ModelConfig) -> tuple[Any, Any]:
    """(model, tokenizer) of tiny-random; shared: tests that change weights must load their own."""
    from infra.models import load_policy

    return load_policy(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_engine(tiny_policy: tuple[Any, Any]) -> HFEngine:
    from infra.engines.hf import HFEngine

    model, tokenizer = tiny_policy
    return HFEngine(model, tokenizer, seed=0)


# A random tiny policy never calls a tool, answers or stops: a memorizing cold-start SFT on 8 oracle transcripts
# (which search, run Python and answer) makes it call tools from the first step and answer some of those 8 train
# questions right, so tests can assert values a broken build would change (Pass@1, branching, accuracy). A
# single-hop answer needs ~175 response tokens (tool results count): runs that must answer set
# rollout.max_response_tokens=200 (tiny.yaml's 96 cut every answer). Measured on its 8 questions, 4 samples each at
# 200 tokens (2 Zen 4 cores): 15 epochs (last batch loss 0.57) never answered; 20 (0.18) answered 0.28 but never
# right; 30 (0.017, ~40 s once per session) Pass@1 0.19 at temperature 1 (0.28 at 0.6), right on 1-3 of the 4
# samples of three single-hop questions, with 2-4 distinct responses per group (so groups carry an advantage);
# 40 (0.005) answered the same tokens in every sample of a group (no advantage, no gradient: a sweep test's
# non-vacuity check caught it).
TOOL_USER_SFT = ["train.sft.enabled=true", "train.sft.max_examples=8", "train.sft.epochs=30", "train.sft.lr=1e-2",
                 "data.max_questions=8"]


@pytest.fixture(scope="session")
def tool_user(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-random after :data:`TOOL_USER_SFT`, trained once per session (an HF directory: ``model.name=<it>``);
    the runs that use it need no SFT of their own. Under xdist it lies in the session's directory, above the
    workers' own (their model caches are not shared)."""
    shared = tmp_path_factory.getbasetemp().parent if WORKERS > 1 else model_cache
    out = shared / "tiny-tool-user"
    with open(shared / ".tiny-tool-user.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker trains it, the other waits and loads it
        if (out / "config.json").is_file():
            return out
        from infra.config_files import load_config
        from infra.run.runtime import build_runtime
        from infra.run.sft import run_sft

        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
                          [*TOOL_USER_SFT, f"model.cache_dir={model_cache}"])
        with build_runtime(cfg, tmp_path_factory.mktemp("tool-user-runs")) as runtime:
            rows = runtime.load_rows(cfg.data.train)[: cfg.data.max_questions]
            report = run_sft(runtime, rows)
            assert report.loss_last_batch < 0.05, report  # it memorized (0.005 measured)
            tmp = shared / ".tiny-tool-user.tmp"
            runtime.model.save_pretrained(str(tmp))
            runtime.tokenizer.save_pretrained(str(tmp))
            tmp.rename(out)
        return out


@pytest.fixture(scope="session", autouse=True)
def numerics_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's per-machine numerics cache (``infra.numerics``), for its processes and their children: a probe
    measured under the suite's load must not become the user's cached decision."""
    path = tmp_path_factory.mktemp("numerics") / "numerics.json"
    os.environ.setdefault("AEPO_NUMERICS_CACHE", str(path))
    return Path(os.environ["AEPO_NUMERICS_CACHE"])


@pytest.fixture(scope="session")
def prefect_imported(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prefect imported once for the session, with a session Prefect home, before any test's output capture.

    Prefect configures its logging when ``prefect.main`` is first imported (``from prefect import flow``), its console
    handlers (those of the ``uvicorn`` and ``fastapi`` loggers too) bound to the ``sys.stderr`` of that moment. A test
    with ``capsys`` that was the first to import it (a bench's ``main``) left them on capsys's stream, closed when
    the test ended: a later test in the process whose flow logged through them failed in a recursion of logging
    errors ("I/O operation on closed file"; tests/bench/test_demo_seeds.py then test_compare_resume.py in one
    process), and a bench's ``prepare_environment`` pointed ``PREFECT_HOME`` at that test's tmp dir, removed at its
    teardown. Session fixtures are set up before a test's capsys."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    import prefect.main  # noqa: F401  (configures the logging: `import prefect` alone is lazy and does not)


@pytest.fixture(scope="session")
def prefect_harness(prefect_imported: None, model_cache: Path) -> Any:
    """One Prefect test harness (ephemeral API on SQLite) for the whole session; ~10 s to start."""
    os.environ["AEPO_MODEL_CACHE"] = str(model_cache)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness: Any) -> str:
    """The harness's API URL, for child processes (``PREFECT_API_URL``): a child that does not test Prefect's
    temporary server uses this one instead of starting its own (~17 s each on 2 cores)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect test harness set no API URL"
    return str(url)


@pytest.fixture(scope="session")
def server_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """moto S3 + ``aepo ui`` (MLflow, its artifacts proxied to ``s3://aepo-stack/mlartifacts``, and Prefect) with
    prefect.yaml's deployments declared on its process pool (``prefect deploy --all``): started once, on first
    use, for the whole session. Tests that add processes to it (workers, ``aepo serve``) stop them themselves."""
    from server_stack import POOL, running_stack

    with running_stack(tmp_path_factory.mktemp("server-stack"), "aepo-stack") as st:
        st.prefect_cli("work-pool", "create", POOL, "--type", "process")
        st.prefect_cli("deploy", "--all")
        yield st


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real S3 API on 127.0.0.1 (moto's threaded server, fresh and empty), with dummy credentials; its URL."""
    from moto.server import ThreadedMotoServer
    from server_stack import AWS

    for k, v in AWS.items():  # dummy credentials, as the server stack's processes get
        monkeypatch.setenv(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import urllib.request

    # moto keeps its buckets in this process's memory, across servers: start each test from an empty S3
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=30).close()
    yield url
    server.stop()


@pytest.fixture
def s3_bucket(moto_s3: str) -> str:
    """A bucket ``aepo`` on :func:`moto_s3`; its URI ``s3://aepo``."""
    import boto3

    boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1").create_bucket(Bucket="aepo")
    return "s3://aepo"
