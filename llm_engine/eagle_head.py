"""An EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): one transformer layer that drafts from the target's own last hidden states.

A small independent draft must rebuild from the tokens alone what the target already knows; the
target's final-layer feature f_i (the hidden state its output head reads at position i) carries
it for free. Position i's input is fc([embed(t_{i+1}), f_i]): the feature and the token that was
chosen from it. The layer's output approximates f_{i+1}, and the reduced-vocabulary head
(`compact_draft.ReducedVocabHead`) reads the draft token t_{i+2} from it. Later draft positions
feed the head's own predicted features back in, as EAGLE does.

The checkpoint holds the head's own weights only (`eagle.json` + `eagle.safetensors`, fp16); the
token embeddings are the target's, shared at load time, so a head is tied to the target whose
weights hash it records.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, DynamicCache, PreTrainedModel

from llm_engine import kv
from llm_engine.compact_draft import ReducedVocabHead

META = "eagle.json"
WEIGHTS = "eagle.safetensors"


class EagleHead(nn.Module):
    def __init__(self, target_config, vocab_ids: torch.Tensor, embed: nn.Embedding):
        super().__init__()
        hidden = target_config.hidden_size
        cfg = copy.deepcopy(target_config)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-1:]
        cfg.vocab_size, cfg.pad_token_id = 1, None  # inputs come as embeddings: no table of its own
        self.config = cfg
        self.fc = nn.Linear(2 * hidden, hidden)
        self.layer = AutoModel.from_config(cfg)  # the target's decoder layer, rotary and norm
        self.layer.embed_tokens = None
        cfg.architectures = [type(self).__name__]  # what the pair card records
        self.head = ReducedVocabHead(
            torch.zeros(len(vocab_ids), hidden), vocab_ids, target_config.vocab_size)
        self._embed = (embed,)  # the target's; a tuple keeps it out of parameters and state_dict

    def forward(self, features: torch.Tensor, tokens: torch.Tensor,
                cache: DynamicCache | None = None, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """features [b, n, hidden] (f_i), tokens [b, n] (t_{i+1}) -> f_{i+1} [b, n, hidden]."""
        x = self.fc(torch.cat([self._embed[0](tokens), features], dim=-1))
        out = self.layer(inputs_embeds=x, attention_mask=attention_mask,
                         use_cache=cache is not None, **{kv.cache_argument(self.layer): cache})
        return out.last_hidden_state

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (-inf outside the head's vocabulary) [..., vocab]."""
        return self.head(predicted)

    def get_output_embeddings(self) -> ReducedVocabHead:
        return self.head  # for the compatibility contract's logit-width check

    # The cache interface `EagleProposer` drafts through (the lean head offers the same).
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self) -> DynamicCache:
        return kv.new_cache(self)

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        kv.crop_to(cache, length)


def build_from_target(target: PreTrainedModel, vocab_ids: torch.Tensor) -> EagleHead:
    """A head initialised from the target: its last layer, final norm and head rows; fc starts by
    passing the token's embedding through (measured: better than passing the feature through)."""
    head = _place(EagleHead(target.config, vocab_ids, target.get_input_embeddings()),
                  target.device, target.dtype)
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    head.layer.layers[0].load_state_dict(base.layers[-1].state_dict())
    head.layer.norm.load_state_dict(base.norm.state_dict())
    hidden = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
        head.fc.bias.zero_()
        head.head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
    return head


def save(head: EagleHead, folder: str | Path, meta: dict,
         dtype: torch.dtype = torch.float16) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, folder / WEIGHTS)
    (folder / META).write_text(json.dumps({**meta, "kind": "eagle"}, indent=1))


def is_eagle_head(folder: str | Path) -> bool:
    return (Path(folder) / META).is_file() and (Path(folder) / WEIGHTS).is_file()


def read_meta(folder: str | Path) -> dict:
    return json.loads((Path(folder) / META).read_text())


def load(folder: str | Path, target: PreTrainedModel) -> EagleHead:
    """The head in `folder`, over `target`'s embeddings, in the target's dtype and device."""
    tensors = load_file(Path(folder) / WEIGHTS)
    head = EagleHead(target.config, tensors["head.vocab_ids"], target.get_input_embeddings())
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:  # another target's shapes: say which folder, not a torch dump
        raise ValueError(f"EAGLE head {folder} does not fit this target: {e}") from None
    return _place(head, target.device, target.dtype).eval()


def _place(head: EagleHead, device, dtype: torch.dtype) -> EagleHead:
    """Move the head; cast only its parameters: the rotary frequencies stay fp32, as the
    target's do under bf16."""
    head.to(device)
    for p in head.parameters():
        p.data = p.data.to(dtype)
    return head
