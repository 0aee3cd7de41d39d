"""The CPU stand-in for `sgl_kernel` (enginehooks/demo/sgl_kernel_stub): each torch op
it registers equals a plain torch reference written from SGLang's own (its CPU kernels'
tests and the Triton kernels they stand for), in fp32 and bf16, on strided inputs as
SGLang passes them (views of a fused projection); and the package stays loud: any other
name raises when called, and SGLang's AMX probe still finds nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip("torch")

from enginehooks.demo.servers import STUB_DIR  # noqa: E402

EPS = 1e-6


def _ops() -> ModuleType:
    """The ops module, loaded by file under a private name: the stand-in's folder never
    goes on this process's path (the real-kernel check of `cpu_env` would then find it)."""
    path = STUB_DIR / "sgl_kernel" / "_torch_ops.py"
    spec = importlib.util.spec_from_file_location("enginehooks_test_sgl_kernel_ops", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register()  # once per process; a second load keeps the first's ops
    return module


OPS = _ops()


def gemma_rmsnorm_per_head(x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """SGLang's reference (sgl-kernel's CPU norm test): per head, in fp32, scale 1 + w."""
    xf = x.to(torch.float32).reshape(-1, head_dim)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return (xf * (1.0 + weight.to(torch.float32))).to(x.dtype).reshape_as(x)


def strided(t: torch.Tensor) -> torch.Tensor:
    """`t` as a view whose rows are not contiguous (a slice of a wider tensor), as
    `qkv.split(...)` hands it to the kernels."""
    wide = torch.cat([t, torch.randn_like(t)], dim=-1)
    view = wide[..., : t.shape[-1]]
    assert not view.is_contiguous()
    return view


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_3d", [False, True])
def test_fused_sigmoid_mul_multiplies_in_place_by_the_gates_sigmoid(dtype: torch.dtype,
                                                                    gate_3d: bool) -> None:
    tokens, heads, head_dim = 5, 3, 8
    x = torch.randn(tokens, heads * head_dim, dtype=dtype)
    if gate_3d:  # the per-head gate view of an interleaved q/gate buffer
        gate = torch.randn(tokens, heads, 2 * head_dim, dtype=dtype)[..., :head_dim]
        flat = gate.reshape(tokens, -1)
    else:
        gate = flat = torch.randn_like(x)
    expected = (x.float() * torch.sigmoid(flat.float())).to(dtype)
    ptr = x.data_ptr()
    assert torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate) is None
    assert x.data_ptr() == ptr
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24)])
def test_fused_qk_gemma_rmsnorm_norms_every_head(dtype: torch.dtype, heads: int,
                                                 kv_heads: int, head_dim: int) -> None:
    q = strided(torch.randn(7, heads * head_dim, dtype=dtype))
    k = strided(torch.randn(7, kv_heads * head_dim, dtype=dtype))
    qw, kw = torch.randn(head_dim, dtype=dtype), torch.randn(head_dim, dtype=dtype)
    q_out, k_out = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(q, k, qw, kw, EPS, head_dim)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    torch.testing.assert_close(q_out, gemma_rmsnorm_per_head(q, qw, head_dim), rtol=0, atol=0)
    torch.testing.assert_close(k_out, gemma_rmsnorm_per_head(k, kw, head_dim), rtol=0, atol=0)
    # SGLang views the output as the input's shape
    assert q_out.view(q.shape).shape == q.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24)])
def test_fused_qk_gemma_rmsnorm_with_gate_deinterleaves_the_gate(
        dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    tokens = 6
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    gate = torch.randn(tokens, heads, head_dim, dtype=dtype)
    q_gate = strided(torch.cat([q, gate], dim=-1).reshape(tokens, heads * 2 * head_dim))
    k = strided(torch.randn(tokens, kv_heads * head_dim, dtype=dtype))
    qw, kw = torch.randn(head_dim, dtype=dtype), torch.randn(head_dim, dtype=dtype)
    q_out, k_out, gate_out = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, qw, kw, EPS, head_dim, heads)
    assert q_out.shape == gate_out.shape == (tokens * heads, head_dim)
    assert k_out.shape == (tokens * kv_heads, head_dim)
    torch.testing.assert_close(q_out, gemma_rmsnorm_per_head(q, qw, head_dim)
                               .reshape(-1, head_dim), rtol=0, atol=0)
    torch.testing.assert_close(k_out, gemma_rmsnorm_per_head(k, kw, head_dim)
                               .reshape(-1, head_dim), rtol=0, atol=0)
    torch.testing.assert_close(gate_out, gate.reshape(-1, head_dim), rtol=0, atol=0)


