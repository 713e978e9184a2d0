//! FP8 E4M3 (the OCP format NVIDIA calls `e4m3fn`, vLLM's `--kv-cache-dtype fp8`): a sign,
//! four exponent bits (bias 7) and three mantissa bits; subnormals, no infinities, and
//! `S.1111.111` the only NaN. The largest finite value is 448.
//!
//! Narrowing rounds to nearest, ties to even, and saturates finite values past 448 to ±448
//! (as vLLM's cache kernels convert, `__NV_SATFINITE`), so a large value is kept as large as
//! the format holds rather than turned into NaN.

/// An FP8 E4M3 value, its bits as stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

impl F8E4M3 {
    /// The largest finite value, 1.75 · 2⁸.
    pub const MAX: f32 = 448.0;
    const NAN_BITS: u8 = 0x7F;
    const MAX_BITS: u8 = 0x7E;

    /// `x` rounded to nearest even, saturated to ±[`MAX`](Self::MAX); NaN stays NaN.
    pub fn from_f32(x: f32) -> Self {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        let a = x.abs();
        let magnitude = if x.is_nan() {
            Self::NAN_BITS
        } else if a >= Self::MAX {
            Self::MAX_BITS
        } else if a < 2f32.powi(-6) {
            // Subnormal: a multiple of 2⁻⁹, its count the code (8 is the least normal, 2⁻⁶).
            (a * 512.0).round_ties_even() as u8
        } else {
            let bits = a.to_bits();
            let exponent = (bits >> 23) as i32 - 127 + 7;
            let (kept, dropped) = ((bits >> 20) & 0x7, bits & 0xF_FFFF);
            let half = 0x8_0000;
            let up = dropped > half || (dropped == half && kept & 1 == 1);
            // A mantissa carried out of its three bits moves into the exponent, as it should.
            let code = ((exponent as u32) << 3) + kept + u32::from(up);
            code.min(u32::from(Self::MAX_BITS)) as u8
        };
        F8E4M3(sign | magnitude)
    }

    /// The value, exactly.
    pub fn to_f32(self) -> f32 {
        let (exponent, mantissa) = (i32::from(self.0 >> 3) & 0xF, f32::from(self.0 & 0x7));
        let magnitude = match (exponent, self.0 & 0x7F) {
            (_, Self::NAN_BITS) => f32::NAN,
            (0, _) => mantissa * 2f32.powi(-9),
            _ => (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7),
        };
        match self.0 & 0x80 {
            0 => magnitude,
            _ => -magnitude,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code widens to its value and narrows back to itself (NaN to NaN).
    #[test]
    fn every_code_round_trips() {
        for code in 0..=255u8 {
            let x = F8E4M3(code).to_f32();
            match code & 0x7F {
                0x7F => assert!(x.is_nan()),
                _ => assert_eq!(F8E4M3::from_f32(x), F8E4M3(code), "{code:#04x} = {x}"),
            }
        }
        assert_eq!(F8E4M3(0x7E).to_f32(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f32(), 2f32.powi(-9));
        assert_eq!(F8E4M3(0x08).to_f32(), 2f32.powi(-6));
        assert_eq!(F8E4M3(0xB8).to_f32(), -1.0);
    }

    /// Narrowing picks the nearest code, the even one at a tie, for values across the range
    /// (checked against a search over every finite code).
    #[test]
    fn narrowing_rounds_to_nearest_even() {
        let finite: Vec<(u8, f32)> = (0..0x7Fu8).map(|c| (c, F8E4M3(c).to_f32())).collect();
        let nearest = |a: f32| -> u8 {
            let mut best = finite[0];
            for &(c, v) in &finite[1..] {
                let (d, best_d) = ((v - a).abs(), (best.1 - a).abs());
                if d < best_d || (d == best_d && c % 2 == 0) {
                    best = (c, v);
                }
            }
            best.0
        };
        let mut x = 1e-4f32;
        while x < 448.0 {
            for a in [x, x * 1.0001, (x + x * 1.0625) / 2.0] {
                assert_eq!(F8E4M3::from_f32(a).0, nearest(a), "{a}");
                assert_eq!(F8E4M3::from_f32(-a).0, 0x80 | nearest(a), "-{a}");
            }
            x *= 1.013;
        }
        // Ties: halfway between 1 and 1.125, and between 1.125 and 1.25; between subnormals.
        assert_eq!(F8E4M3::from_f32(1.0625).to_f32(), 1.0);
        assert_eq!(F8E4M3::from_f32(1.1875).to_f32(), 1.25);
        assert_eq!(F8E4M3::from_f32(1.5 * 2f32.powi(-9)).to_f32(), 2.0 * 2f32.powi(-9));
    }

    #[test]
    fn past_the_range_saturates_and_nan_stays_nan() {
        for (x, want) in [(448.0, 448.0), (460.0, 448.0), (1e30, 448.0), (f32::INFINITY, 448.0)] {
            assert_eq!(F8E4M3::from_f32(x).to_f32(), want);
            assert_eq!(F8E4M3::from_f32(-x).to_f32(), -want);
        }
        assert!(F8E4M3::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(F8E4M3::from_f32(1e-30).to_f32(), 0.0);
        assert_eq!(F8E4M3::from_f32(-0.0).0, 0x80);
    }
}
