//! How the GEMVs of a plan are shaped: weight rows a warp carries, and the L2 prefetch
//! distance. Each has a rule and an environment knob that overrides it, so one `bbc` binary
//! can compare settings on a GPU without a rebuild (`docs/gpu-check.md`).

use kernels_gen::dsl::Ty;
use kernels_gen::templates::gemv::{self, GemvSpec, MAX_ROWS_PER_WARP};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::BLOCK;

/// `spec` with the weight rows a warp carries (the rule of [`rows_per_warp`], or
/// `BBC_GEMV_ROWS_PER_WARP`) over `cols` product columns on a GPU of `sms` multiprocessors.
pub(super) fn shaped(spec: GemvSpec, cols: usize, sms: usize) -> GemvSpec {
    let rows = rows_from(std::env::var("BBC_GEMV_ROWS_PER_WARP").ok().as_deref())
        .unwrap_or_else(|| rows_per_warp(&spec, cols, sms));
    spec.with_rows_per_warp(rows)
}

/// Weight rows a warp carries, so that each activation load serves about as many weight bytes
/// as it reads: a warp reads `tokens_per_pass` activation rows in f32 (twice over under a
/// residual prologue, `x + b`) for each of its weight rows (a gate and an up row under a GLU
/// epilogue). One row a warp, the 8B's QKV projection read four bytes from L2 per weight byte
/// and ran at 40% of copy bandwidth on the H200; the o projection, two bytes, at 91%; four
/// tokens a pass, eight bytes, at 33–44%. Bounded by the accumulators (rows × tokens × the
/// GLU's two sums at most [`ACCUMULATORS`]), and by the GPU: blocks of warps for nearly every
/// multiprocessor ([`OCCUPIED`]), or the rows sharing loads leave multiprocessors idle
/// (SmolLM2's 576-row projections keep one row a warp).
///
/// On the third H200 run the four-token GEMVs ran fastest at four rows a warp for every 8B
/// shape, where this rule then gave two (16 accumulators at most, a block for every
/// multiprocessor): the o projection 13.5 → 10.3 µs (128 blocks for 132 multiprocessors), the
/// down 67.8 → 45.6, the gate/up with its GLU (32 accumulators, no spills) 130 → 109.
pub(super) fn rows_per_warp(spec: &GemvSpec, cols: usize, sms: usize) -> usize {
    let weight_bytes = match spec.weight {
        WeightFormat::Dense(Ty::F32) => 4,
        WeightFormat::Dense(_) => 2,
        // Decoded a block a lane: one row a warp (`with_rows_per_warp` keeps it so).
        WeightFormat::Blocks(_) => return 1,
    };
    let sums = match spec.glu {
        Some(_) => 2,
        None => 1,
    };
    let activation_bytes = spec.tokens_per_pass * 4 * if gemv::residual(spec.norm) { 2 } else { 1 };
    let balanced = activation_bytes / (weight_bytes * sums);
    let registers = ACCUMULATORS / (spec.tokens_per_pass * sums);
    let warps_per_block = (BLOCK / 32) as usize;
    let occupied = cols * OCCUPIED.1 / (warps_per_block * sms.max(1) * OCCUPIED.0);
    let most = balanced.min(registers).min(occupied).clamp(1, MAX_ROWS_PER_WARP);
    // A power of two: 3 rows would leave a 4096-row matrix's last warp a clamped copy.
    1 << most.ilog2()
}

/// The most accumulators a GEMV lane holds: what ptxas keeps without spilling on every target
/// (the catalog's 4-token, 4-row GLU GEMV is compiled for each).
const ACCUMULATORS: usize = 32;

/// The fewest blocks a GEMV leaves, as a fraction of the multiprocessors: 15/16.
const OCCUPIED: (usize, usize) = (15, 16);

/// The rows a `BBC_GEMV_ROWS_PER_WARP` value asks for: 1 to [`MAX_ROWS_PER_WARP`], else (unset,
/// not a number, out of range) none, and the rule decides.
fn rows_from(value: Option<&str>) -> Option<usize> {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|rows| (1..=MAX_ROWS_PER_WARP).contains(rows))
}

