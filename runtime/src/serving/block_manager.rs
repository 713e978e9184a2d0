//! The KV block manager: the cache is a pool of fixed-size blocks (`block_size` token rows); a
//! sequence holds a block table, one block per `block_size` positions, grown as it grows and
//! released whole when it finishes, is preempted or is aborted.
//!
//! Prefix caching. A block whose positions are all computed is *registered* under a key made
//! of its tokens and the registration serial of the block before it. Serials are never reused,
//! so two blocks share a key only when their whole prefixes are equal: the key is exact, with
//! no hash collision to reason about. A new sequence looks its prompt up block by block and
//! starts with the blocks found, shared with whoever else holds them (reference counts). A
//! released block whose count drops to zero keeps its content and registration, parked as
//! *evictable*; new blocks come from the never-registered free list first, then by evicting the
//! least recently parked cached block (whose registration ends there, and with it the reach of
//! every key built on its serial).
//!
//! Invariants (checked by [`BlockManager::check`], property-tested):
//! - a block's reference count equals the number of tables holding it;
//! - a block with count 0 is either free (unregistered) or evictable (registered), never both;
//!   a block with a count above 0 is neither;
//! - the registry maps each key to a block registered under that key, and back;
//! - referenced + free + evictable = total.

pub use crate::kv::BlockId;
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: {needed} more needed, {free} free")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

/// What a full block's content is: its tokens after the prefix registered as `parent`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PrefixKey {
    parent: Option<Serial>,
    tokens: Vec<u32>,
}

/// A registration's identity; the next block's key names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Serial(u64);

#[cfg(test)]
impl Serial {
    pub(crate) fn new(serial: u64) -> Self {
        Self(serial)
    }
}

#[derive(Debug, Clone)]
struct Registration {
    key: PrefixKey,
    serial: Serial,
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    refs: Vec<u32>,
    free: Vec<BlockId>,
    /// Registered blocks nobody holds, by the tick they were parked at (oldest evicted first).
    evictable: BTreeMap<u64, BlockId>,
    parked_at: Vec<u64>,
    registrations: Vec<Option<Registration>>,
    registry: HashMap<PrefixKey, BlockId>,
    next_serial: u64,
    tick: u64,
    /// Serials of the registrations evicted since [`take_evicted`](Self::take_evicted) last
    /// asked.
    evicted: Vec<Serial>,
}

impl BlockManager {
    pub fn new(total: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "blocks hold at least one token");
        Self {
            block_size,
            refs: vec![0; total],
            // Popped from the back: low ids first.
            free: (0..total as u32).rev().map(BlockId).collect(),
            evictable: BTreeMap::new(),
            parked_at: vec![0; total],
            registrations: vec![None; total],
            registry: HashMap::new(),
            next_serial: 0,
            tick: 0,
            evicted: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks a new allocation can take: free ones and evictable cached ones.
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks some sequence holds.
    pub fn used_blocks(&self) -> usize {
        self.total() - self.free_blocks()
    }

    /// Blocks nobody holds that still cache a prefix.
    pub fn cached_blocks(&self) -> usize {
        self.evictable.len()
    }

    /// How many tables hold `block`.
    pub fn holders(&self, block: BlockId) -> u32 {
        self.refs[block.0 as usize]
    }

    /// Blocks a sequence of `tokens` cached positions needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks `table` must gain to hold `tokens` positions.
    pub fn shortfall(&self, table: &[BlockId], tokens: usize) -> usize {
        self.blocks_for(tokens).saturating_sub(table.len())
    }

    /// Grow `table` to hold `tokens` positions with blocks of its own; on failure nothing changes.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = self.shortfall(table, tokens);
        if needed > self.free_blocks() {
            return Err(OutOfBlocks {
                needed,
                free: self.free_blocks(),
            });
        }
        for _ in 0..needed {
            let block = self.take().expect("counted above");
            self.refs[block.0 as usize] = 1;
            table.push(block);
        }
        Ok(())
    }

    /// A block for new content: a free one, else the least recently parked cached one.
    fn take(&mut self) -> Option<BlockId> {
        if let Some(block) = self.free.pop() {
            return Some(block);
        }
        let (_, block) = self.evictable.pop_first()?;
        let registration = self.registrations[block.0 as usize]
            .take()
            .expect("evictable blocks are registered");
        self.registry.remove(&registration.key);
        self.evicted.push(registration.serial);
        Some(block)
    }

    /// The serials whose registrations were evicted since the last call: no prefix through
    /// them can be found any more.
    pub fn take_evicted(&mut self) -> Vec<Serial> {
        std::mem::take(&mut self.evicted)
    }

