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

# Qwen3's template, written for the tiny tokenizer (the same text, shortened only where it
# restates itself): tools listed in the system turn, tool calls as <tool_call> JSON, tool
# results as <tool_response> blocks in a user turn, a <think> block on the assistant turns
# after the last user query (earlier turns' reasoning dropped), and enable_thinking=False's
# empty think block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- else %}{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and "
    "message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + "
    "'\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\n{"name": "\' }}{{- tool_call.name }}'
    '{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' }}{{- content }}{{- '\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
#: the template of each family's tiny tokenizer (ChatML where not named)
TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "qwen3_moe": QWEN3_TEMPLATE}


def build_tiny_tokenizer(family: str = "llama"):
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
    tok.chat_template = TEMPLATES.get(family, CHATML_TEMPLATE)
    tok.name_or_path = "tiny_random"
    return tok


def build_tiny_target(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int = 16,
    family: str = "llama",
):
    """(model, tokenizer): a random causal LM whose weights depend only on ``seed``.
    ``head_dim``: the width of an attention head (hidden_size // head_dim heads, half as many
    KV heads); 16 by default, 64 where an engine's kernels take only common widths (vLLM's
    CPU attention). ``family``: one of ``models.families.FAMILIES`` (Llama by default)."""
    if head_dim < 1 or hidden_size % head_dim:
        raise ValueError(f"head_dim={head_dim}: must divide the hidden size {hidden_size}")
    heads = hidden_size // head_dim
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer(family)
    if family != "llama":
        from .families import family_config

        ids = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        config = family_config(family, len(tok), hidden_size, num_layers, head_dim, ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model.config._name_or_path = f"tiny_random_{family}"
        return model.eval(), tok
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
