"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): each token runs the k experts its
router picks.

Routing, as HF's MixtralTopKRouter and Qwen3MoeTopKRouter: logits = h @ router [T, E]; softmax
in float32; the top k per token; renormalised to sum to 1 over the chosen k when
`norm_topk_prob` (always in Mixtral; Qwen3-MoE's config says, and llama.cpp's qwen3moe always
does). Tokens are grouped per expert, never looped over: the step's T*k (token, expert)
pairs are sorted by expert, and each expert that was chosen runs its MLP once on its group of
rows (one gate|up and one down call per expert, float or quantized: engine/moe_quant.py); the
weighted outputs go back to their tokens with one index_add_. A decode step of B tokens so
reads at most min(E, B*k) experts' weights.

Weights are stored per expert [in, out], as the dense layers' (engine/models/llama.py):
gate_up [E, hidden, 2I] (w1 | w3 fused, as the dense gate|up), down [E, I, hidden], I the
experts' width (`MoeArch.expert_size`). One naming scheme for expert tensors, Mixtral's: a
Qwen3-MoE checkpoint's are renamed to it as they load (`rename_hf`), as Phi-3's fused tensors
are split into Llama's names, so the model code, quantization and the GGUF side read one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.arch import ModelArch, MoeArch

if TYPE_CHECKING:
    from pdserve.engine.linear.base import FusedOps, Projection

