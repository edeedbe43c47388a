"""Gemma (1 / 1.1): Llama's pre-norm layer (no sandwich norms, no softcaps) with Gemma's conventions, shared
with Gemma 2 (subclassed from it):
- RMSNorm gains stored as w and applied as (1 + w) (HF GemmaRMSNorm: x_normed * (1 + w) in float32): the
  graph's norm weights are 1 + w;
- embeddings scaled by sqrt(hidden_size): HF multiplies by its `embed_scale` buffer cast to the embedding's
  dtype (sqrt(3072) = 55.4256 becomes 55.5 in bfloat16), so the graph's Mul constant is that value, rounded
  to the model's weight dtype (then held in the graph's float type);
- the gated MLP's activation is `hidden_act` only (HF GemmaMLP; GemmaConfig rewrites the legacy "gelu" to
  "gelu_pytorch_tanh" and ignores `hidden_activation`, which Gemma 2 reads): gelu_pytorch_tanh -> Gelu(tanh);
- scale head_dim^-0.5 from the module (head_dim 256 in the real models), tied LM head (the embedding table,
  unscaled);
- the residual stream stays float32 (as Gemma 2: Gemma activations overflow float16); products in the
  export dtype.
`use_bidirectional_attention` (non-causal) is refused."""

from __future__ import annotations

import torch

from ..graph import gated_mlp
from .base import DecoderFamily, ExportContext
from .gemma2 import Gemma2Family


class GemmaFamily(Gemma2Family):
    name = "gemma"
    model_types = ("gemma",)
    features = DecoderFamily.features + (
        "(1 + w) RMSNorm gains", "embedding scale sqrt(hidden) rounded to the model dtype as HF",
        "hidden_act gelu_pytorch_tanh gated MLP", "float32 residual stream")

    def check(self, config) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise NotImplementedError("use_bidirectional_attention=True: non-causal attention; PagedAttention is causal")

    def embed_scale(self, ctx: ExportContext) -> float:
        emb = self.decoder(ctx.model).embed_tokens  # HF: output * embed_scale.to(weight.dtype)
        return float(torch.tensor(float(emb.scalar_embed_scale)).to(emb.weight.dtype))

    def mlp(self, ctx: ExportContext, i: int, mlp, x: str) -> str:
        def wb(lin):
            return lin.weight, lin.bias
        return gated_mlp(ctx.g, x, wb(mlp.gate_proj), wb(mlp.up_proj), wb(mlp.down_proj), ctx.config.hidden_act, i)

    # Gemma 2's sandwich norms and softcaps do not exist in Gemma 1
    decoder_layer = DecoderFamily.decoder_layer

    def attention_softcap(self, config) -> float:
        return 0.0

    def final_softcap(self, ctx: ExportContext, y: str) -> str:
        return y
