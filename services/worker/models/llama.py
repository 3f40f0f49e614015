"""The Llama family (Llama, Mistral, Qwen2, SmolLM): one flat varlen batch over a paged KV cache.

Shapes: T tokens in the step (all requests concatenated), H query heads, KV key/value
heads, D head dim, E hidden size, I intermediate size. q/k/v and gate/up projections are
fused into one matmul each when the weights are loaded.

Submodules are called through ``.forward`` on the per-layer path: no hooks are ever registered,
and ``nn.Module.__call__`` costs microseconds per call, which adds up over 9 modules x 30 layers
in a batch-1 decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.layers.linear import Embedding, Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rope import apply_rotary, cos_sin_tables
from services.worker.models import packed_gemms
from services.worker.models.packed_gemms import PACKED_GEMM_LIMIT
from services.worker.quant.formats import PackedWeight
from services.worker.quant.install import add_amx_copies, install_gguf
from services.worker.quant.matmul import packed_linear

if TYPE_CHECKING:
    from services.worker.models.llama_cpu import NativeCpuPath

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
FLOAT32_COPY_LIMIT = 2**30  # bytes of float32 weight copies set_upcast_matmuls may keep


@dataclass(slots=True)
class LlamaArgs:
    """What the model needs from a Hugging Face config, as plain values."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict = field(default_factory=dict)
    # Per layer: the sliding window (a query sees the keys of its last `window` positions), 0 for full attention;
    # empty when every layer attends to the full context.
    layer_windows: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg) -> LlamaArgs:
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        qwen2 = cfg.model_type == "qwen2"
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        num_heads = cfg.num_attention_heads
        return cls(
            architecture=(cfg.architectures or [_DEFAULT_ARCH.get(cfg.model_type, "")])[0],
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            rope_scaling=rope,
            layer_windows=layer_windows(cfg),
        )

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def freeing_window(self) -> int:
        """The window every layer slides over (blocks before it are never read again), 0 if some layer sees all."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0


def layer_windows(cfg) -> tuple[int, ...]:
    """Each layer's sliding window from a Hugging Face config: ``sliding_window`` on the layers whose
    ``layer_types`` entry is ``sliding_attention``, or on every layer where the config has no layer types
    (Mistral, Phi-3); () when no layer slides."""
    window = getattr(cfg, "sliding_window", None) or 0
    if not window or not getattr(cfg, "use_sliding_window", True):
        return ()
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


_DEFAULT_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class Attention(nn.Module):
    # Tensor parallel: sums o_proj's partial outputs over the ranks (see parallel/sharding.py); None alone.
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, args: LlamaArgs, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.window = args.window(layer)
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = args.head_dim**-0.5
        self.backend = backend

    def rotate_qk(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, H + KV, D] queries then keys, rotated (a family with q/k norms normalizes them first)."""
        return apply_rotary(qk, cos, sin)

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, (H + 2*KV) * D]
        # q and k are adjacent columns: one rotary call covers both.
        qk = self.rotate_qk(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, KV, D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale, self.window)  # [T, H, D]
        out = self.o_proj.forward(out.reshape(num_tokens, self.q_size))  # [T, E]
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # as Attention's, for down_proj

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        out = self.down_proj.forward(F.silu(gate).mul_(up))
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    attention = Attention  # a family's own attention (q/k norms) in a subclass

    def __init__(self, args: LlamaArgs, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = self.attention(args, backend, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaForCausalLM(nn.Module):
    """Build on the meta device, move with ``to_empty``, then ``load_weights``; call ``init_rope`` on the target."""

    decoder_layer = DecoderLayer  # a family's own layer in a subclass
    native_cpu = True  # the native CPU path (llama_cpu.py) computes this family's layers

    def __init__(self, args: LlamaArgs, backend: AttentionBackend):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(args, backend, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, bias=False)
        self.cos: torch.Tensor | None = None  # [max_positions, D], see rope.cos_sin_tables
        self.upcast_matmuls = False
        self.logits_weight_f32: torch.Tensor | None = None  # float32 copy of the logits weight, see set_upcast_matmuls
        self.logits_gemm: packed_gemms.Gemm | None = None  # the logits weight packed, see set_packed_gemms
        self.sin: torch.Tensor | None = None
        # Every step on CPU through the native kernels (see llama_cpu.py); set by the engine.
        self.native_path: NativeCpuPath | None = None

    def set_native_path(self, path: NativeCpuPath | None) -> None:
        """Every step on the native kernels, decodes' attention included, even in mixed steps (None: torch)."""
        self.native_path = path
        self.layers[0].self_attn.backend.native_decode = None if path is None else path.attention  # shared backend

    def init_rope(self) -> None:
        a, w = self.args, self.embed_tokens.weight
        self.cos, self.sin = cos_sin_tables(
            a.head_dim, a.rope_theta, a.rope_scaling, a.max_position_embeddings, w.dtype, w.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) pair per layer
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, E] a pipeline stage's input: the previous stage's output
        inputs_embeds: torch.Tensor | None = None,  # [T, E] in place of the tokens' embeddings (image rows)
    ) -> torch.Tensor:  # [T, E] hidden states before the final norm
        if self.native_path is not None:
            return self.native_path.forward(input_ids, positions, kv_caches, meta)
        if hidden is not None:
            x = hidden
        else:
            x = self.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, cos, sin, kv_cache, meta)
        return x.add_(residual)

    @property
    def logits_module(self) -> Linear | Embedding:
        """The module whose weight (or packed weight) turns hidden states into logits."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, E] -> [R, vocab]
        """Only the rows that sample: the final norm is per row, so it runs after the selection."""
        if self.native_path is not None:
            return self.native_path.logits(hidden)
        normed, _ = self.norm(hidden)
        module = self.logits_module
        if module.packed is not None:
            return packed_linear(normed, module.packed)
        return self.unpacked_logits(normed)

    def unpacked_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [R, E] normed -> [R, vocab]
        """Logits from an unpacked weight: through its packed GEMM from the rows that GEMM takes, in float32
        when upcast (the sampler takes any dtype), else torch's."""
        rows = normed.shape[0]
        if self.logits_gemm is not None and rows >= self.logits_gemm.min_rows:
            return self.logits_gemm(normed.to(self.logits_gemm.dtype))
        weight = self.logits_module.weight
        if self.upcast_matmuls and rows > 1:
            weight = weight.float() if self.logits_weight_f32 is None else self.logits_weight_f32
            return F.linear(normed.float(), weight)
        return F.linear(normed, weight)

    def set_packed_gemms(self, limit: int = PACKED_GEMM_LIMIT, bf16_units: bool = False) -> str:
        """Matmul weights packed once for their GEMM (``packed_gemms.pack``); returns what it did, for the log."""
        return packed_gemms.pack(self, limit, bf16_units)

    def packed_gemm_bytes(self) -> int:
        return sum(g.nbytes for g in packed_gemms.distinct(self))

    def set_upcast_matmuls(self, enabled: bool, float32_copy_limit: int = FLOAT32_COPY_LIMIT) -> None:
        """Half-precision weights multiplied in float32 (see ``Linear``); for CPUs without bf16 units.

        Call after ``load_weights``. When float32 copies of all matmul weights fit in
        ``float32_copy_limit`` bytes they are made once here (bf16 SmolLM2-135M: 0.5 GiB; converting them on
        every step costs more than the step's products at decode batch sizes); larger models convert per call."""
        self.upcast_matmuls = enabled
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        embed = self.embed_tokens.weight
        tied = embed.numel() if self.lm_head is None else 0
        copy_bytes = 4 * (sum(m.weight.numel() for m in linears) + tied)
        keep_copies = enabled and embed.dtype != torch.float32 and copy_bytes <= float32_copy_limit
        for module in linears:
            module.upcast = enabled
            module.weight_f32 = module.weight.detach().float() if keep_copies else None
        self.logits_weight_f32 = None
        if keep_copies:
            self.logits_weight_f32 = embed.detach().float() if self.lm_head is None else self.lm_head.weight_f32

    def load_extra(self, name: str, tensor: torch.Tensor | PackedWeight) -> set[str]:
        """A family's own checkpoint tensors (e.g. experts): copied, with the keys they complete; else empty."""
        return set()

    def extra_expected(self) -> dict[str, set[str]]:
        """Parameters that ``load_extra`` fills, each with the keys that together complete it."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the fused parameters; raises on gaps.

        Packed matrices (``--quantization gguf``) are gathered and installed at the end (``quant.install``)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        packed: dict[str, list[tuple[int, PackedWeight]]] = {}
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # checkpoint part -> (our part, row offset in the fused tensor)
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q),
            "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", a.intermediate_size),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            keys = self.load_extra(name, tensor)
            if keys:
                loaded |= keys
                continue
            parts = name.split(".")
            offset = None
            if len(parts) >= 2 and parts[-2] in fused:
                parts[-2], offset = fused[parts[-2]]
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            param = params[target].data
            if offset is not None:
                param = param[offset : offset + tensor.shape[0]]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if isinstance(tensor, PackedWeight):
                packed.setdefault(target, []).append((offset or 0, tensor))
            else:
                param.copy_(tensor)
            loaded.add(target if offset is None else f"{target}@{offset}")
        extra = self.extra_expected()
        expected = {n for n in params if not any(p in n for p in ("qkv_proj", "gate_up_proj")) and n not in extra}
        for keys in extra.values():
            expected |= keys
        for n in params:
            if "qkv_proj" in n:
                expected |= {f"{n}@0", f"{n}@{q}", f"{n}@{q + kv}"}
            elif "gate_up_proj" in n:
                expected |= {f"{n}@0", f"{n}@{a.intermediate_size}"}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
        install_gguf(self, packed)
        add_amx_copies(self, self.logits_module, PACKED_GEMM_LIMIT, self.norm.weight.dtype)
