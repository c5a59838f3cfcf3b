"""Hugging Face GPT-2 from a tiny config: random init, never a download.

`GPT2LMHeadModel` as transformers ships it: `lm_head.weight` IS `transformer.wte.weight` (tied
embeddings) and `forward` returns a `CausalLMOutputWithCrossAttentions` (the spec's
`output: logits` picks the field the loss uses). Dropout is 0 so that a placed run can match
the one-device run exactly (`placer run --check`).
"""
from transformers import GPT2Config, GPT2LMHeadModel


def make_gpt2(vocab: int = 128, d_model: int = 32, n_layers: int = 4, seq: int = 16, n_heads: int = 2):
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)
