//! The KV block manager: the cache is a pool of fixed-size blocks (`block_size` token rows); a
//! sequence owns a block table, one block per `block_size` positions, grown as it grows and
//! returned whole when it finishes, is preempted or is aborted.
//!
//! Invariants (checked by [`BlockManager::check`], property-tested):
//! - every block is either free or owned by exactly one table, never both;
//! - the free list has no duplicates, and free + owned = total;
//! - a table covers its sequence's cached tokens: `len(table) = ceil(tokens / block_size)`.

use std::collections::HashSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {needed} more needed, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    total: usize,
    free: Vec<BlockId>,
}

impl BlockManager {
    pub fn new(total: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "blocks hold at least one token");
        Self {
            block_size,
            total,
            // Popped from the back: low ids first.
            free: (0..total as u32).rev().map(BlockId).collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.total - self.free.len()
    }

    /// Blocks a sequence of `tokens` cached positions needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks `table` must gain to hold `tokens` positions.
    pub fn shortfall(&self, table: &[BlockId], tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(table.len())
    }

    /// Grow `table` to hold `tokens` positions; on failure nothing changes.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = self.shortfall(table, tokens);
        if needed > self.free.len() {
            return Err(OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            table.push(self.free.pop().expect("counted above"));
        }
        Ok(())
    }

    /// Return every block of `table` (leaving it empty).
    pub fn release(&mut self, table: &mut Vec<BlockId>) {
        self.free.extend(table.drain(..).rev());
    }

    /// Check the invariants against the live tables; the first violation, if any.
    pub fn check<'a>(&self, tables: impl IntoIterator<Item = &'a [BlockId]>) -> Result<(), String> {
        let mut seen: HashSet<BlockId> = HashSet::new();
        for b in &self.free {
            if b.0 as usize >= self.total || !seen.insert(*b) {
                return Err(format!("free list holds {b:?} twice or out of range"));
            }
        }
        let mut owned = 0;
        for table in tables {
            for b in table {
                if !seen.insert(*b) {
                    return Err(format!("{b:?} is free and owned, or owned twice"));
                }
                owned += 1;
            }
        }
        if owned + self.free.len() != self.total {
            return Err(format!(
                "{owned} owned + {} free != {} blocks: a block leaked",
                self.free.len(),
                self.total
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_whole_blocks_and_fails_without_side_effects() {
        let mut m = BlockManager::new(4, 16);
        let mut a = Vec::new();
        m.grow(&mut a, 17).unwrap();
        assert_eq!(a.len(), 2);
        m.grow(&mut a, 32).unwrap();
        assert_eq!(a.len(), 2, "32 positions still fit two blocks");
        let mut b = Vec::new();
        assert_eq!(m.grow(&mut b, 49), Err(OutOfBlocks { needed: 4, free: 2 }));
        assert!(b.is_empty());
        m.check([a.as_slice(), b.as_slice()]).unwrap();
        m.release(&mut a);
        assert_eq!(m.free_blocks(), 4);
        m.check([a.as_slice()]).unwrap();
    }
}
