//! Which recurrent-state snapshots the prefix cache keeps, for models with recurrent layers
//! (Gated DeltaNet). A cached block holds keys and values, but a recurrent state sums up the
//! whole prefix before it, so a sequence can start from cached blocks only where a copy of the
//! state after them was kept. Snapshots are taken every `interval` positions (a multiple of
//! the block size) as sequences compute past them, and kept in `capacity` numbered places
//! (the backend holds the states; this decides which place holds what).
//!
//! A snapshot is filed under the registration serial of the last block it covers
//! ([`Serial`]s are never reused, so the serial names the exact prefix). A place is in one of
//! three conditions: free; *pending* (handed to a step that will write it, filed when the step
//! completes); or filed. When no place is free, the least recently useful filed one is taken
//! back: a snapshot is refreshed when a sequence starts from it, and one that its sequence has
//! since passed (it saved a later one) is *demoted*, taken before any other, since a request
//! must then share exactly the shorter prefix to want it. Places a step restores from are
//! pinned for that step, so no save of the same step overwrites them.
//!
//! A filed snapshot whose last block is evicted can no longer be reached (the chain of keys
//! through its serial is gone): its place is freed ([`StateCache::forget`]).

use super::block_manager::Serial;
use std::collections::{BTreeMap, HashMap};

/// The snapshots the prefix cache may keep, and how often a sequence saves one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateCacheConfig {
    /// Snapshots kept at most (0: a model with recurrent state runs without the prefix cache).
    pub capacity: usize,
    /// Positions between a sequence's snapshots: it saves one whenever it has computed a
    /// multiple of this many (rounded up to whole blocks).
    pub interval: usize,
    /// Whether a state can be saved only where a sequence's work ends (a GPU plan's kernels
    /// leave it only after a sequence's last row of a step): the scheduler then ends prompt
    /// chunks at multiples of the interval. The engine sets it from its backend.
    pub at_segment_ends: bool,
}

impl StateCacheConfig {
    pub const OFF: StateCacheConfig = StateCacheConfig {
        capacity: 0,
        interval: 1,
        at_segment_ends: false,
    };