def qkvzba_by_head_group(qkvz: torch.Tensor, ba: torch.Tensor, hqk: int, hv: int, dqk: int,
                         dv: int) -> tuple[torch.Tensor, ...]:
    """The Triton kernel's own index arithmetic (SGLang's
    `fused_qkvzba_split_reshape_cat_contiguous_kernel`), one token and head group at a
    time: the op's reference."""
    tokens, group = qkvz.shape[0], hv // hqk
    tq, tv = hqk * dqk, hv * dv
    qkv = torch.empty(tokens, 2 * tq + tv, dtype=qkvz.dtype)
    z = torch.empty(tokens, hv, dv, dtype=qkvz.dtype)
    b = torch.empty(tokens, hv, dtype=ba.dtype)
    a = torch.empty(tokens, hv, dtype=ba.dtype)
    for t in range(tokens):
        for g in range(hqk):
            qkv[t, g * dqk:(g + 1) * dqk] = qkvz[t, g * dqk:(g + 1) * dqk]
            qkv[t, tq + g * dqk:tq + (g + 1) * dqk] = qkvz[t, tq + g * dqk:tq + (g + 1) * dqk]
            v0 = 2 * tq + g * group * dv
            qkv[t, v0:v0 + group * dv] = qkvz[t, v0:v0 + group * dv]
            z.view(tokens, -1)[t, g * group * dv:(g + 1) * group * dv] = \
                qkvz[t, v0 + tv:v0 + tv + group * dv]
            for i in range(group):
                b[t, g * group + i] = ba[t, g * group + i]
                a[t, g * group + i] = ba[t, hv + g * group + i]
    return qkv, z, b, a


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hqk,hv,dqk,dv", [(2, 4, 8, 16), (1, 3, 16, 8), (2, 2, 8, 8)])
def test_fused_qkvzba_split_reshape_cat_contiguous_splits_the_projections(
        dtype: torch.dtype, hqk: int, hv: int, dqk: int, dv: int) -> None:
    tokens = 5
    qkvz = torch.randn(tokens, 2 * hqk * dqk + 2 * hv * dv, dtype=dtype)
    ba = torch.randn(tokens, 2 * hv, dtype=dtype)
    got = torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
        qkvz, ba, hqk, hv, dqk, dv)
    for out, ref in zip(got, qkvzba_by_head_group(qkvz, ba, hqk, hv, dqk, dv), strict=True):
        assert out.is_contiguous() and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert got[0].data_ptr() != qkvz.data_ptr()  # new tensors, as the kernel's
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
            qkvz, ba, hqk, hv + 1, dqk, dv)


def test_loading_the_ops_twice_keeps_the_first() -> None:
    """The stand-in may be imported under two names in one process (`sgl_kernel`, and
    by its path in the package): the second registration defines nothing."""
    assert _ops().register() == []
    assert OPS.register() == []


def test_the_package_registers_its_ops_and_stays_loud() -> None:
    """`import sgl_kernel` with the stand-in first on the path (how SGLang runs here):
    the four ops are there, SGLang's AMX probe finds nothing, any other name raises
    naming itself when called."""
    code = (
        "import json, torch, sgl_kernel\n"
        "names = " + repr(sorted(OPS.SCHEMAS)) + "\n"
        "out = {'ops': [hasattr(torch.ops.sgl_kernel, n) for n in names],\n"
        "       'amx_probe': hasattr(torch.ops.sgl_kernel, 'convert_weight_packed'),\n"
        "       'file': sgl_kernel.__file__}\n"
        "try:\n"
        "    sgl_kernel.silu_and_mul(None)\n"
        "except RuntimeError as e:\n"
        "    out['loud'] = str(e)\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(STUB_DIR), str(Path(__file__).resolve().parents[3])]))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(STUB_DIR))
    assert out["ops"] == [True] * 4
    assert out["amx_probe"] is False
    assert "sgl_kernel.silu_and_mul was called" in out["loud"]