# HF names of a Mixtral layer's MLP (model.layers.{i}.block_sparse_moe.*).
MIXTRAL_BLOCK = "block_sparse_moe."
# A Qwen3-MoE layer's router and experts (model.layers.{i}.mlp.gate, mlp.experts.{e}.*_proj).
_QWEN3_MOE_NAME = re.compile(
    r"model\.layers\.\d+\.mlp\.(gate|experts\.\d+\.(gate|up|down)_proj)\.weight"
)
_QWEN3_TO_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class SparseMoe(nn.Module):
    """The MLP of one mixture-of-experts layer; forward(h, residual) = residual + MoE(h)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if arch.moe is None:
            raise ValueError("SparseMoe needs an architecture with `moe` set")
        e, h, i = arch.moe.num_experts, arch.hidden_size, arch.moe.expert_size
        self.num_experts, self.top_k = e, arch.moe.top_k
        self.norm_topk_prob = arch.moe.norm_topk_prob
        self.intermediate_size = i
        self.router = nn.Parameter(torch.empty(h, e))  # [in, out]
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * i))  # per expert [in, out]
        self.down = nn.Parameter(torch.empty(e, i, h))
        # Quantized stand-ins per expert, (gate_up, down), set by engine/moe_quant.py; None:
        # the float weights above.
        self.quantized: list[tuple[Projection, Projection]] | None = None
        # Native silu * up (linear.base.FusedOps) for quantized models, as the dense layers use.
        self.fused: FusedOps | None = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k] long) for h [T, hidden]."""
        probs = torch.softmax((h @ self.router).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + sum over each token's k experts of weight * expert(h) ([T, hidden])."""
        weights, experts = self.route(h)
        flat = experts.flatten()  # [T*k]: pair p is token p // k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
        rows = order // self.top_k  # [T*k]: the token of each grouped pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x = h.index_select(0, rows)  # [T*k, hidden]: each group's rows side by side
        pair_weights = weights.flatten().index_select(0, order).to(h.dtype)[:, None]
        y = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):  # one call per chosen expert, over all its tokens
            if n:
                group = slice(start, start + n)
                y[group] = self.expert(e, x[group]).mul_(pair_weights[group])
            start += n
        # Summed into zeros, then onto the residual: HF's order of additions (its experts
        # index_add_ in expert order, the decoder layer adds the residual after).
        out = torch.zeros_like(h).index_add_(0, rows, y)
        return residual + out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP, down(silu(gate) * up), on its rows x [n, hidden]."""
        i = self.intermediate_size
        if self.quantized is not None:
            gate_up_q, down_q = self.quantized[e]
            gate_up = gate_up_q(x)
        else:
            gate_up = x @ self.gate_up[e]
        if self.fused is not None:
            act = self.fused.silu_mul(gate_up, i)
        else:
            act = F.silu(gate_up[:, :i])
            act.mul_(gate_up[:, i:])
        return down_q(act) if self.quantized is not None else act @ self.down[e]

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's weights as stored (a step reads the chosen experts' only)."""
        experts = (
            sum(g.nbytes + d.nbytes for g, d in self.quantized)
            if self.quantized is not None
            else self.gate_up.nbytes + self.down.nbytes
        )
        return experts + self.router.nbytes

    def hf_weights(self, weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """This layer's router and experts from HF tensors (`prefix`: "model.layers.{i}."), by
        parameter name, [in, out] as stored here."""
        p = prefix + MIXTRAL_BLOCK
        experts = [f"{p}experts.{e}." for e in range(self.num_experts)]
        gate_up = [torch.cat([weights[x + "w1.weight"], weights[x + "w3.weight"]]) for x in experts]
        return {
            "router": weights[p + "gate.weight"].t(),
            "gate_up": torch.stack([w.t() for w in gate_up]),
            "down": torch.stack([weights[x + "w2.weight"].t() for x in experts]),
        }


def hf_shapes(arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of one layer's MoE MLP (loader.expected_shapes)."""
    assert arch.moe is not None
    h, i, p = arch.hidden_size, arch.moe.expert_size, prefix + MIXTRAL_BLOCK
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (arch.moe.num_experts, h)}
    for e in range(arch.moe.num_experts):
        shapes[f"{p}experts.{e}.w1.weight"] = (i, h)
        shapes[f"{p}experts.{e}.w2.weight"] = (h, i)
        shapes[f"{p}experts.{e}.w3.weight"] = (i, h)
    return shapes


def rename_hf(weights: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE checkpoint's router and expert tensors under Mixtral's names, in place
    (mlp.gate -> block_sparse_moe.gate, mlp.experts.{e}.gate/up/down_proj -> w1/w3/w2); its
    dense layers' mlp.*_proj keep theirs. Other families unchanged."""
    if arch.architecture != "qwen3_moe":
        return weights
    for name in [n for n in weights if _QWEN3_MOE_NAME.fullmatch(n)]:
        layer, _, part = name.partition("mlp.")
        part = part.removesuffix(".weight")
        stem, _, proj = part.rpartition(".")
        new = f"{stem}.{_QWEN3_TO_MIXTRAL[proj]}" if proj in _QWEN3_TO_MIXTRAL else part
        weights[f"{layer}{MIXTRAL_BLOCK}{new}.weight"] = weights.pop(name)
    return weights


def hf_moe_arch(cfg: dict[str, Any], config_file: Path, arch: str) -> MoeArch | None:
    """The MoE fields of an HF Mixtral or Qwen3-MoE config.json; None for a dense model.
    Anything this MLP does not compute is refused, naming the field."""
    if arch not in ("mixtral", "qwen3_moe"):
        return None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{config_file}: hidden_act={act!r} is not supported (only silu).")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, as Mixtral's
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"{config_file}: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]."
        )
    if arch == "mixtral":
        return MoeArch(experts, top_k, True, int(cfg["intermediate_size"]))
    return MoeArch(
        experts,
        top_k,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # Qwen3MoeConfig's default
        expert_size=int(cfg["moe_intermediate_size"]),
        dense_layers=_qwen3_dense_layers(cfg, config_file),
    )


def _qwen3_dense_layers(cfg: dict[str, Any], config_file: Path) -> tuple[int, ...]:
    """Layers whose MLP is dense, as Qwen3MoeDecoderLayer picks them: those listed in
    mlp_only_layers, and those (i + 1) % decoder_sparse_step does not hit."""
    n, step = int(cfg["num_hidden_layers"]), cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{config_file}: decoder_sparse_step={step!r} must be an integer >= 1.")
    only = cfg.get("mlp_only_layers") or []
    if any(not isinstance(i, int) or not 0 <= i < n for i in only):
        raise ValueError(
            f"{config_file}: mlp_only_layers={only!r} must list layer indices in [0, {n})."
        )
    return tuple(i for i in range(n) if i in only or (i + 1) % step != 0)


# llama.cpp's names for a Mixtral layer's MoE tensors (arch "llama" with expert_count): the
# router, 2-D, and the experts, 3-D [expert, out, in]. Loaded under the HF names of one
# tensor per expert (gguf_expert_split); the w1 / w2 / w3 stems are Mixtral's.
GGUF_BLOCK = {
    "ffn_gate_inp": MIXTRAL_BLOCK + "gate",
    "ffn_gate_exps": MIXTRAL_BLOCK + "experts.w1",
    "ffn_up_exps": MIXTRAL_BLOCK + "experts.w3",
    "ffn_down_exps": MIXTRAL_BLOCK + "experts.w2",
}


def gguf_expert_split(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A GGUF expert tensor under its loader name ("...experts.w1.weight") and its values
    [expert, out, in] as one HF tensor per expert ("...experts.{e}.w1.weight")."""
    stem, _, tail = name.rpartition(".experts.")
    return {f"{stem}.experts.{e}.{tail}": w[e] for e in range(w.shape[0])}
