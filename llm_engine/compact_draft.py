"""A compact draft: a few transformer layers over the target's own embeddings, with an output head
restricted to the vocabulary the target actually uses in replies.

On a CPU the target's 576 x 49152 output head costs as much as a third of its layers, so a draft
with a full head can never be cheap. This draft's head scores only `vocab_ids` (the most frequent
reply tokens) and scatters them back to full-vocabulary logits, -inf elsewhere: to the `draft`
proposer it is an ordinary causal LM, and verification stays lossless because the target still
verifies over its full vocabulary (a token the draft cannot propose just costs acceptance).

The checkpoint holds only what is the draft's own: its layers, final norm, head rows and
`vocab_ids` (fp16 safetensors) plus `draft.json`; the input embeddings are the target's, shared at
load time, so the draft is tied to the target whose weights hash it records.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

META = "draft.json"
WEIGHTS = "draft.safetensors"


class ReducedVocabHead(nn.Module):
    """Logits over `vocab_ids` only, scattered into a full-vocabulary row (-inf elsewhere)."""

    def __init__(self, weight: torch.Tensor, vocab_ids: torch.Tensor, full_vocab: int):
        super().__init__()
        assert weight.ndim == 2 and vocab_ids.ndim == 1 and len(vocab_ids) == len(weight)
        self.weight = nn.Parameter(weight)  # [v, hidden]
        self.register_buffer("vocab_ids", vocab_ids.long())  # [v]
        self.full_vocab = full_vocab

    def small_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight)  # [..., v]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.small_logits(hidden)  # [..., v]
        full = small.new_full((*small.shape[:-1], self.full_vocab), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, small)  # [..., full_vocab]


def build_from_target(target: PreTrainedModel, layers: list[int],
                      vocab_ids: torch.Tensor) -> PreTrainedModel:
    """A draft initialised from the target: its `layers`, final norm and head rows."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = False
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    draft.model.embed_tokens = target.get_input_embeddings()  # shared, never trained
    for mine, theirs in zip(draft.model.layers, layers, strict=True):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    head = target.get_output_embeddings().weight.detach()[vocab_ids].clone()  # [v, hidden]
    draft.lm_head = ReducedVocabHead(head, vocab_ids, cfg.vocab_size)
    return draft


def own_parameters(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Everything but the shared input embeddings."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("model.embed_tokens")}


def save(draft: PreTrainedModel, folder: str | Path, meta: dict,
         dtype: torch.dtype = torch.float16) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in own_parameters(draft).items()}
    save_file(tensors, folder / WEIGHTS)
    config = draft.config.to_dict()
    (folder / META).write_text(json.dumps({**meta, "config": config}, indent=1))


def is_compact_draft(folder: str | Path) -> bool:
    return (Path(folder) / META).is_file() and (Path(folder) / WEIGHTS).is_file()


def load(folder: str | Path, target: PreTrainedModel) -> PreTrainedModel:
    """The draft in `folder`, over `target`'s embeddings, in the target's dtype and device."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    tensors = load_file(folder / WEIGHTS)
    cfg = type(target.config).from_dict(meta["config"])
    draft = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    draft.model.embed_tokens = target.get_input_embeddings()
    head_w = tensors.pop("lm_head.weight").to(target.dtype)
    draft.lm_head = ReducedVocabHead(head_w, tensors.pop("lm_head.vocab_ids"), cfg.vocab_size)
    missing, unexpected = draft.load_state_dict(
        {k: v.to(target.dtype) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if not k.startswith(("model.embed_tokens", "lm_head"))]
    if missing or unexpected:
        raise ValueError(f"draft checkpoint {folder} does not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return draft.to(target.device).eval()


def read_meta(folder: str | Path) -> dict:
    return json.loads((Path(folder) / META).read_text())
