"""A tiny Hugging Face GPT-2 (random init, built from a config in code, never downloaded),
flattened so placer can place its parts: `wte`, `wpe` (added in forward), the blocks `h.0..`,
`ln_f` and `lm_head`, whose weight IS `wte.weight` (GPT-2's tied embeddings). Dropout is 0 so a
placed run can match a one-device run exactly. `forward` returns the logits tensor.
"""
import torch
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block


class TiedGPT2(nn.Module):
    def __init__(self, vocab: int = 64, d_model: int = 32, n_layers: int = 2, seq: int = 8, n_heads: int = 2):
        super().__init__()
        cfg = GPT2Config(vocab_size=vocab, n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_positions=seq,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                         eos_token_id=None)
        cfg._attn_implementation = "eager"
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        self.h = nn.ModuleList(GPT2Block(cfg, layer_idx=i) for i in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.wte.weight, std=cfg.initializer_range)  # GPT-2's init: logits near 0
        self.lm_head.weight = self.wte.weight  # tied, as GPT2LMHeadModel ties them

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[:, : idx.size(1)]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
