"""TRL's packed "tree" attention without FlashAttention-3, in PyTorch, and whether FlashAttention-3 loads."""

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger


logger = get_logger(__name__)


def tree_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """
    TRL's packed "tree" attention without FlashAttention-3: each segment's queries attend, causally and aligned to
    the end, to the keys of its path from the root (`tree_kv_index`), with PyTorch's scaled dot-product attention, one
    segment at a time. What [`TOPRAsyncGRPOTrainer`] registers under TRL's name where FlashAttention-3 cannot be
    loaded (on CPU; on a GPU without the kernels Hub). Same arguments and result as TRL's.

    Returns:
        `tuple[torch.Tensor, None]`: the attention output, of shape `(1, N, heads, head_dim)`.
    """
    if softcap:
        raise ValueError("The tree attention without FlashAttention-3 does not soft-cap attention logits.")
    q, k, v = query[0], key[0], value[0]  # (heads, N, head_dim)
    if k.shape[0] != q.shape[0]:  # grouped-query attention
        k, v = k.repeat_interleave(q.shape[0] // k.shape[0], 0), v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    outputs, starts_q, starts_k = [], tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(starts_q) - 1):
        queries, path = q[:, starts_q[s] : starts_q[s + 1]], tree_kv_index[starts_k[s] : starts_k[s + 1]]
        keys, values = k.index_select(1, path), v.index_select(1, path)
        rows = torch.arange(queries.shape[1], device=q.device)[:, None] + keys.shape[1] - queries.shape[1]
        columns = torch.arange(keys.shape[1], device=q.device)[None, :]
        mask = columns <= rows
        if sliding_window:
            mask &= columns > rows - sliding_window
        outputs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling))
    return torch.cat(outputs, 1).transpose(0, 1).unsqueeze(0).contiguous(), None


def flash_attention_3_loads(device: torch.device) -> bool:
    """
    Whether TRL's tree attention can load FlashAttention-3 (CUDA, from the kernels Hub) on `device`.

    Args:
        device (`torch.device`):
            The training device.

    Returns:
        `bool`: `False` off CUDA, and where the kernel cannot be loaded (logged with the reason).
    """
    if device.type != "cuda":
        return False
    try:
        from kernels import get_kernel

        get_kernel("kernels-community/flash-attn3", version=1)
        return True
    except Exception as error:  # no kernels package, no network, no cached kernel, an unsupported GPU
        logger.info(f"FlashAttention-3 could not be loaded ({type(error).__name__}: {error}): tree attention in SDPA.")
        return False
