"""Hugging Face Llama from a tiny config: random init, never a download.

`LlamaForCausalLM` as transformers ships it: rotary position embeddings (`model.rotary_emb`
makes one `(cos, sin)` pair that every decoder layer reads) and grouped-query attention (4
query heads share 2 key/value heads). `forward` returns a `CausalLMOutputWithPast`; the spec's
`output: logits` picks the field the loss uses.
"""
from transformers import LlamaConfig, LlamaForCausalLM


def make_llama(vocab: int = 128, d_model: int = 32, n_layers: int = 4, n_heads: int = 4, n_kv_heads: int = 2):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model,
                      num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)