    /// `capacity` snapshots, one every `interval` positions, saved after any row.
    pub fn every(interval: usize, capacity: usize) -> Self {
        Self {
            capacity,
            interval,
            at_segment_ends: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct StateCache {
    interval: usize,
    capacity: usize,
    free: Vec<usize>,
    /// Filed snapshots: their place and their key in `order`.
    filed: HashMap<Serial, (usize, i64)>,
    /// Filed snapshots by usefulness, least first: refreshed ones get rising keys, demoted ones
    /// falling negative keys (the last demoted taken first).
    order: BTreeMap<i64, Serial>,
    refreshed: i64,
    demoted: i64,
    /// Places restored from in the step being scheduled.
    pinned: Vec<usize>,
}

impl StateCache {
    /// A cache of `config.capacity` places saving every `config.interval` positions, rounded
    /// up to a multiple of `block_size` (a snapshot covers whole blocks).
    pub fn new(config: StateCacheConfig, block_size: usize) -> Self {
        Self {
            interval: config.interval.div_ceil(block_size).max(1) * block_size,
            capacity: config.capacity,
            // Popped from the back: low places first.
            free: (0..config.capacity).rev().collect(),
            filed: HashMap::new(),
            order: BTreeMap::new(),
            refreshed: 0,
            demoted: 0,
            pinned: Vec::new(),
        }
    }

    pub fn is_on(&self) -> bool {
        self.capacity > 0
    }

    /// Positions between a sequence's snapshots (a multiple of the block size).
    pub fn interval(&self) -> usize {
        self.interval
    }

    /// Snapshots filed now.
    pub fn filed(&self) -> usize {
        self.filed.len()
    }

    /// The prefixes that have a snapshot filed.
    pub fn filed_serials(&self) -> impl Iterator<Item = Serial> + '_ {
        self.filed.keys().copied()
    }

    /// A new step is being scheduled: last step's pins are let go.
    pub fn begin_step(&mut self) {
        self.pinned.clear();
    }

    /// The deepest snapshot along `chain` (a prefix's serials, one per block): how many of
    /// its blocks it covers, and its place.
    pub fn deepest(&self, chain: &[Serial]) -> Option<(usize, usize)> {
        (1..=chain.len())
            .rev()
            .find_map(|blocks| self.filed.get(&chain[blocks - 1]).map(|&(place, _)| (blocks, place)))
    }

    /// A sequence starts from the snapshot filed under `serial` this step: refreshed, and
    /// pinned until the next step is scheduled.
    pub fn restore(&mut self, serial: Serial) {
        let (place, _) = self.filed[&serial];
        self.refreshed += 1;
        self.file_at(serial, place, self.refreshed);
        self.pinned.push(place);
    }

    /// A place for a step to save a snapshot into (pending until [`file`](Self::file) or
    /// [`discard`](Self::discard)): a free one, else the least useful filed one not pinned;
    /// `None` when every place is pending or pinned.
    pub fn take(&mut self) -> Option<usize> {
        if let Some(place) = self.free.pop() {
            return Some(place);
        }
        let serial = *self
            .order
            .values()
            .find(|serial| !self.pinned.contains(&self.filed[serial].0))?;
        self.unfile(serial)
    }

    /// A step wrote the state after the block registered as `serial` into pending `place`:
    /// file it (refreshed), unless that prefix already has a snapshot (then the place is
    /// free again). `passed`, the sequence's previous snapshot, is demoted.
    pub fn file(&mut self, serial: Serial, place: usize, passed: Option<Serial>) {
        if let Some((passed, &(passed_place, _))) = passed.and_then(|p| self.filed.get(&p).map(|filed| (p, filed))) {
            self.demoted -= 1;
            self.file_at(passed, passed_place, self.demoted);
        }
        if self.filed.contains_key(&serial) {
            self.free.push(place);
            return;
        }
        self.refreshed += 1;
        self.file_at(serial, place, self.refreshed);
    }

    /// File `serial`'s snapshot in `place` under usefulness `key`, in place of the key it had.
    fn file_at(&mut self, serial: Serial, place: usize, key: i64) {
        if let Some((_, old)) = self.filed.insert(serial, (place, key)) {
            self.order.remove(&old);
        }
        self.order.insert(key, serial);
    }

    /// The block registered as `serial` was evicted: its snapshot, if any, can no longer be
    /// reached, and its place is free.
    pub fn forget(&mut self, serial: Serial) {
        if let Some(place) = self.unfile(serial) {
            self.free.push(place);
        }
    }

    /// `serial`'s snapshot no longer filed: the place it was in.
    fn unfile(&mut self, serial: Serial) -> Option<usize> {
        let (place, key) = self.filed.remove(&serial)?;
        self.order.remove(&key);
        Some(place)
    }

    /// A pending place whose step's result was dropped: free again.
    pub fn discard(&mut self, place: usize) {
        self.free.push(place);
    }

    /// Every place is exactly one of free, filed, or among `pending`; the order lists exactly
    /// the filed snapshots.
    pub fn check(&self, pending: impl IntoIterator<Item = usize>) -> Result<(), String> {
        let mut places: Vec<usize> = self.free.iter().copied().chain(pending).collect();
        places.extend(self.filed.values().map(|&(place, _)| place));
        places.sort_unstable();
        if places != (0..self.capacity).collect::<Vec<_>>() {
            return Err(format!("snapshot places free, pending or filed: {places:?}"));
        }
        let ordered = self
            .order
            .iter()
            .all(|(key, serial)| self.filed.get(serial).map(|f| f.1) == Some(*key));
        if !ordered || self.order.len() != self.filed.len() {
            return Err("the snapshots' order does not list exactly the filed ones".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(capacity: usize) -> StateCache {
        StateCache::new(StateCacheConfig::every(5, capacity), 4)
    }

    #[test]
    fn the_interval_covers_whole_blocks() {
        assert_eq!(cache(1).interval(), 8);
        assert_eq!(StateCache::new(StateCacheConfig::every(0, 1), 4).interval(), 4);
    }

    /// The deepest snapshot along a chain is found; a prefix saved twice keeps one place.
    #[test]
    fn finds_the_deepest_snapshot_and_files_a_prefix_once() {
        let mut c = cache(3);
        let chain = [Serial::new(10), Serial::new(11), Serial::new(12)];
        assert_eq!(c.deepest(&chain), None);
        let a = c.take().unwrap();
        c.file(chain[0], a, None);
        let b = c.take().unwrap();
        c.file(chain[1], b, Some(chain[0]));
        assert_eq!(c.deepest(&chain), Some((2, b)));
        assert_eq!(c.deepest(&chain[..1]), Some((1, a)));
        let twin = c.take().unwrap();
        c.file(chain[1], twin, None);
        assert_eq!(c.deepest(&chain), Some((2, b)), "the first one stays");
        assert_eq!(c.check([]), Ok(()));
        assert_eq!(c.filed(), 2);
        // Its block evicted, the deeper one is gone and its place free.
        c.forget(chain[1]);
        c.forget(chain[2]);
        assert_eq!(c.deepest(&chain), Some((1, a)));
        assert_eq!(c.check([]), Ok(()));
        assert_eq!(c.take(), Some(b));
    }

    /// With no place free, the demoted snapshot goes first, then the least recently used;
    /// a snapshot restored this step is not taken, and neither are pending places.
    #[test]
    fn takes_back_demoted_then_least_recent_never_pinned() {
        let mut c = cache(3);
        let s: Vec<Serial> = (0..4).map(Serial::new).collect();
        let places: Vec<usize> = (0..3).map(|_| c.take().unwrap()).collect();
        c.file(s[0], places[0], None);
        c.file(s[1], places[1], None);
        // Sequence of s[2] passed s[0].
        c.file(s[2], places[2], Some(s[0]));
        assert_eq!(c.take(), Some(places[0]), "demoted first");
        assert_eq!(c.deepest(&s[..1]), None);
        c.discard(places[0]);
        assert_eq!(c.take(), Some(places[0]), "free before filed");
        c.file(s[3], places[0], None);
        // s[1] is now the least recent; restoring it refreshes and pins it.
        c.restore(s[1]);
        assert_eq!(c.take(), Some(places[2]), "s[2], not the pinned s[1]");
        assert_eq!(c.take(), Some(places[0]));
        assert_eq!(c.take(), None, "s[1] is pinned, the rest pending");
        c.begin_step();
        assert_eq!(c.take(), Some(places[1]));
        assert_eq!(c.check(places.iter().copied()), Ok(()));
        assert!(c.check([]).is_err(), "pending places must be accounted for");
    }
}
