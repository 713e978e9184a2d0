//! How many KV-cache blocks a server keeps when it is not told: on a GPU, what fits in the
//! share of the device's memory the process may use (vLLM's `--gpu-memory-utilization`) once
//! everything else is allocated; on the CPU, enough for every running sequence's full context,
//! at most half the memory available.

/// A device's memory: what is free now and what it has in all, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: usize,
    pub total: usize,
}

/// What a GPU keeps free besides the KV pool, for what is allocated after it is sized: CUDA
/// graphs of the decode steps and the driver's own allocations.
pub const GPU_HEADROOM: usize = 512 << 20;

/// vLLM's default `--gpu-memory-utilization`.
pub const DEFAULT_GPU_SHARE: f64 = 0.9;

/// KV blocks of `block_bytes` each for a process that may use `share` of the device's memory,
/// given the memory free once everything else is allocated: `share · total`, less what is in
/// use on the device (this process's and others'), less [`GPU_HEADROOM`], and never more than
/// is free.
pub fn gpu_kv_blocks(memory: DeviceMemory, share: f64, block_bytes: usize) -> Result<usize, String> {
    if !(share > 0.0 && share <= 1.0) {
        return Err(format!("--gpu-memory-utilization must be within (0, 1], got {share}"));
    }
    let used = memory.total.saturating_sub(memory.free);
    let allowed = (share * memory.total as f64) as usize;
    let budget = allowed
        .saturating_sub(used)
        .min(memory.free)
        .saturating_sub(GPU_HEADROOM);
    Ok(budget / block_bytes.max(1))
}

/// The CPU's default: blocks for `sequences` requests of the full context
/// (`blocks_per_context` each), at most half of `available` bytes, and at least one full
/// context's worth. The CPU backend's pool grows as blocks are first used, so blocks nobody
/// needs cost nothing.
pub fn cpu_kv_blocks(available: usize, block_bytes: usize, blocks_per_context: usize, sequences: usize) -> usize {
    let wanted = blocks_per_context.saturating_mul(sequences.max(1));
    let affordable = available / 2 / block_bytes.max(1);
    wanted.min(affordable).max(blocks_per_context)
}

/// The memory Linux says is available to a new allocation now (`MemAvailable`), in bytes.
pub fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&info)
}

fn parse_mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `blocks` of `block_size` positions as a line for the server's start: the positions, how
/// many requests of the full `context` they hold, and their bytes.
pub fn describe(blocks: usize, block_size: usize, context: usize, block_bytes: usize) -> String {
    let positions = blocks * block_size;
    let gib = (blocks * block_bytes) as f64 / f64::from(1 << 30);
    format!(
        "{blocks} blocks of {block_size} positions: {positions} positions, {:.1} requests of the full context ({context} positions), {gib:.2} GiB",
        positions as f64 / context.max(1) as f64
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    /// An 8B model on an H200 (143 GiB): 16 GiB of weights and 2 GiB of activations and
    /// context already allocated; at 0.9, the rest up to 128.7 GiB, less the headroom.
    #[test]
    fn a_gpu_keeps_its_share_less_what_is_in_use() {
        let total = 143 * GIB;
        let memory = DeviceMemory {
            free: total - 18 * GIB,
            total,
        };
        let block = 2 << 20;
        let blocks = gpu_kv_blocks(memory, 0.9, block).unwrap();
        let expected = ((0.9 * total as f64) as usize - 18 * GIB - GPU_HEADROOM) / block;
        assert_eq!(blocks, expected);
        // Another process holding 120 GiB leaves what is free, not the share.
        let crowded = DeviceMemory {
            free: total - 138 * GIB,
            total,
        };
        assert_eq!(
            gpu_kv_blocks(crowded, 0.9, block).unwrap(),
            0,
            "the share is already used"
        );
        let half = DeviceMemory { free: 60 * GIB, total };
        assert_eq!(
            gpu_kv_blocks(half, 1.0, block).unwrap(),
            (60 * GIB - GPU_HEADROOM) / block,
            "never more than is free"
        );
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(gpu_kv_blocks(memory, bad, block)
                .unwrap_err()
                .contains("--gpu-memory-utilization"));
        }
    }

    #[test]
    fn the_cpu_keeps_every_sequences_context_within_half_its_memory() {
        // 64 sequences of 512 blocks each, 1 MiB a block: 32 GiB wanted.
        assert_eq!(cpu_kv_blocks(128 * GIB, 1 << 20, 512, 64), 512 * 64);
        assert_eq!(cpu_kv_blocks(16 * GIB, 1 << 20, 512, 64), 8 * 1024, "half of 16 GiB");
        assert_eq!(
            cpu_kv_blocks(GIB / 4, 1 << 20, 512, 64),
            512,
            "one full context at least"
        );
    }

    #[test]
    fn mem_available_is_read_in_kib() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(available_memory().is_some_and(|a| a > 0), "this machine's");
    }

    #[test]
    fn the_start_line_counts_requests_of_the_context() {
        assert_eq!(
            describe(2048, 16, 8192, 1 << 20),
            "2048 blocks of 16 positions: 32768 positions, 4.0 requests of the full context (8192 positions), 2.00 GiB"
        );
    }
}
