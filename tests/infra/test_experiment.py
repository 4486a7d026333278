"""The Experiment runtime: the engine's own low-precision weight copy follows every weight change."""

from __future__ import annotations

from pathlib import Path

import torch
from infra.experiment import Experiment

from infra.config_files import load_config

REPO = Path(__file__).resolve().parents[2]


def _copy_matches(exp: Experiment) -> bool:
    gen = exp.engine.model  # type: ignore[attr-defined]
    return all(torch.equal(g, p.to(g.dtype)) for g, p in zip(gen.state_dict().values(),
                                                              exp.model.state_dict().values(), strict=True))


def test_bf16_generation_copy_is_refreshed_after_sft_update_and_resume(model_cache: Path, tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"model.cache_dir={model_cache}", "model.generation_dtype=bfloat16", "train.sft.enabled=true",
        "train.sft.max_examples=4", "train.sft.lr=1e-2", "optim.lr=1e-2"])
    exp = Experiment(cfg, tmp_path)
    gen = exp.engine.model  # type: ignore[attr-defined]
    assert gen is not exp.model and gen.dtype == torch.bfloat16 and exp.model.dtype == torch.float32
    assert _copy_matches(exp)
    before = {k: v.clone() for k, v in gen.state_dict().items()}

    exp.sft()
    assert _copy_matches(exp) and any(not torch.equal(before[k], v) for k, v in gen.state_dict().items())

    rows = exp.next_batch()
    result = exp.rollout(rows, step=0)
    assert all(n.token_ids for t in result.trees for n in t.nodes)
    summary = exp.score(result, rows)
    exp.update(result, summary)
    assert _copy_matches(exp)
    saved = exp.save()
    assert saved.is_dir()

    for p in exp.model.parameters():  # scribble over the live weights; resume must bring both back
        torch.nn.init.normal_(p.data)
    exp.resume()
    assert _copy_matches(exp)
