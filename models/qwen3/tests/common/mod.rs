//! Shared by the integration tests of this crate.
use vime_qwen3::config::{Qwen3Config, TokenIds};

/// A tiny valid config: GQA 4/2, head_dim 8 != hidden / heads = 6.
pub fn tiny(tied: bool, bias: bool) -> Qwen3Config {
    let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    c.vocab_size = 40;
    c.hidden_size = 24;
    c.intermediate_size = 36;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.max_position_embeddings = 64;
    c.max_window_layers = 2;
    c.tie_word_embeddings = tied;
    c.attention_bias = bias;
    c.dtype = Some("float32".into());
    (c.bos_token_id, c.eos_token_id) = (Some(1), Some(TokenIds::One(2)));
    c.validate().unwrap();
    c
}
