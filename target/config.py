"""The recipe's ``target`` section: which target, in which dtype, on which device, with which chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..chat import check_option


@dataclass
class TargetConfig:
    name: str = "smollm2-135m-instruct"
    """HF hub id, local HF folder, path to a .gguf file, or a builtin alias."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/compute dtype; auto = bf16 on a GPU, fp32 on CPU (exact greedy identity)."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when available, else cpu."""
    chat_template: str = "auto"
    """auto: the tokenizer's (none there: raw prompts in eval, prepare refuses); none: raw prompts;
    plain: a minimal 'User: / Assistant:' template for base models; or a path to a Jinja template file."""

    def validate(self) -> None:
        check_option(self.chat_template)
