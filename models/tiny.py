"""A tiny random Llama and a byte-level tokenizer with a ChatML template, built offline.

For tests and the debug preset: two layers, hidden 64, a vocabulary of 256 bytes plus three
special tokens. The template is SmolLM2's (including its default system turn), so the data
pipeline's assistant-mask logic runs on the same shape of template as the embedded target.
"""

from __future__ import annotations

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.name_or_path = "tiny_random"
    return tok


def build_tiny_target(
    seed: int = 0, hidden_size: int = 64, num_layers: int = 2, head_dim: int = 16
):
    """(model, tokenizer): a random LlamaForCausalLM whose weights depend only on ``seed``.
    ``head_dim``: the width of an attention head (hidden_size // head_dim heads, half as many
    KV heads); 16 by default, 64 where an engine's kernels take only common widths (vLLM's
    CPU attention)."""
    if head_dim < 1 or hidden_size % head_dim:
        raise ValueError(f"head_dim={head_dim}: must divide the hidden size {hidden_size}")
    heads = hidden_size // head_dim
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = "tiny_random"
    return model.eval(), tok
