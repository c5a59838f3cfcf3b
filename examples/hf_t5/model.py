"""Hugging Face T5 from a tiny config: random init, never a download.

`T5ForConditionalGeneration` as transformers ships it: it takes `input_ids`, `decoder_input_ids`
and `labels` by keyword and computes its own loss from the labels; `shared.weight` IS
`encoder.embed_tokens.weight`, `decoder.embed_tokens.weight` and `lm_head.weight` (four names of
one tied embedding); the first block of each stack holds a relative position bias per head.
Dropout is 0 so that a placed run can match the one-device run exactly (`placer run --check`).
"""
from transformers import T5Config, T5ForConditionalGeneration


def make_t5(vocab: int = 128, d_model: int = 32, n_layers: int = 2, n_heads: int = 4):
    cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // n_heads, d_ff=2 * d_model, num_layers=n_layers,
                   num_decoder_layers=n_layers, num_heads=n_heads, dropout_rate=0.0, tie_word_embeddings=True,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)
