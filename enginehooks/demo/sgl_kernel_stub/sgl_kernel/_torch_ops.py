"""The few `torch.ops.sgl_kernel` CPU ops that SGLang binds when a module is imported, as
plain torch code (the stand-in's only real arithmetic).

Why: SGLang 0.5.23's `models/qwen3_5.py` (and `muse_glimmer.py`) read four CPU ops from
`torch.ops.sgl_kernel` at import time. Every Qwen-VL-style multimodal processor imports
that module (through `interns2_mobius`), and SGLang hides the `AttributeError`, so
without these ops SGLang reports "No processor registered" for Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, PaddleOCR-VL, MiniCPM-V... and cannot take an image for them.

Each op follows SGLang's own torch reference for it (the CPU kernels' tests in
sgl-kernel and the Triton kernels they replace): computed in fp32, cast back to the input
dtype. All four are implemented, none only bound: `fused_sigmoid_mul_cpu`,
`fused_qk_gemma_rmsnorm_cpu`, `fused_qk_gemma_rmsnorm_with_gate_cpu` and
`fused_qkvzba_split_reshape_cat_contiguous_cpu` are what Qwen3.5's attention and
GatedDeltaNet layers call on CPU. Nothing here registers a name SGLang probes with
`hasattr` to pick a kernel path (`convert_weight_packed` turns its AMX path on; the
AMX-only ops such as `multimodal_rotary_embedding_cpu` are called only on that path), so
registering these changes no path SGLang selects.
"""

from __future__ import annotations

import torch

#: name -> schema, as SGLang's CPU kernels declare them
SCHEMAS: dict[str, str] = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim) -> (Tensor, Tensor)"),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, "
        "Tensor k_weight, float eps, int head_dim, int num_head) -> (Tensor, Tensor, Tensor)"),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, "
        "int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)"),
}


def fused_sigmoid_mul(input: torch.Tensor, gate: torch.Tensor) -> None:
    """`input *= sigmoid(gate)` in place. `input` is (tokens, heads * head_dim); `gate`
    the same, or (tokens, heads, head_dim) (a strided view of an interleaved q/gate)."""
    g = gate.reshape(input.shape) if gate.dim() == 3 else gate
    if g.shape != input.shape:
        raise ValueError(f"fused_sigmoid_mul_cpu: gate {tuple(gate.shape)} does not fit "
                         f"input {tuple(input.shape)}")
    input.copy_((input.float() * torch.sigmoid(g.float())).to(input.dtype))


def _gemma_rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of every row of `x` (scale `1 + weight`), in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float,
                           head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma RMSNorm of q (tokens, heads * head_dim) and k (tokens, kv_heads *
    head_dim), each with its own weight; new contiguous tensors shaped as the inputs."""
    q_out = _gemma_rmsnorm_rows(q.reshape(-1, head_dim), q_weight, eps).reshape(q.shape)
    k_out = _gemma_rmsnorm_rows(k.reshape(-1, head_dim), k_weight, eps).reshape(k.shape)
    return q_out.contiguous(), k_out.contiguous()


def fused_qk_gemma_rmsnorm_with_gate(
        q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        eps: float, head_dim: int,
        num_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and its output gate interleaved per head in `q_gate` (tokens, heads * 2 *
    head_dim: `[q_h0, gate_h0, q_h1, ...]`): q normed per head, k normed per head, the gate
    copied out; returns (tokens * heads, head_dim), (tokens * kv_heads, head_dim),
    (tokens * heads, head_dim), contiguous."""
    tokens = q_gate.shape[0]
    per_head = q_gate.reshape(tokens, num_head, 2 * head_dim)
    q = per_head[..., :head_dim].reshape(-1, head_dim)
    gate = per_head[..., head_dim:].reshape(-1, head_dim)
    q_out = _gemma_rmsnorm_rows(q, q_weight, eps)
    k_out = _gemma_rmsnorm_rows(k.reshape(-1, head_dim), k_weight, eps)
    return q_out.contiguous(), k_out.contiguous(), gate.contiguous().clone()


def fused_qkvzba_split_reshape_cat_contiguous(
        mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int,
        head_qk: int, head_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """GatedDeltaNet's projections in the contiguous layout, split: `mixed_qkvz` is
    `[all_q | all_k | all_v | all_z]` per token, `mixed_ba` `[all_b | all_a]`; returns
    `[all_q | all_k | all_v]` (tokens, 2 * heads_qk * head_qk + heads_v * head_v), z
    (tokens, heads_v, head_v), b and a (tokens, heads_v), each a new contiguous tensor."""
    tokens = mixed_qkvz.shape[0]
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    if mixed_qkvz.shape[-1] != qkv_dim + num_heads_v * head_v or \
            mixed_ba.shape[-1] != 2 * num_heads_v:
        raise ValueError(f"fused_qkvzba_split_reshape_cat_contiguous_cpu: qkvz "
                         f"{tuple(mixed_qkvz.shape)} / ba {tuple(mixed_ba.shape)} do not fit "
                         f"{num_heads_qk}x{head_qk} q/k and {num_heads_v}x{head_v} v heads")
    mixed_qkv = mixed_qkvz[:, :qkv_dim].contiguous().clone()
    z = mixed_qkvz[:, qkv_dim:].reshape(tokens, num_heads_v, head_v).contiguous().clone()
    b = mixed_ba[:, :num_heads_v].contiguous().clone()
    a = mixed_ba[:, num_heads_v:].contiguous().clone()
    return mixed_qkv, z, b, a


IMPLS = {
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous,
}

_library: torch.library.Library | None = None


def register() -> list[str]:
    """Define the ops in `torch.ops.sgl_kernel` (each once per process: an op already
    there, from a real kernel build or an earlier load of this file, is kept); returns
    the names this call defined."""
    global _library
    defined = []
    for name, schema in SCHEMAS.items():
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        if _library is None:  # kept alive with the module: the ops live as long as it
            _library = torch.library.Library("sgl_kernel", "FRAGMENT")
        _library.define(schema)
        _library.impl(name, IMPLS[name], "CompositeExplicitAutograd")
        defined.append(name)
    return defined
