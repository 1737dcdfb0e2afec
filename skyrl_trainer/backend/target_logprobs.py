"""log p(target) from logits, with float32 math but no float32 copy of the logits kept.

`target_logprobs(logits_NV, targets_N)` equals
`logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]`, but it works through the
vocabulary in row chunks and saves only the logits (in their own dtype, bf16 under autocast)
and one log-sum-exp per row for backward, where the gradient
`g * (onehot(target) - softmax(logits))` is rebuilt chunk by chunk. A plain log_softmax would
keep a float32 (N, V) tensor alive until backward, and recomputing the projection instead
would cost an extra vocabulary matmul.
"""

from __future__ import annotations

import torch


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, chunk: int) -> torch.Tensor:
        lse_N = torch.empty(logits_NV.shape[0], dtype=torch.float32, device=logits_NV.device)
        for start in range(0, logits_NV.shape[0], chunk):
            lse_N[start : start + chunk] = logits_NV[start : start + chunk].float().logsumexp(-1)
        target_logits = logits_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.chunk = chunk
        return target_logits - lse_N

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        grad_logits = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad_N[rows].float().unsqueeze(-1)
            softmax = (logits_NV[rows].float() - lse_N[rows].unsqueeze(-1)).exp_()
            chunk_grad = softmax.mul_(-g)
            chunk_grad.scatter_add_(-1, targets_N[rows].unsqueeze(-1), g)
            grad_logits[rows] = chunk_grad
        return grad_logits, None, None


def target_logprobs(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """Float32 log-probability of `targets_N[i]` under row `i` of `logits_NV`."""
    return _TargetLogprobs.apply(logits_NV, targets_N, chunk)
