"""Ernie 4.5 (dense, model_type "ernie4_5"): Llama with interleaved RoPE and optional biases.

- RoPE: HF's apply_rotary_pos_emb takes the first half of its [freqs, freqs] cos / sin table, repeats each
  entry twice (repeat_interleave) and rotates with an interleaved rotate_half (pairs (x[2i], x[2i+1]) at
  frequency i, computed in float32): the node's rotary_interleaved=1 with the usual cos / sin tables
  [P, head_dim / 2] from the model's rotary module.
- use_bias: biases on q / k / v / o and on the MLP's gate / up / down projections (packed into the QKV
  product's bias; the rest from the modules).
- head_dim from the config (128 in the real models, not hidden / heads), tied LM head (tie_word_embeddings)."""

from __future__ import annotations

from .base import DecoderFamily


class Ernie4_5Family(DecoderFamily):
    name = "ernie4_5"
    model_types = ("ernie4_5",)
    features = DecoderFamily.features + ("interleaved RoPE pairs (rotary_interleaved=1)",
                                         "use_bias: q / k / v / o and MLP biases", "explicit head_dim")

    def rotary_interleaved(self, config) -> int:
        return 1
