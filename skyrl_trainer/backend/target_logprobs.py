"""log p(target) from logits, with float32 math but no float32 copy of the logits kept.

`target_logprobs(logits_NV, targets_N)` equals
`logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]`; with (N, K) targets
(several candidate targets per row) it equals `log_softmax(-1).gather(-1, targets)`, (N, K). It works through the
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
    def forward(ctx, logits_NV: torch.Tensor, targets_NK: torch.Tensor, chunk: int) -> torch.Tensor:
        lse_N = torch.empty(logits_NV.shape[0], dtype=torch.float32, device=logits_NV.device)
        for start in range(0, logits_NV.shape[0], chunk):
            lse_N[start : start + chunk] = logits_NV[start : start + chunk].float().logsumexp(-1)
        # targets_NKK: (N, K); a 1-D target is K = 1.
        target_logits = logits_NV.gather(-1, targets_NK).float()
        ctx.save_for_backward(logits_NV, targets_NK, lse_N)
        ctx.chunk = chunk
        return target_logits - lse_N.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad_NK: torch.Tensor):
        logits_NV, targets_NK, lse_N = ctx.saved_tensors
        grad_logits = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g_NK = grad_NK[rows].float()
            softmax = (logits_NV[rows].float() - lse_N[rows].unsqueeze(-1)).exp_()
            chunk_grad = softmax.mul_(-g_NK.sum(-1, keepdim=True))
            chunk_grad.scatter_add_(-1, targets_NK[rows], g_NK)
            grad_logits[rows] = chunk_grad
        return grad_logits, None, None


def target_logprobs(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """Float32 log-probability of `targets_N[i]` under row `i` of `logits_NV`.

    `targets_N` is (N,), or (N, K) for K targets per row; the result has its shape.
    """
    if targets_N.dim() == 1:
        return _TargetLogprobs.apply(logits_NV, targets_N.unsqueeze(-1), chunk).squeeze(-1)
    return _TargetLogprobs.apply(logits_NV, targets_N, chunk)
