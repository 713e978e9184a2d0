//! Shared-memory bank conflicts, counted where a kernel runs profiled ([`super::run_profiled`]).
//!
//! Shared memory is 32 banks of 4-byte words. A warp's access is served in wavefronts: lanes
//! reading the same word share one, lanes reading different words of one bank take one each.
//! Accesses of 8 and 16 bytes a lane go in phases of 16 and 8 lanes (a phase moves at most
//! 128 bytes). A conflict is silent on the device, a kernel just runs slower; here it is a
//! count: an access's wavefronts against the phases it needs at best.

use std::collections::BTreeMap;

/// Banks of shared memory.
const BANKS: usize = 32;

/// A shared array's traffic over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArrayTraffic {
    /// Warp-wide loads and stores (a 16-byte vector load one).
    pub accesses: u64,
    /// The wavefronts they took.
    pub wavefronts: u64,
    /// The wavefronts they would take without conflicts: one a phase.
    pub phases: u64,
    /// The most wavefronts one phase took (1: no conflict ever).
    pub worst: u32,
}

impl ArrayTraffic {
    /// Wavefronts over the conflict-free count: 1.0 where no access conflicts.
    pub fn conflict_factor(&self) -> f64 {
        match self.phases {
            0 => 1.0,
            p => self.wavefronts as f64 / p as f64,
        }
    }
}

/// Each shared array's traffic over a run, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedTraffic(pub BTreeMap<String, ArrayTraffic>);

impl SharedTraffic {
    /// One warp's access of `bytes` a lane to `array`, lane l at byte `addresses[l]` (None:
    /// inactive).
    pub(super) fn record(&mut self, array: &str, bytes: usize, addresses: &[Option<usize>]) {
        let lanes_a_phase = match bytes {
            16 => 8,
            8 => 16,
            _ => 32,
        };
        let mut traffic = ArrayTraffic::default();
        for phase in addresses.chunks(lanes_a_phase) {
            let wavefronts = phase_wavefronts(bytes, phase);
            if wavefronts > 0 {
                traffic.wavefronts += wavefronts as u64;
                traffic.phases += 1;
                traffic.worst = traffic.worst.max(wavefronts);
            }
        }
        if traffic.phases == 0 {
            return;
        }
        let total = self.0.entry(array.to_string()).or_default();
        total.accesses += 1;
        total.wavefronts += traffic.wavefronts;
        total.phases += traffic.phases;
        total.worst = total.worst.max(traffic.worst);
    }

    /// Adds `other`'s counts (another block's).
    pub(super) fn add(&mut self, other: &SharedTraffic) {
        for (array, t) in &other.0 {
            let total = self.0.entry(array.clone()).or_default();
            total.accesses += t.accesses;
            total.wavefronts += t.wavefronts;
            total.phases += t.phases;
            total.worst = total.worst.max(t.worst);
        }
    }
}

/// The wavefronts one phase takes: the most distinct words any bank is asked for.
fn phase_wavefronts(bytes: usize, lanes: &[Option<usize>]) -> u32 {
    let mut words: [Vec<usize>; BANKS] = Default::default();
    for &address in lanes.iter().flatten() {
        for word in address / 4..(address + bytes.max(1)).div_ceil(4) {
            let bank = &mut words[word % BANKS];
            if !bank.contains(&word) {
                bank.push(word);
            }
        }
    }
    words.iter().map(|w| w.len() as u32).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_access(bytes: usize, addresses: impl Fn(usize) -> usize) -> ArrayTraffic {
        let mut traffic = SharedTraffic::default();
        let lanes: Vec<Option<usize>> = (0..32).map(|l| Some(addresses(l))).collect();
        traffic.record("a", bytes, &lanes);
        traffic.0["a"]
    }

    #[test]
    fn wavefronts_count_distinct_words_a_bank() {
        // Consecutive words, one word for all (a broadcast), two lanes a word: one wavefront.
        for addresses in [|l: usize| 4 * l, |_| 64, |l: usize| 2 * l] {
            assert_eq!(one_access(4, addresses).worst, 1);
        }
        // A column of a 32-word-wide array: every lane in bank 0, 32 words.
        assert_eq!(one_access(4, |l| 128 * l).worst, 32);
        // Rows 256 bytes apart, 4 lanes a row on consecutive words: 8-way.
        assert_eq!(one_access(2, |l| 256 * (l / 4) + 4 * (l % 4)).worst, 8);
        // 16 bytes more a row spreads them: conflict-free.
        assert_eq!(one_access(2, |l| 272 * (l / 4) + 4 * (l % 4)).worst, 1);
    }

    #[test]
    fn wide_accesses_go_in_phases() {
        // 16 bytes a lane, consecutive: 4 phases of 128 bytes, one wavefront each.
        let t = one_access(16, |l| 16 * l);
        assert_eq!((t.wavefronts, t.phases, t.worst), (4, 4, 1));
        // 16 bytes a lane, 256 bytes apart: each phase's 8 lanes on the same 4 banks.
        let t = one_access(16, |l| 256 * l);
        assert_eq!((t.phases, t.worst), (4, 8));
        assert_eq!(t.conflict_factor(), 8.0);
        // Inactive lanes take nothing.
        let mut traffic = SharedTraffic::default();
        traffic.record("a", 4, &[None; 32]);
        assert!(traffic.0.is_empty());
    }
}
