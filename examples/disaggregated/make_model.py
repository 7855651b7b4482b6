"""Write a small Llama with random weights (no download) for trying the example offline."""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
print(sys.argv[1])
