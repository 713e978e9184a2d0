//! Weights pulled toward L2 by the kernel before the matmul that reads them. At batch 1 the
//! kernels between two projections (the KV append and attention's two passes) move a few MB
//! and leave HBM nearly idle for microseconds, while the output projection after them then
//! streams its whole weight matrix (32 MB for an 8B model). Attention's split pass issues
//! `prefetch.global.L2` for the first `prefetch_bytes` of those weights, one 128-byte line a
//! thread at a time across its grid, so the projection finds them in L2. A prefetch changes
//! no value; `prefetch_bytes` = 0 (the plan's choice at many rows, where the cache reads fill
//! L2, or the runtime's when it is switched off) issues none.

use crate::dsl::*;

/// Bytes of one L2 line.
const LINE: i64 = 128;

/// `kernel` also prefetching the first `prefetch_bytes` of buffer `next_w` (parameters added
/// last) into L2 before its own work; its grid's threads take the lines in turn.
pub fn prefetching_next_weights(mut kernel: Kernel) -> Kernel {
    let block = int(kernel.block_dim as i64);
    let threads = kernel.grid.clone() * block.clone();
    kernel.body.insert(
        0,
        for_(
            "line",
            (bid() * block + tid()) * int(LINE),
            var("prefetch_bytes"),
            threads * int(LINE),
            vec![prefetch_l2("next_w", var("line"))],
        ),
    );
    kernel
        .params
        .extend([buffer("next_w", Ty::U8, false), scalar("prefetch_bytes", Ty::I32)]);
    kernel.origin.push_str("; the next matmul's weights prefetched into L2");
    kernel
}
