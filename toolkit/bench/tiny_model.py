"""Build a tiny Llama model offline (run with the CPU server environment's Python): python tiny_model.py DIR.

Every greedy token decodes to visible ASCII text (the tokenizer is trained on ASCII only and the special tokens'
lm_head rows are zero), so a client never sees a run of empty deltas; the chat template renders tools, so tool
schemas reach the prompt's prefix. Deterministic: fixed seed, fixed corpus (the standard library's sources).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] if m['content'] is string else '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus() -> list[str]:
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]:
        for line in path.read_text(encoding="utf-8", errors="ignore").splitlines():
            if line.strip() and line.isascii():
                lines.append(line)
    return lines


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    alphabet = [chr(c) for c in range(32, 127)] + ["Ġ", "Ċ", "ĉ"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  limit_alphabet=100, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for special in SPECIALS:
            model.lm_head.weight[fast.convert_tokens_to_ids(special)] = 0
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
