"""The update with each ``optim.share_prefix`` on the same stored rollouts (issue 27 §2): how many tokens the
decoder runs, how long the update takes, its peak memory, and how far the weights it ends with are from the other
modes' (float rounding only: the three compute the same gradient).

For each stored RL step of ``--run`` (its trajectory store and MLflow run in ``--runs-dir``) and each mode, a fresh
subprocess loads the run's newest checkpoint (weights, AdamW moments, LR schedule) and updates on that step's samples
in the update's order (:func:`infra.run.replay.update_samples`), with the run's config but for ``--set`` and the
mode; the modes of one step start from the same state, so their updates are paired. It is not a replay: the
checkpoint is the run's last, not the one before the step (``checkpoint.every`` rarely keeps that), which changes
the weights the update starts from, not the work it does.

Run: ``.venv/bin/python -m bench.tree_update --runs-dir runs/demo-seeds-shared --run demo-shared-sft-base-s0
--steps 1 2 3 [--modes off common tree] [--set optim.micro_batch_tokens=2048]``; writes
``bench/results/tree_update.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR, cpu_label, environment, print_table, write_result

REPO = Path(__file__).resolve().parents[1]
MODES = ("off", "common", "tree")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--run", required=True, help="MLflow run id or name (the newest of that name).")
    p.add_argument("-e", "--experiment", default="aepo")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="Applied to the run's config in every mode.")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tree_update.json")
    p.add_argument("--worker", nargs=3, metavar=("MODE", "STEP", "WEIGHTS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def decoder_tokens(cfg: Any, samples: Sequence[Any], micro_batch_tokens: int) -> dict[str, int]:
    """Tokens of the update's micro-batches: real, padded (what an unshared decoder runs), and what the decoder
    runs under each mode (``common``: the shared prefix once per micro-batch, the rest padded; ``tree``: the trie's
    nodes)."""
    from infra.training.backends import MIN_SHARED_PREFIX, shared_prefix_len
    from infra.training.batching import collate, plan_micro_batches, plan_tree_micro_batches, split_mini_batches
    from infra.training.token_tree import Trie

    out = {"real": 0, "off": 0, "common": 0, "tree": 0}
    for mini in split_mini_batches(samples, cfg.optim.mini_batch_size):
        rows = [samples[i].input_ids for i in mini]
        for mb in plan_micro_batches([len(r) for r in rows], micro_batch_tokens):
            batch = collate([samples[mini[j]] for j in mb], 0)
            b, t = batch.input_ids.shape
            p = shared_prefix_len(batch.input_ids, batch.attention_mask)
            out["real"] += batch.real_tokens
            out["off"] += b * t
            out["common"] += p + b * (t - p) if p >= MIN_SHARED_PREFIX else b * t
        for mb in plan_tree_micro_batches(rows, micro_batch_tokens):
            trie = Trie()
            for j in mb:
                trie.add(rows[j])
            out["tree"] += trie.nodes
    return {k: v * cfg.optim.ppo_epochs for k, v in out.items()}


def worker(args: argparse.Namespace) -> int:
    """One mode's update on one step's samples; prints its figures as JSON, saves its weights."""
    import torch
    from safetensors.torch import save_file

    from aepo_core.overrides import build_config
    from infra.models import load_policy, pad_token_id
    from infra.numerics import numerics_for
    from infra.run.checkpoints import checkpoint_store
    from infra.run.reading import reading_tracker
    from infra.run.replay import find_run, run_numerics, update_samples
    from infra.run.trainer import build_backend, build_updater
    from infra.store import TrajectoryStore
    from infra.training.checkpoint import load_checkpoint

    mode, step, weights_path = args.worker[0], int(args.worker[1]), args.worker[2]
    runs = args.runs_dir.resolve()
    tracker = reading_tracker(runs, None, args.experiment)
    run_id, name = find_run(tracker, args.run)
    run_cfg = tracker.logged_config(run_id)
    if not run_cfg.train.steps:
        raise SystemExit(f"run {name}: train.steps is not set (the LR schedule's length would need the data)")
    numerics = run_numerics(tracker.client.get_run(run_id).data.params, numerics_for(run_cfg))
    sets = [*args.sets, f"optim.share_prefix={mode}"]
    if mode == "common":
        sets.append("optim.activation_checkpointing=false")
    cfg = build_config(run_cfg.model_dump(mode="json"), sets, "tree_update --set")
    samples = update_samples(TrajectoryStore(runs), run_id, step)
    before = checkpoint_store(run_cfg, runs, name, run_id).latest()
    if before is None:
        raise SystemExit(f"run {name}: no checkpoint")
    model, tokenizer = load_policy(cfg.model)
    backend = build_backend(cfg, model, numerics, run_cfg.train.steps)
    updater = build_updater(cfg, backend, numerics, pad_token_id(tokenizer))
    optimizer, scheduler = backend.checkpoint_state()
    load_checkpoint(before, model=model, optimizer=optimizer, scheduler=scheduler, config=run_cfg)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    t0 = time.perf_counter()
    metrics = updater.update(samples)
    wall = time.perf_counter() - t0
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, weights_path)  # (clones: tied weights)
    tokens = decoder_tokens(cfg, samples, updater.micro_batch_tokens)
    print(json.dumps({"mode": mode, "step": step, "samples": len(samples), "update_s": wall,
                      "scoring_pass_s": metrics["train/scoring_pass_s"], "loss": metrics["train/loss"],
                      "grad_norm": metrics["train/grad_norm"], "micro_batch_tokens": updater.micro_batch_tokens,
                      "peak_rss_mb": metrics["train/peak_rss_mb"], "rss_before_update_mb": rss_before,
                      "real_tokens": tokens["real"], "decoder_tokens": tokens[mode],
                      "numerics": numerics.params(), "torch_threads": torch.get_num_threads()}))
    return 0


def max_abs_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in args.steps:
            paths = {}
            for mode in args.modes:
                paths[mode] = Path(tmp) / f"{step}-{mode}.safetensors"
                cmd = [sys.executable, "-m", "bench.tree_update", "--runs-dir", str(args.runs_dir), "--run", args.run,
                       "-e", args.experiment, *[a for s in args.sets for a in ("--set", s)],
                       "--worker", mode, str(step), str(paths[mode])]
                done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return done.returncode
                row = json.loads(done.stdout.strip().splitlines()[-1])
                first = args.modes[0]
                row[f"max_abs_dw_vs_{first}"] = max_abs_diff(paths[mode], paths[first])
                rows.append(row)
                print(f"step {step} {mode}: {row['update_s']:.1f} s, {row['decoder_tokens']} decoder tokens of "
                      f"{row['real_tokens']}, peak {row['peak_rss_mb']:.0f} MB", flush=True)
    summary = {}
    for mode in args.modes:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"update_s_mean": statistics.mean(r["update_s"] for r in mine),
                         "decoder_tokens": sum(r["decoder_tokens"] for r in mine),
                         "real_tokens": sum(r["real_tokens"] for r in mine),
                         "peak_rss_mb_max": max(r["peak_rss_mb"] for r in mine)}
    base = args.modes[0]
    table = [[m, f"{s['update_s_mean']:.1f}", f"{summary[base]['update_s_mean'] / s['update_s_mean']:.2f}",
              s["decoder_tokens"], s["real_tokens"], f"{s['peak_rss_mb_max']:.0f}",
              f"{max(r[f'max_abs_dw_vs_{base}'] for r in rows if r['mode'] == m):.2e}"] for m, s in summary.items()]
    print_table(f"update per step by optim.share_prefix ({cpu_label()}; run {args.run}, steps {args.steps})",
                ["mode", "update s", f"speed-up vs {base}", "decoder tokens", "real tokens", "peak RSS MB",
                 f"max |Δw| vs {base}"], table)
    write_result(args.out, {"environment": environment(rows[0]["torch_threads"], numerics=rows[0]["numerics"]),
                            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                     if k != "worker"},
                            "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
