//! `setmaxnreg` on the emulator: the registers a thread each warpgroup holds, out of the
//! block's own. A kernel that moves registers is built for one block a multiprocessor, so each
//! thread starts with what the most crowded of the multiprocessor's four quarters leaves it
//! ([`registers_at_launch`]); a release adds to the block's pool, a claim takes from it, and a
//! claim the pool cannot meet waits, as on the device, until another warpgroup releases
//! enough. One that nothing can meet is a block that never finishes: reported.

use super::asynchronous::WARPGROUP;
use super::Fault;
use crate::dsl::RegisterChange;

/// Registers in each quarter of a multiprocessor (a quarter's warps share them).
const QUARTER_REGISTERS: usize = 16_384;
/// The most registers a thread may hold.
const THREAD_MAX: usize = 255;

/// The registers a thread of a block of `threads` holds at launch where the block is the
/// multiprocessor's only one: its warps spread over the four quarters, what the fullest
/// quarter leaves each of its threads, in units of 8 (168 for 9 to 12 warps).
pub(super) fn registers_at_launch(threads: usize) -> usize {
    let warps_a_quarter = threads.div_ceil(32).div_ceil(4).max(1);
    (QUARTER_REGISTERS / (32 * warps_a_quarter)).min(THREAD_MAX) / 8 * 8
}

/// The block's registers: what a thread of each warpgroup holds.
pub(super) struct RegisterFile {
    at_launch: usize,
    threads: usize,
    held: Vec<usize>,
}

impl RegisterFile {
    pub(super) fn new(threads: usize) -> Self {
        let at_launch = registers_at_launch(threads);
        Self {
            at_launch,
            threads,
            held: vec![at_launch; threads.div_ceil(WARPGROUP)],
        }
    }

    /// Registers the block holds but no warpgroup does.
    fn pool(&self) -> usize {
        let held: usize = self.held.iter().enumerate().map(|(wg, &r)| r * self.members(wg)).sum();
        self.at_launch * self.threads - held
    }

    /// Threads of warpgroup `wg` in the block.
    fn members(&self, wg: usize) -> usize {
        self.threads.min((wg + 1) * WARPGROUP) - wg * WARPGROUP
    }

    /// The warpgroups of `mask`'s threads, each checked whole: every thread of a warpgroup
    /// executes `setmaxnreg` together.
    pub(super) fn warpgroups(&self, mask: &[bool]) -> Result<Vec<usize>, Fault> {
        let mut out = Vec::new();
        for wg in 0..self.held.len() {
            let threads = wg * WARPGROUP..(wg + 1) * WARPGROUP;
            let active = threads.clone().filter(|&t| mask.get(t) == Some(&true)).count();
            if active == 0 {
                continue;
            }
            if active < WARPGROUP {
                let t = threads
                    .clone()
                    .find(|&t| mask.get(t) != Some(&true))
                    .unwrap_or(threads.start);
                let absent = match t < self.threads {
                    true => "does not execute it",
                    false => "is not in the block (it has too few threads)",
                };
                let first = threads.clone().find(|&t| mask[t]).unwrap_or(threads.start);
                return Err((
                    first,
                    format!(
                        "setmaxnreg by part of warpgroup {wg}: thread {t} {absent}; every thread of a \
                         warpgroup executes it together"
                    ),
                ));
            }
            out.push(wg);
        }
        Ok(out)
    }

    /// Whether warpgroup `wg` may move to `count` registers now (a claim the pool can meet,
    /// or any release); a move the other way is a fault.
    pub(super) fn can_set(&self, wg: usize, change: RegisterChange, count: usize) -> Result<bool, Fault> {
        let held = self.held[wg];
        let t = wg * WARPGROUP;
        match change {
            RegisterChange::Release if count > held => Err((
                t,
                format!("setmaxnreg.dec to {count} registers, more than the {held} warpgroup {wg} holds"),
            )),
            RegisterChange::Claim if count < held => Err((
                t,
                format!("setmaxnreg.inc to {count} registers, fewer than the {held} warpgroup {wg} holds"),
            )),
            RegisterChange::Release => Ok(true),
            RegisterChange::Claim => Ok((count - held) * self.members(wg) <= self.pool()),
        }
    }

    /// Warpgroup `wg` moved to `count` registers (checked with [`Self::can_set`]).
    pub(super) fn set(&mut self, wg: usize, count: usize) {
        self.held[wg] = count;
    }

    /// Why warpgroup `wg`'s claim of `count` waits: what it asks and what the pool holds.
    pub(super) fn shortfall(&self, wg: usize, count: usize) -> Fault {
        let asked = (count - self.held[wg]) * self.members(wg);
        (
            wg * WARPGROUP,
            format!(
                "setmaxnreg.inc to {count} waits for {asked} registers, and the block's pool holds {} \
                 ({} a thread at launch for {} threads): a claim no warpgroup's release can meet",
                self.pool(),
                self.at_launch,
                self.threads
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_starts_with_what_the_fullest_quarter_leaves() {
        assert_eq!(registers_at_launch(128), 248);
        assert_eq!(registers_at_launch(256), 248);
        assert_eq!(registers_at_launch(288), 168);
        assert_eq!(registers_at_launch(384), 168);
        assert_eq!(registers_at_launch(512), 128);
    }

    #[test]
    fn a_claim_waits_for_a_release() {
        let mut file = RegisterFile::new(384);
        assert_eq!(file.can_set(1, RegisterChange::Claim, 240), Ok(false));
        assert_eq!(file.can_set(0, RegisterChange::Release, 24), Ok(true));
        file.set(0, 24);
        assert_eq!(file.can_set(1, RegisterChange::Claim, 240), Ok(true));
        file.set(1, 240);
        assert_eq!(file.can_set(2, RegisterChange::Claim, 240), Ok(true));
        file.set(2, 240);
        assert_eq!(file.pool(), 0);
        assert!(file.can_set(2, RegisterChange::Release, 248).is_err());
        assert!(file.can_set(2, RegisterChange::Claim, 232).is_err());
    }
}
