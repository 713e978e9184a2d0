//! The memory plan: every activation a step produces gets a range of one arena, sized for the
//! largest step (`max_tokens` rows), alive from the launch that writes it to the last launch
//! that reads it (views — slices, the last row — read their source in place and keep it
//! alive). Ranges are assigned first-fit in launch order, reusing memory whose value is dead.
//!
//! Invariant (tested): two buffers whose live ranges intersect never share a byte.

use serde::{Deserialize, Serialize};

/// Arena alignment (bytes): enough for any vector load.
pub const ALIGN: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedBuffer {
    /// The graph node whose value it holds (or whose launches use it as scratch).
    pub node: usize,
    /// For scratch memory: its name among the node's scratch buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scratch: Option<String>,
    pub offset: usize,
    pub bytes: usize,
    /// First and last launch index that touch it (inclusive).
    pub live: (usize, usize),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    pub arena_bytes: usize,
    pub buffers: Vec<PlannedBuffer>,
}

/// A buffer to place: whose it is, its size, and the first and last launch that use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub node: usize,
    pub scratch: Option<String>,
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

/// Place `requests`, ordered by first use.
pub fn place(requests: &[Request]) -> MemoryPlan {
    let mut placed: Vec<PlannedBuffer> = Vec::with_capacity(requests.len());
    let mut arena_bytes = 0;
    for r in requests {
        let (node, bytes, first, last) = (r.node, r.bytes, r.first, r.last);
        let bytes = bytes.div_ceil(ALIGN) * ALIGN;
        // Ranges still alive when this buffer is born, by address.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|b| b.live.1 >= first && b.live.0 <= last)
            .map(|b| (b.offset, b.offset + b.bytes))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (start, end) in busy {
            if start >= offset + bytes {
                break;
            }
            offset = offset.max(end);
        }
        arena_bytes = arena_bytes.max(offset + bytes);
        placed.push(PlannedBuffer {
            node,
            scratch: r.scratch.clone(),
            offset,
            bytes,
            live: (first, last),
        });
    }
    MemoryPlan {
        arena_bytes,
        buffers: placed,
    }
}

impl MemoryPlan {
    /// The first pair of buffers that are alive together and overlap in memory, if any.
    pub fn conflict(&self) -> Option<(&PlannedBuffer, &PlannedBuffer)> {
        for (i, a) in self.buffers.iter().enumerate() {
            for b in &self.buffers[i + 1..] {
                let alive_together = a.live.0 <= b.live.1 && b.live.0 <= a.live.1;
                let overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
                if alive_together && overlap {
                    return Some((a, b));
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_memory_is_reused_and_live_memory_is_not() {
        // a lives 0..1, b 1..2, c 2..3: c can take a's place, b cannot.
        let req = |node, first, last| Request {
            node,
            scratch: None,
            bytes: 1000,
            first,
            last,
        };
        let plan = place(&[req(0, 0, 1), req(1, 1, 2), req(2, 2, 3)]);
        assert!(plan.conflict().is_none());
        assert_eq!(plan.buffers[2].offset, plan.buffers[0].offset);
        assert_ne!(plan.buffers[1].offset, plan.buffers[0].offset);
        assert_eq!(plan.arena_bytes, 2048);
    }
}
