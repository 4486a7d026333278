"""An evaluation's samples of a question do not depend on the batch it was sampled in (issue 49 §4): seeds are keyed
by (seed, dataset, question id), never by the batch's start, so ``eval.batch_size`` or a shorter question list
does not change what a question's samples are."""

from __future__ import annotations

from pathlib import Path

from aepo_core.config import EvalConfig
from infra.config_files import load_config
from infra.run.evaluation import evaluate_dataset
from infra.run.runtime import build_runtime

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_a_question_s_evaluation_samples_do_not_depend_on_the_batch(model_cache: Path, tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"model.cache_dir={model_cache}", "rollout.max_response_tokens=24"])
    ev = EvalConfig(n_samples=2, pass_k=2, max_questions=4, bootstrap_samples=10)
    with build_runtime(cfg, tmp_path, "eval-seeds") as rt:
        rows = rt.load_rows(rt.eval_datasets()[0])[:4]

        def tokens(batch_rows, batch_size: int) -> dict[str, list[tuple[int, ...]]]:
            report = evaluate_dataset(rt, "synthetic_test", batch_rows, ev, seed=5, batch_size=batch_size,
                                      traces=len(batch_rows))
            assert report.traced is not None
            return {t.question_id: [tuple(n.token_ids) for n in t.nodes] for t in report.traced.trees}

        whole = tokens(rows, 4)
        assert tokens(rows, 1) == whole
        assert tokens(rows[2:], 2) == {q: whole[q] for q in (rows[2].id, rows[3].id)}
        assert len({str(v) for v in whole.values()}) == 4
