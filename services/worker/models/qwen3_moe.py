"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse mixture of experts (``layers/moe.py``) in the layers
that ``decoder_sparse_step`` and ``mlp_only_layers`` give experts, the dense MLP in the others.

The router's top-k weights are rescaled to sum to 1 only when ``norm_topk_prob``. Checkpoint names
(``mlp.gate``, ``mlp.experts.M.gate_proj/up_proj/down_proj``) are kvgrid's own. Steps run in torch; experts on
the CPU grouped GEMM, on CUDA the Triton fused-MoE kernel.
"""

from __future__ import annotations

from services.worker.models.mixtral import ExpertLoading, MoeArgs, MoeDecoderLayer
from services.worker.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def qwen3_moe_args(cfg) -> MoeArgs:
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe = [i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]
    return MoeArgs.from_moe_config(cfg, cfg.num_experts, cfg.moe_intermediate_size, bool(cfg.norm_topk_prob), moe)


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    attention = Qwen3Attention


class Qwen3MoeForCausalLM(ExpertLoading, Qwen3ForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer
