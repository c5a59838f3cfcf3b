"""Hugging Face Mixtral from a tiny config: random init, never a download.

`MixtralForCausalLM` as transformers ships it: every decoder layer's MLP is a sparse mixture of
8 experts, top 2 per token, the experts stacked in two 3-D weights (`gate_up_proj`,
`down_proj`, expert on dim 0) that `MixtralExperts` runs on the tokens each expert was given.
`router_jitter_noise` stays 0 (its default): noise drawn per device could not match one device.
"""
from transformers import MixtralConfig, MixtralForCausalLM


def make_mixtral(vocab: int = 128, d_model: int = 32, n_layers: int = 2, n_heads: int = 4, experts: int = 8,
                 top_k: int = 2):
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model,
                        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads // 2,
                        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return MixtralForCausalLM(cfg)
