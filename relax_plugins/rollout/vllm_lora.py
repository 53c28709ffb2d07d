"""The vllm rollout's LoRA adapter (``RolloutContext.lora``): each policy version is served as a
``LoRARequest`` of its own.

A sync writes the adapter's tensors (PEFT names, as the trainer's extractor yields them) with its
``adapter_config.json`` into a folder of this version, and every request after it carries a
``LoRARequest`` with a new integer id. The base weights are never reloaded. vLLM keys its prefix
cache by the request's adapter id as well as its tokens, so a new id per version never reuses KV
blocks computed under an older adapter (the safety the full-weight path gets from clearing the cache).
Only the two newest versions' folders are kept (a request queued just before a sync may still
load the previous one).

Imported inside the backend (it needs vllm, peft and safetensors).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from relax.contracts import ATTENTION_LINEARS, DENSE_MLP_LINEARS, LoraInfo

#: The ranks vLLM's ``max_lora_rank`` takes; the adapter's rank is rounded up to one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora.rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
                     "use a smaller rank or the hf rollout")


def target_names(info: LoraInfo, is_moe: bool) -> list[str]:
    """The layer names ``info.target_modules`` means on a Llama / Qwen decoder (``all-linear``
    resolved, as vLLM reads an explicit list)."""
    if isinstance(info.target_modules, str):
        return [*ATTENTION_LINEARS, *(() if is_moe else DENSE_MLP_LINEARS)]
    return list(info.target_modules)


class ServedAdapter:
    """The adapter versions a vllm rollout serves: a folder and a ``LoRARequest`` per version."""

    def __init__(self, info: LoraInfo, model_path: str, is_moe: bool) -> None:
        self.info = info
        self.model_path = model_path
        self.targets = target_names(info, is_moe)
        self.root = Path(tempfile.mkdtemp(prefix="relax-vllm-lora-"))
        self.request: Any = None
        """The ``LoRARequest`` of the newest version (None: the base model, before the first sync)."""
        self._folders: list[Path] = []

    def engine_args(self) -> dict[str, Any]:
        """What the engine needs to serve adapters of this rank."""
        return {"enable_lora": True, "max_lora_rank": max_lora_rank(self.info.rank), "max_loras": 1}

    def load(self, tensors: dict[str, Any], version: int) -> None:
        """Write version ``version`` of the adapter and serve it from the next request on."""
        import torch
        from peft import LoraConfig
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not tensors or not all(".lora_A." in n or ".lora_B." in n for n in tensors):
            extra = sorted(n for n in tensors if ".lora_A." not in n and ".lora_B." not in n)[:3]
            raise ValueError(f"the vllm rollout serves an adapter's lora_A/lora_B tensors only, got {extra or 'none'}; "
                             "lora.modules_to_save is not served by vLLM: use the hf rollout for it")
        folder = self.root / f"v{int(version)}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        LoraConfig(r=self.info.rank, lora_alpha=self.info.alpha, lora_dropout=0.0, target_modules=self.targets,
                   bias="none", base_model_name_or_path=self.model_path).save_pretrained(str(folder))
        save_file({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in tensors.items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        # A new id per version: vLLM caches adapters and prefix blocks by it.
        self.request = LoRARequest(f"relax-v{int(version)}", int(version) + 1, str(folder))
        self._folders.append(folder)
        while len(self._folders) > 2:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
