"""Tiny Hugging Face models for placer's tests: configs built here, random init, never a download.

Dropout is off (a placed run must match one device exactly). GPT-2's embeddings are untied
unless `tied=True` (`lm_head.weight` IS `transformer.wte.weight`, as GPT-2 ships).
"""
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def make_gpt2(vocab: int = 128, d_model: int = 32, n_layers: int = 2, seq: int = 16, n_heads: int = 2,
              tied: bool = False):
    """GPT2LMHeadModel: `transformer.wte`, `transformer.h.0` .., `lm_head`; returns a ModelOutput."""
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def make_llama(vocab: int = 128, d_model: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2):
    """LlamaForCausalLM with rotary embeddings and grouped-query attention (heads > kv heads)."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model,
                      num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Inner(nn.Module):
    """A model with a parent's glue: a constant added to the embedding in forward (no layer owns it)."""

    def __init__(self, vocab: int, d: int, n_layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx) + 0.5
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Wrapped(nn.Module):
    """`self.net = Inner(...)`: every placeable layer is nested (`net.blocks.0`), as in an HF wrapper."""

    def __init__(self, vocab: int = 64, d: int = 16, n_layers: int = 4, seq: int = 8):
        super().__init__()
        self.net = Inner(vocab, d, n_layers, seq)

    def forward(self, idx):
        return {"logits": self.net(idx)}


class WrappedGPT2(nn.Module):
    """`self.gpt = GPT2LMHeadModel(cfg)`, as users wrap HF models: layers `gpt.transformer.h.0` .."""

    def __init__(self, **kwargs):
        super().__init__()
        self.gpt = make_gpt2(**kwargs)

    def forward(self, idx):
        return self.gpt(idx).logits


class SharedBias(nn.Module):
    """A parent's own parameter (`bias`) added in forward before two layers: placed on two
    devices, each would train its own copy (P082)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d))
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x + self.bias) + self.bias)


class Pair(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return {"h": self.fc(x)}


class DictLayer(nn.Module):
    """A placed layer that returns a mapping: the devices without it cannot rebuild it (P081)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.pair = Pair(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.pair(x)["h"])


class Skip(nn.Module):
    """A skip connection over a segment: `embed`'s output reaches `head` directly as well."""

    def __init__(self, vocab: int = 32, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        return self.head(self.mid(x) + x)


class T5(nn.Module):
    """T5ForConditionalGeneration wrapped to take one input (the decoder reads the same ids): its
    `shared.weight` IS `encoder.embed_tokens.weight`, `decoder.embed_tokens.weight` and
    `lm_head.weight` (four names of one tied parameter); relative position biases in block 0."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4):
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // n_heads, d_ff=2 * d_model,
                       num_layers=n_layers, num_decoder_layers=n_layers, num_heads=n_heads, dropout_rate=0.0,
                       tie_word_embeddings=True, decoder_start_token_id=0, pad_token_id=0)
        self.t5 = T5ForConditionalGeneration(cfg)

    def forward(self, idx):
        return self.t5(input_ids=idx, decoder_input_ids=idx).logits


def make_bert(vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4, seq: int = 8):
    """BertForMaskedLM: q, k, v in `attention.self`, their output projection in the sibling
    `attention.output`, the MLP split over `intermediate` and `output`; the MLM decoder tied to
    the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                     intermediate_size=2 * d_model, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, type_vocab_size=2)
    cfg._attn_implementation = "eager"
    return BertForMaskedLM(cfg)


def make_moe(family: str = "mixtral", vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
             experts: int = 4, top_k: int = 2, jitter: float = 0.0):
    """A mixture-of-experts causal LM: Mixtral (every layer sparse), Qwen2-MoE (a shared expert
    beside the routed ones) or DeepSeek-V3 (multi-head latent attention, a dense first layer,
    a shared expert); its experts stacked in 3-D weights, run by a grouped matmul. `jitter`:
    Mixtral's router noise in training."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                  num_attention_heads=n_heads, num_experts_per_tok=top_k, max_position_embeddings=64,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_key_value_heads=n_heads // 2,
                                                      num_local_experts=experts, router_jitter_noise=jitter))
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_key_value_heads=n_heads // 2,
                                                        num_experts=experts, moe_intermediate_size=d_model,
                                                        shared_expert_intermediate_size=d_model))
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **common, num_key_value_heads=n_heads, n_routed_experts=experts, moe_intermediate_size=d_model,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))


def make_t5(vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4):
    """T5ForConditionalGeneration as it ships: `input_ids`, `decoder_input_ids`, `labels`."""
    return T5(vocab, d_model, n_layers, n_heads).t5


def make_bart(vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4):
    """BartForConditionalGeneration: `input_ids`, `decoder_input_ids`, `labels`; its shared
    embedding tied to both stacks' and the LM head."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=n_layers, decoder_layers=n_layers,
                     encoder_attention_heads=n_heads, decoder_attention_heads=n_heads, encoder_ffn_dim=2 * d_model,
                     decoder_ffn_dim=2 * d_model, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    cfg._attn_implementation = "eager"
    return BartForConditionalGeneration(cfg)
