"""On a CUDA device: the split-K decode kernel's ``block_n`` against KV read bandwidth (for choosing its default)."""
import torch

from kvmesh.bench import kernels as kb
from kvmesh.kernels.triton.attention import decode_attention

gen = torch.Generator(device="cuda").manual_seed(0)
for batch, context in [(1, 4096), (16, 1024), (64, 4096), (256, 2048)]:
    k, v, num_blocks = kb._paged_cache(batch * context, torch.bfloat16, gen)
    per_seq = -(-context // kb.BLOCK_SIZE)
    tables = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * per_seq].view(batch, per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, kb.NUM_HEADS, kb.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    row = []
    for block_n in (32, 64, 128):
        ms = kb._time_ms(lambda: decode_attention(q, k, v, tables, lens, 0.088, context, block_n=block_n))
        row.append(f"block_n {block_n}: {2 * batch * context * 8 * 128 * 2 / (ms / 1e3) / 1e12:.2f} TB/s")
    print(f"batch {batch} x {context}: " + ", ".join(row), flush=True)
