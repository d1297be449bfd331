"""refdec's state-dict names and their transformers names (M2M100/Pegasus layout), and the
permutation of the model dimension that refdec's export applies (refdec.hf.export)."""

from __future__ import annotations

import torch

from ..config import ModelConfig

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "out_proj"}
_ENC = {
    **{f"attn.{a}": f"self_attn.{b}" for a, b in _ATTN.items()},
    "ff.w1": "fc1",
    "ff.w2": "fc2",
    "sub1.norm": "self_attn_layer_norm",
    "sub2.norm": "final_layer_norm",
}
_DEC = {
    **{f"self_attn.{a}": f"self_attn.{b}" for a, b in _ATTN.items()},
    **{f"cross_attn.{a}": f"encoder_attn.{b}" for a, b in _ATTN.items()},
    "ff.w1": "fc1",
    "ff.w2": "fc2",
    "sub1.norm": "self_attn_layer_norm",
    "sub2.norm": "encoder_attn_layer_norm",
    "sub3.norm": "final_layer_norm",
}
_READS = ("wq", "wk", "wv", "w1")  # linear maps whose input is the residual stream (d_model columns)
_WRITES = ("wo", "w2")  # linear maps whose output is the residual stream (d_model rows)


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """refdec state-dict key -> the transformers key (without the "model." prefix) of the same tensor."""
    names = {
        "tgt_embed.weight": "shared.weight",
        "enc_norm.weight": "encoder.layer_norm.weight",
        "enc_norm.bias": "encoder.layer_norm.bias",
        "dec_norm.weight": "decoder.layer_norm.weight",
        "dec_norm.bias": "decoder.layer_norm.bias",
    }
    for side, n, table in (("encoder", cfg.enc_layers, _ENC), ("decoder", cfg.dec_layers, _DEC)):
        for i in range(n):
            for ours, theirs in table.items():
                for p in ("weight", "bias"):
                    names[f"{side}.{i}.{ours}.{p}"] = f"{side}.layers.{i}.{theirs}.{p}"
    return names


def half_split(d: int) -> torch.Tensor:
    """The permutation of the model dimension that turns refdec's interleaved table into [sin | cos]:
    dims 0, 2, 4, .. then 1, 3, 5, .. (new dim j holds old dim perm[j])."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def permute_state(state: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every residual-stream dimension of a refdec state dict reordered by `perm` (see the docstring)."""
    out = {}
    for key, t in state.items():
        parts = key.split(".")
        if key.endswith("embed.weight"):
            t = t[:, perm]
        elif parts[-2] in ("norm", "enc_norm", "dec_norm"):  # LayerNorm gains and biases
            t = t[perm]
        elif parts[-2] in _READS and parts[-1] == "weight":
            t = t[:, perm]
        elif parts[-2] in _WRITES:
            t = t[perm]
        out[key] = t.contiguous()
    return out