    /// Drop `table`'s hold on its blocks (leaving it empty). The last block is parked first, so
    /// a prefix's tail is evicted before its head.
    pub fn release(&mut self, table: &mut Vec<BlockId>) {
        for block in table.drain(..).rev() {
            let i = block.0 as usize;
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            if self.registrations[i].is_some() {
                self.tick += 1;
                self.parked_at[i] = self.tick;
                self.evictable.insert(self.tick, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Start an empty `table` with the cached blocks of `tokens`' longest registered prefix of
    /// whole blocks, shared; returns their serials (one per block).
    pub fn share_prefix(&mut self, table: &mut Vec<BlockId>, tokens: &[u32]) -> Vec<Serial> {
        debug_assert!(table.is_empty());
        let mut serials = Vec::new();
        for block_tokens in tokens.chunks_exact(self.block_size) {
            let key = PrefixKey {
                parent: serials.last().copied(),
                tokens: block_tokens.to_vec(),
            };
            let Some(&block) = self.registry.get(&key) else { break };
            let i = block.0 as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&self.parked_at[i]);
            }
            self.refs[i] += 1;
            table.push(block);
            serials.push(self.registrations[i].as_ref().expect("found in the registry").serial);
        }
        serials
    }

    /// Register full `block` as holding `tokens` after the prefix registered as `parent`; the
    /// serial the next block's key names. When another block already holds that very prefix,
    /// this one stays unregistered (it is freed, not cached, when released) and the other's
    /// serial is returned: the chain of keys is the same either way.
    pub fn register(&mut self, block: BlockId, parent: Option<Serial>, tokens: &[u32]) -> Serial {
        debug_assert_eq!(tokens.len(), self.block_size);
        let key = PrefixKey {
            parent,
            tokens: tokens.to_vec(),
        };
        if let Some(&twin) = self.registry.get(&key) {
            return self.registrations[twin.0 as usize].as_ref().expect("registered").serial;
        }
        let i = block.0 as usize;
        debug_assert!(self.registrations[i].is_none(), "a block is registered once");
        let serial = Serial(self.next_serial);
        self.next_serial += 1;
        self.registry.insert(key.clone(), block);
        self.registrations[i] = Some(Registration { key, serial });
        serial
    }

    /// Whether a block is registered as `serial` now (its prefix can be found).
    pub fn is_registered(&self, serial: Serial) -> bool {
        self.registrations.iter().flatten().any(|r| r.serial == serial)
    }

    /// Check the invariants against the live tables; the first violation, if any.
    pub fn check<'a>(&self, tables: impl IntoIterator<Item = &'a [BlockId]>) -> Result<(), String> {
        let mut holders = vec![0u32; self.total()];
        for table in tables {
            for b in table {
                *holders.get_mut(b.0 as usize).ok_or(format!("{b:?} is out of range"))? += 1;
            }
        }
        if holders != self.refs {
            let b = (0..self.total())
                .find(|&b| holders[b] != self.refs[b])
                .expect("they differ");
            return Err(format!(
                "block {b} is held by {} tables but counted {}",
                holders[b], self.refs[b]
            ));
        }
        let mut idle = HashSet::new();
        for &b in &self.free {
            if !idle.insert(b) || self.refs[b.0 as usize] > 0 || self.registrations[b.0 as usize].is_some() {
                return Err(format!("free {b:?} is listed twice, held or registered"));
            }
        }
        for (&tick, &b) in &self.evictable {
            let i = b.0 as usize;
            if !idle.insert(b) || self.refs[i] > 0 || self.registrations[i].is_none() || self.parked_at[i] != tick {
                return Err(format!("evictable {b:?} is also free, held, unregistered or misfiled"));
            }
        }
        let held = self.refs.iter().filter(|&&r| r > 0).count();
        if held + idle.len() != self.total() {
            return Err(format!(
                "{held} held + {} idle != {} blocks: a block leaked",
                idle.len(),
                self.total()
            ));
        }
        for (key, &b) in &self.registry {
            if self.registrations[b.0 as usize].as_ref().map(|r| &r.key) != Some(key) {
                return Err(format!(
                    "the registry files {b:?} under a key it is not registered with"
                ));
            }
        }
        let registered = self.registrations.iter().flatten().count();
        if registered != self.registry.len() {
            return Err(format!(
                "{registered} registered blocks, {} registry keys",
                self.registry.len()
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

    #[test]
    fn a_registered_prefix_is_shared_then_cached_then_evicted_oldest_first() {
        let mut m = BlockManager::new(3, 2);
        let mut a = Vec::new();
        m.grow(&mut a, 4).unwrap();
        let first = m.register(a[0], None, &[1, 2]);
        m.register(a[1], Some(first), &[3, 4]);

        // A prompt with the same first block (but not the second) shares exactly one block.
        let mut b = Vec::new();
        let serials = m.share_prefix(&mut b, &[1, 2, 3, 9]);
        assert_eq!((b.as_slice(), serials.as_slice()), (&a[..1], &[first][..]));
        assert_eq!(m.holders(a[0]), 2);
        m.check([a.as_slice(), b.as_slice()]).unwrap();

        // Released by everyone, both blocks stay cached (not used, still found).
        let kept = a.clone();
        m.release(&mut a);
        m.release(&mut b);
        assert_eq!((m.used_blocks(), m.cached_blocks()), (0, 2));
        let mut c = Vec::new();
        m.share_prefix(&mut c, &[1, 2, 3, 4]);
        assert_eq!(c, kept);
        m.release(&mut c);

        // Needing all three blocks takes the free one, then evicts the tail (parked first).
        let mut d = Vec::new();
        m.grow(&mut d, 4).unwrap();
        assert_eq!(d[1], kept[1]);
        assert_eq!(m.cached_blocks(), 1);
        m.check([d.as_slice()]).unwrap();
        let mut e = Vec::new();
        assert_eq!(
            m.share_prefix(&mut e, &[1, 2, 3, 4]).len(),
            1,
            "only the head is still cached"
        );
        m.release(&mut e);
        m.release(&mut d);
        m.check([]).unwrap();
    }

    #[test]
    fn a_twin_block_is_not_registered_and_keys_chain_through_the_first() {
        let mut m = BlockManager::new(4, 2);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        m.grow(&mut a, 2).unwrap();
        m.grow(&mut b, 2).unwrap();
        let s = m.register(a[0], None, &[5, 6]);
        assert_eq!(m.register(b[0], None, &[5, 6]), s);
        m.release(&mut b);
        assert_eq!(m.cached_blocks(), 0, "the twin is freed, not cached");
        m.release(&mut a);
        assert_eq!(m.cached_blocks(), 1);
        m.check([]).unwrap();
    }
}
