"""Would FP8 attention speed up the FP8 rollout?  cuDNN's FP8 flash attention (``graph.sdpa_fp8`` of NVIDIA's
cudnn-frontend Python package, per-tensor e4m3 scales, e4m3 output on Hopper) against the bf16 cuDNN SDPA the
rollout runs, at the rollout's joint-attention shapes and in its layout ([S, B, N, D] q / k / v, as the q/k-norm +
RoPE kernel writes them).  Per shape: milliseconds and TFLOP/s of each kernel, the per-tensor quantization of
q / k / v it would need (torch ops here; a fused kernel would write e4m3 directly), and the FP8 output's error
against the bf16 one (relative Frobenius and max abs).  One GPU.  Prints one table.

    python bench/fp8_attention.py [--batch 16] [--tokens 1133 1029] [--repeats 30]

Needs ``nvidia-cudnn-frontend`` (``import cudnn``) and a Hopper GPU; without them it says so and exits 1.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from _profile import median_ms
from model_specs.common.fp8 import E4M3_MAX, quantize_rows

HEADS, HEAD_DIM = 24, 128


def _inputs(batch: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k RMS-normalised (as the model's q/k norms leave them), v unnormalised; [S, B, N, D] bf16."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    shape = (tokens, batch, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
    q, k = (F.rms_norm(t, (HEAD_DIM,)) for t in (q, k))
    return tuple(t.to(torch.bfloat16) for t in (q, k, 3 * v))


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 codes (t's shape) and the descale (amax / 448) as a [1, 1, 1, 1] float32 tensor: the
    product's per-row quantization with the whole tensor as one row."""
    codes, descale = quantize_rows(t.reshape(1, -1))
    return codes.reshape(t.shape), descale.reshape(1, 1, 1, 1)


def _bhsd(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """cuDNN's (B, H, S, D) dims and strides of an [S, B, N, D] tensor."""
    s, b, h, d = t.shape
    return [b, h, s, d], [t.stride(1), t.stride(2), t.stride(0), t.stride(3)]


class Fp8Attention:
    """One cuDNN FP8 SDPA graph for one shape (built once, executed per call)."""

    def __init__(self, cudnn, q8: torch.Tensor):
        self.cudnn, fp32, e4m3 = cudnn, cudnn.data_type.FLOAT, cudnn.data_type.FP8_E4M3
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=self.handle)
        dims, strides = _bhsd(q8)
        self.q, self.k, self.v = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in "qkv")
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
        self.scales = [graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
        o, _, amax_s, amax_o = graph.sdpa_fp8(q=self.q, k=self.k, v=self.v, descale_q=self.scales[0],
                                              descale_k=self.scales[1], descale_v=self.scales[2],
                                              descale_s=self.scales[3], scale_s=self.scales[4],
                                              scale_o=self.scales[5], is_inference=True,
                                              attn_scale=1.0 / math.sqrt(HEAD_DIM), use_causal_mask=False)
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        self.o, self.amax = o, (amax_s, amax_o)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
        self.amax_buf = [torch.empty(1, 1, 1, 1, device="cuda") for _ in range(2)]
        ones = torch.ones(1, 1, 1, 1, device="cuda")
        self.p_scales = (ones / E4M3_MAX, ones * E4M3_MAX)  # P in [0, 1]: its descale and scale

    def __call__(self, q8, k8, v8, dq, dk, dv, out8: torch.Tensor, scale_o: torch.Tensor) -> None:
        """out8 = e4m3 codes of softmax(q kᵀ / √D) v times scale_o; P quantised at 448."""
        pack = {self.q: q8, self.k: k8, self.v: v8, self.scales[0]: dq, self.scales[1]: dk, self.scales[2]: dv,
                self.scales[3]: self.p_scales[0], self.scales[4]: self.p_scales[1], self.scales[5]: scale_o,
                self.o: out8, self.amax[0]: self.amax_buf[0], self.amax[1]: self.amax_buf[1]}
        self.graph.execute(pack, self.workspace, handle=self.handle)


def _case(cudnn, batch: int, tokens: int, repeats: int) -> dict[str, float]:
    q, k, v = _inputs(batch, tokens)
    flops = 4 * batch * HEADS * tokens * tokens * HEAD_DIM
    bf16 = lambda: F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))  # noqa: E731
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        ms_bf16 = median_ms(bf16, repeats)
        ref = bf16().float()
    quantize = lambda: [_quantize(t) for t in (q, k, v)]  # noqa: E731
    ms_quant = median_ms(quantize, repeats)
    (q8, dq), (k8, dk), (v8, dv) = quantize()
    descale_o = dv.clone()  # |O| <= max |v|: O's codes at v's scale
    scale_o = 1 / descale_o
    out8 = torch.empty_like(q8)
    attn = Fp8Attention(cudnn, q8)
    run = lambda: attn(q8, k8, v8, dq, dk, dv, out8, scale_o)  # noqa: E731
    ms_fp8 = median_ms(run, repeats)
    run()
    got = (out8.float() * descale_o.reshape(())).permute(1, 2, 0, 3)
    return dict(bf16=ms_bf16, fp8=ms_fp8, quant=ms_quant, tf_bf16=flops / ms_bf16 / 1e9, tf_fp8=flops / ms_fp8 / 1e9,
                rel=float((got - ref).norm() / ref.norm()), max_abs=float((got - ref).abs().max()),
                ref_max=float(ref.abs().max()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="rows per forward (the rollout's 16: cond or uncond)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1133, 1029],
                   help="joint sequence lengths (1024 image + the cond / uncond text)")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        sys.exit("bench/fp8_attention.py: needs a Hopper (sm90) or newer GPU")
    try:
        import cudnn
    except ImportError as e:
        sys.exit(f"bench/fp8_attention.py: needs NVIDIA's cudnn-frontend Python package "
                 f"(pip install nvidia-cudnn-frontend): {e}")
    print(f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, cuDNN backend {cudnn.backend_version()}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"| tokens (batch {args.batch}, {HEADS} x {HEAD_DIM}) | bf16 cuDNN ms (TFLOP/s) | FP8 cuDNN ms (TFLOP/s) | "
          f"q/k/v quantization (torch) ms | FP8 output vs bf16: rel. Frobenius, max abs (of max) |")
    print("|---|---|---|---|---|")
    for tokens in args.tokens:
        r = _case(cudnn, args.batch, tokens, args.repeats)
        print(f"| {tokens} | {r['bf16']:.3f} ({r['tf_bf16']:.0f}) | {r['fp8']:.3f} ({r['tf_fp8']:.0f}) | "
              f"{r['quant']:.3f} | {r['rel']:.2e}, {r['max_abs']:.3f} ({r['ref_max']:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