/// Steps ahead the decode GEMVs with a norm prologue prefetch their weights into L2: the
/// `BBC_GEMV_PREFETCH_STEPS` environment variable (1 to 16), else none. Off unless asked: on
/// the second H200 run it made the fused QKV and gate/up GEMVs 10–16% slower.
pub(super) fn prefetch_steps() -> usize {
    prefetch_steps_from(std::env::var("BBC_GEMV_PREFETCH_STEPS").ok().as_deref())
}

/// The prefetch distance a `BBC_GEMV_PREFETCH_STEPS` value asks for: 0 to 16, else (unset,
/// not a number, too far) 0.
fn prefetch_steps_from(value: Option<&str>) -> usize {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&steps| steps <= 16)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels_gen::templates::gemv::NormPrologue;

    const H200_SMS: usize = 132;

    fn bf16(k: usize) -> GemvSpec {
        GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), k).with_x_vectors()
    }

    /// The Llama-8B shapes on an H200: the decode GEMVs share activation loads between as many
    /// rows as balance the bytes, the four-token ones as the accumulators allow.
    #[test]
    fn the_8b_projections_share_activation_loads() {
        let residual = NormPrologue::new(1e-5, 0.0).with_residual();
        let qkv = bf16(4096).with_norm(residual);
        let gate_up = qkv.with_glu(ir::GluAct::Silu);
        let lm_head = bf16(4096).with_norm(NormPrologue::new(1e-5, 0.0));
        for (what, spec, cols, rows) in [
            ("qkv", qkv, 6144, 4),
            ("gate/up", gate_up, 14336, 2),
            ("o", bf16(4096), 4096, 2),
            ("down", bf16(14336), 4096, 2),
            ("lm head", lm_head, 128256, 2),
            ("qkv, 4 tokens", qkv.prefill(), 6144, 4),
            ("gate/up, 4 tokens", gate_up.prefill(), 14336, 4),
            ("o, 4 tokens", bf16(4096).prefill(), 4096, 4),
            ("down, 4 tokens", bf16(14336).prefill(), 4096, 4),
            ("lm head, 4 tokens", lm_head.prefill(), 128256, 4),
        ] {
            assert_eq!(rows_per_warp(&spec, cols, H200_SMS), rows, "{what}");
        }
    }

    /// Rows too few to give every multiprocessor a block keep one row a warp; f32 weights read
    /// as many bytes as their activations and keep one; block formats always do.
    #[test]
    fn small_matrices_f32_and_blocks_keep_one_row_a_warp() {
        assert_eq!(rows_per_warp(&bf16(576), 576, H200_SMS), 1);
        assert_eq!(rows_per_warp(&bf16(576), 1536, H200_SMS), 1);
        let f32 = GemvSpec::decode(WeightFormat::Dense(Ty::F32), 4096).with_x_vectors();
        assert_eq!(rows_per_warp(&f32, 4096, H200_SMS), 1);
        let q4_k = GemvSpec::decode(WeightFormat::Blocks(ir::DType::Q4K), 4096).with_x_vectors();
        assert_eq!(rows_per_warp(&q4_k.prefill(), 1 << 16, H200_SMS), 1);
        for cols in [1, 100, 5000, 1 << 20] {
            for spec in [bf16(64), bf16(64).prefill(), f32, f32.prefill()] {
                let rows = rows_per_warp(&spec, cols, H200_SMS);
                assert!(rows.is_power_of_two() && rows <= MAX_ROWS_PER_WARP, "{cols}: {rows}");
            }
        }
    }

    /// The knobs take what their ranges allow; anything else leaves the rule.
    #[test]
    fn the_knobs_take_their_ranges_only() {
        for (value, rows) in [
            (None, None),
            (Some("1"), Some(1)),
            (Some(" 4 "), Some(4)),
            (Some("0"), None),
            (Some("5"), None),
            (Some("two"), None),
        ] {
            assert_eq!(rows_from(value), rows, "{value:?}");
        }
        for (value, steps) in [
            (None, 0),
            (Some("0"), 0),
            (Some(" 2 "), 2),
            (Some("16"), 16),
            (Some("17"), 0),
            (Some("-1"), 0),
            (Some("off"), 0),
        ] {
            assert_eq!(prefetch_steps_from(value), steps, "{value:?}");
        }
    }
}
