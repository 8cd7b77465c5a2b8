"""Tiny random-weight Llama models and a byte-level BPE tokenizer, built offline for tests."""

from __future__ import annotations

import threading

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello, how can I help you today? I would like to check my order status.",
    "The moon orbits the earth every 27 days. Café crème costs 3 €, naïve señor!",
    '{"tool": "lookup_order", "arguments": {"order_id": "12345"}}',
    "Thank you for calling. Your appointment is confirmed for Tuesday at 10 am.",
    "日本語のテキスト and emoji 🙂 make multi-byte characters.",
] * 20


def make_tokenizer(
    vocab_size: int = 400, corpus: list[str] | None = None
) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or CORPUS, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_model(
    vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy/sampling tests are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def break_forward_once(model: torch.nn.Module, exc: BaseException) -> None:
    """The next forward of `model`'s decoder raises `exc`; the ones after it run."""
    def fail(_module, _args):
        hook.remove()
        raise exc

    hook = model.get_decoder().register_forward_pre_hook(fail)


def break_forward(model: torch.nn.Module, exc: BaseException, go: threading.Event) -> None:
    """Every later forward of `model` waits for `go`, then raises `exc`: the test decides when
    the engine meets the failure (break it after building the engine, which may run a forward).
    The decoder fails, not the whole model: the engine may run it without the model's forward."""

    def fail(_module, _args):
        go.wait(30)
        raise exc

    model.get_decoder().register_forward_pre_hook(fail)
