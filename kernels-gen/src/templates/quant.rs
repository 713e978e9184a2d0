//! GGUF block formats on the GPU: statements that dequantize element `e` of a row from the raw
//! block bytes (`u8` buffer `w`, row starting at byte `row`), after ggml's `ggml-quants.c`
//! layouts (the same as the `quant` crate's, which the tests compare against). The quantized GEMV
//! and embedding gather are built on them.
//!
//! Element-wise dequantization (`dequant`) reads each block's scales once per element: correct
//! for every format and shape (the embedding gather uses it). The GEMV, the tensor-core GEMMs'
//! tile staging and the conversions decode up to 32 elements per lane instead (`run_weights`,
//! any part of a run): a whole block of the 32-element formats
//! (`block_weights`: its scale, and min or high bits, read once, each nibble byte giving two
//! elements; IQ4_NL's nibbles through the IQ4 table, `UnOp::Iq4Value`), or one 32-element
//! sub-block of a 256-element super-block (`k_sub_block_weights`: its scales and mins decoded
//! once — Q4_K/Q5_K's 6-bit pair, the two 16-weight groups' of Q2_K, Q3_K and Q6_K, IQ4_XS's
//! run scale), or one run of 32 of a block of 128 4-bit levels (its scale and offset).

use crate::dsl::*;
use ir::DType;
use std::ops::Range;

/// (elements, bytes) of a block.
pub fn block_layout(format: DType) -> Option<(i64, i64)> {
    Some(match format {
        DType::Q4_0 => (32, 18),
        DType::Q4_1 => (32, 20),
        DType::Q5_0 => (32, 22),
        DType::Q5_1 => (32, 24),
        DType::Q8_0 => (32, 34),
        DType::IQ4NL => (32, 18),
        DType::Q4K => (256, 144),
        DType::Q5K => (256, 176),
        DType::Q6K => (256, 210),
        DType::Q2K => (256, 84),
        DType::Q3K => (256, 110),
        DType::IQ4XS => (256, 136),
        DType::MXFP4 => (32, 17),
        DType::F8E4M3B32 => (32, 36),
        DType::U4B32 => (32, 24),
        DType::U4B128 => (128, 72),
        DType::F4E2M1B32 => (32, 24),
        _ => return None,
    })
}

fn byte(i: Expr) -> Expr {
    load("w", i)
}
fn s8(i: Expr) -> Expr {
    let b = byte(i);
    select(bin(BinOp::Ge, b.clone(), int(128)), b.clone() - int(256), b)
}
fn half(i: Expr) -> Expr {
    un(
        UnOp::HalfToFloat,
        bin(
            BinOp::BitAnd,
            byte(i.clone()) + bin(BinOp::Shl, byte(i + int(1)), int(8)),
            int(0xffff),
        ),
    )
}
/// The little-endian f32 at byte `i` (an FP8 block's scale).
fn f32_at(i: Expr) -> Expr {
    f32_of_bytes((0..4).map(|k| byte(i.clone() + int(k))))
}
/// The f32 whose little-endian bytes are `bytes` (four integers), joined as unsigned.
fn f32_of_bytes(bytes: impl Iterator<Item = Expr>) -> Expr {
    let word = bytes
        .enumerate()
        .map(|(k, b)| bin(BinOp::Shl, cast(Ty::U32, b), cast(Ty::U32, int(8 * k as i64))))
        .reduce(|a, b| a + b)
        .expect("four bytes");
    un(UnOp::BitsToFloat, word)
}
/// The value of the FP8 E4M3 code at byte `i`.
fn fp8(i: Expr) -> Expr {
    un(UnOp::Fp8ToFloat, byte(i))
}
/// The value of the FP4 E2M1 code `c` (0..16), built as an f32's bits: sign (bit 3) to bit
/// 31; exponent `e` (bits 2..1, bias 1) and mantissa `m` (bit 0) to `2^(e−1) · (1 + m/2)`,
/// or `m/2` where `e` is 0.
fn e2m1(c: Expr) -> Expr {
    let e = mask_bits(shr(c.clone(), int(1)), 3);
    let m = mask_bits(c.clone(), 1);
    let normal = bin(BinOp::Shl, e.clone() + int(126), int(23)) + bin(BinOp::Shl, m.clone(), int(22));
    let magnitude = select(eq(e, int(0)), m * int(0x3F00_0000), normal);
    let sign = bin(BinOp::Shl, mask_bits(c, 8), int(28));
    un(UnOp::BitsToFloat, cast(Ty::U32, magnitude) + cast(Ty::U32, sign))
}
/// Half the scale of an MXFP4 block whose E8M0 exponent is `e`: `2^(e − 128)` built as ggml
/// builds it (`GGML_E8M0_TO_FP32_HALF`: subnormal bits for `e` below 2). Both sides of the
/// select are computed, so the subnormal side shifts by `e`'s low bit only.
fn e8m0_half(e: Expr) -> Expr {
    let subnormal = bin(BinOp::Shl, int(0x0020_0000), mask_bits(e.clone(), 1));
    let normal = bin(BinOp::Shl, e.clone() - int(1), int(23));
    un(
        UnOp::BitsToFloat,
        cast(Ty::U32, select(lt(e, int(2)), subnormal, normal)),
    )
}
/// An MXFP4 weight as ggml computes it: the code's E2M1 value doubled, an integer from ggml's
/// table (`UnOp::Mxfp4Value`; a negative zero is 0), times the half scale.
fn mxfp4_weight(code: Expr, half_scale: Expr) -> Expr {
    f32_of(un(UnOp::Mxfp4Value, code)) * half_scale
}
/// The IQ4 table's value at a 4-bit index.
fn iq4_value(i: Expr) -> Expr {
    un(UnOp::Iq4Value, i)
}

/// A Q3_K super-block's group `g` scale `sc − 32`: ggml's `kmask` unpacking of the 6-bit
/// values at byte 96 (low nibbles of bytes 0..8, then their high nibbles; two high bits each
/// from bytes 8..12).
fn q3k_group_scale(base: Expr, g: Expr) -> Expr {
    let packed = |i: Expr| byte(base.clone() + int(96) + i);
    // One byte read (both sides of a select are computed: byte 96 + g is past the block's end
    // for the last groups).
    let first = lt(g.clone(), int(8));
    let at = select(first.clone(), g.clone(), g.clone() - int(8));
    let low = mask_bits(shr(packed(at), select(first, int(0), int(4))), 15);
    let high = mask_bits(shr(packed(int(8) + rem(g.clone(), int(4))), g / int(4) * int(2)), 3);
    low + bin(BinOp::Shl, high, int(4)) - int(32)
}

/// An IQ4_XS super-block's run `run` scale `ls − 32` (`scales_l` nibble, two `scales_h` bits).
fn iq4xs_run_scale(base: Expr, run: Expr) -> Expr {
    let low = mask_bits(
        shr(
            byte(base.clone() + int(4) + run.clone() / int(2)),
            rem(run.clone(), int(2)) * int(4),
        ),
        15,
    );
    let scales_h = byte(base.clone() + int(2)) + bin(BinOp::Shl, byte(base + int(3)), int(8));
    let high = mask_bits(shr(scales_h, run * int(2)), 3);
    low + bin(BinOp::Shl, high, int(4)) - int(32)
}

/// `a & m`: the low bits of a byte or word.
fn mask_bits(a: Expr, m: i64) -> Expr {
    bin(BinOp::BitAnd, a, int(m))
}
fn shr(a: Expr, n: Expr) -> Expr {
    bin(BinOp::Shr, a, n)
}
fn f32_of(i: Expr) -> Expr {
    cast(Ty::F32, i)
}

/// Statements setting `out` (an f32 local) to element `e` of the row starting at byte `row`.
/// Its temporaries are named after `out` (`{out}_blk`, …), so several elements can be decoded
/// in one scope.
pub fn dequant(format: DType, out: &str, row: Expr, e: Expr) -> Vec<Stmt> {
    let (be, bb) = block_layout(format).expect("a block format");
    let t = |name: &str| format!("{out}_{name}");
    let mut s = vec![
        let_(&t("blk"), Ty::I32, row + (e.clone() / int(be)) * int(bb)),
        let_(&t("j"), Ty::I32, bin(BinOp::Rem, e, int(be))),
    ];
    let base = || var(&t("blk"));
    let j = || var(&t("j"));
    // The 4-bit value of element j of a 32-element block whose nibbles start at `at`:
    // low nibbles are elements 0..16, high nibbles 16..32.
    let nibble = |at: Expr| {
        let jj = bin(BinOp::Rem, j(), int(16));
        select(
            lt(j(), int(16)),
            mask_bits(byte(at.clone() + jj.clone()), 15),
            shr(byte(at + jj), int(4)),
        )
    };
    // Q5: the fifth bit of element j is bit j of the u32 `qh` at `at`, read from its low or
    // high 16 bits. Both sides of a select are computed, so each shifts by j mod 16: a
    // negative shift count would be undefined even on the side not taken.
    let fifth_bit = |at: Expr| {
        let word = byte(at.clone()) + bin(BinOp::Shl, byte(at.clone() + int(1)), int(8));
        let word_hi = byte(at.clone() + int(2)) + bin(BinOp::Shl, byte(at + int(3)), int(8));
        let bit_lo = mask_bits(shr(word, rem(j(), int(16))), 1);
        let bit_hi = mask_bits(shr(word_hi, rem(j(), int(16))), 1);
        select(lt(j(), int(16)), bit_lo, bit_hi)
    };
    let value = match format {
        DType::Q8_0 => half(base()) * f32_of(s8(base() + int(2) + j())),
        DType::F8E4M3B32 => fp8(base() + int(4) + j()) * f32_at(base()),
        DType::U4B32 => f32_at(base()) * f32_of(nibble(base() + int(8))) + f32_at(base() + int(4)),
        DType::F4E2M1B32 => e2m1(nibble(base() + int(8))) * f32_at(base() + select(lt(j(), int(16)), int(0), int(4))),
        DType::U4B128 => {
            // Run j / 32 of 16 level bytes: low nibbles its first 16 weights, high ones the rest.
            s.push(let_(&t("r"), Ty::I32, j() / int(32)));
            s.push(let_(&t("l"), Ty::I32, rem(j(), int(32))));
            let (r, l) = (|| var(&t("r")), || var(&t("l")));
            let packed = byte(base() + int(8) + r() * int(16) + rem(l(), int(16)));
            let level = mask_bits(shr(packed, select(lt(l(), int(16)), int(0), int(4))), 15);
            f32_at(base()) * f32_of(level) + f32_at(base() + int(4))
        }
        DType::Q4_0 => half(base()) * f32_of(nibble(base() + int(2)) - int(8)),
        DType::IQ4NL => half(base()) * f32_of(iq4_value(nibble(base() + int(2)))),
        DType::MXFP4 => mxfp4_weight(nibble(base() + int(1)), e8m0_half(byte(base()))),
        DType::Q4_1 => half(base()) * f32_of(nibble(base() + int(4))) + half(base() + int(2)),
        DType::Q5_0 => {
            half(base())
                * f32_of(nibble(base() + int(6)) + bin(BinOp::Shl, fifth_bit(base() + int(2)), int(4)) - int(16))
        }
        DType::Q5_1 => {
            half(base()) * f32_of(nibble(base() + int(8)) + bin(BinOp::Shl, fifth_bit(base() + int(4)), int(4)))
                + half(base() + int(2))
        }
        DType::Q4K | DType::Q5K => {
            // Chunk c of 64 holds sub-blocks 2c (low nibbles) and 2c+1 (high nibbles).
            s.push(let_(&t("c"), Ty::I32, j() / int(64)));
            s.push(let_(&t("l"), Ty::I32, bin(BinOp::Rem, j(), int(64))));
            s.push(let_(
                &t("sub"),
                Ty::I32,
                var(&t("c")) * int(2) + select(lt(var(&t("l")), int(32)), int(0), int(1)),
            ));
            s.extend(scale_min_k4(out, base() + int(4)));
            let qs = if format == DType::Q4K { 16 } else { 48 };
            let v = byte(base() + int(qs) + var(&t("c")) * int(32) + bin(BinOp::Rem, var(&t("l")), int(32)));
            let mut q = select(lt(var(&t("l")), int(32)), mask_bits(v.clone(), 15), shr(v, int(4)));
            if format == DType::Q5K {
                let high = mask_bits(
                    shr(
                        byte(base() + int(16) + bin(BinOp::Rem, var(&t("l")), int(32))),
                        var(&t("sub")),
                    ),
                    1,
                );
                q = q + bin(BinOp::Shl, high, int(4));
            }
            half(base()) * f32_of(var(&t("sc"))) * f32_of(q) - half(base() + int(2)) * f32_of(var(&t("m")))
        }
        DType::Q6K => {
            // Half h (128 elements): quarter g of 32 takes low/high nibbles of ql and bit pair g of qh.
            s.push(let_(&t("h"), Ty::I32, j() / int(128)));
            s.push(let_(&t("g"), Ty::I32, bin(BinOp::Rem, j(), int(128)) / int(32)));
            s.push(let_(&t("l"), Ty::I32, bin(BinOp::Rem, j(), int(32))));
            let (h, g, l) = (|| var(&t("h")), || var(&t("g")), || var(&t("l")));
            let ql = byte(base() + h() * int(64) + l() + mask_bits(g(), 1) * int(32));
            let nib = select(lt(g(), int(2)), mask_bits(ql.clone(), 15), shr(ql, int(4)));
            let qh = mask_bits(shr(byte(base() + int(128) + h() * int(32) + l()), g() * int(2)), 3);
            let q = nib + bin(BinOp::Shl, qh, int(4)) - int(32);
            let sc = s8(base() + int(192) + h() * int(8) + l() / int(16) + g() * int(2));
            half(base() + int(208)) * f32_of(sc) * f32_of(q)
        }
        DType::Q2K => {
            // Group g = j / 16: bits 2·((g % 8) / 2) of qs byte 32·(g / 8) + 16·(g % 2) + j % 16.
            s.push(let_(&t("g"), Ty::I32, j() / int(16)));
            let g = || var(&t("g"));
            let qs = base() + int(16) + g() / int(8) * int(32) + rem(g(), int(2)) * int(16) + rem(j(), int(16));
            let q = mask_bits(shr(byte(qs), rem(g(), int(8)) / int(2) * int(2)), 3);
            s.push(let_(&t("sc"), Ty::I32, byte(base() + g())));
            half(base() + int(80)) * f32_of(mask_bits(var(&t("sc")), 15)) * f32_of(q)
                - half(base() + int(82)) * f32_of(shr(var(&t("sc")), int(4)))
        }
        DType::Q3K => {
            // Group g = j / 16: Q2_K's two low bits (its `qs` 16 bytes later), and bit
            // 4·(g / 8) + (g % 8) / 2 of hmask byte 16·(g % 2) + j % 16; a clear bit subtracts 4.
            s.push(let_(&t("g"), Ty::I32, j() / int(16)));
            let g = || var(&t("g"));
            let l = rem(j(), int(16));
            let qs = base() + int(32) + g() / int(8) * int(32) + rem(g(), int(2)) * int(16) + l.clone();
            let low = mask_bits(shr(byte(qs), rem(g(), int(8)) / int(2) * int(2)), 3);
            let hm = byte(base() + rem(g(), int(2)) * int(16) + l);
            let high = mask_bits(shr(hm, g() / int(8) * int(4) + rem(g(), int(8)) / int(2)), 1);
            let q = low + high * int(4) - int(4);
            half(base() + int(108)) * f32_of(q3k_group_scale(base(), g())) * f32_of(q)
        }
        DType::IQ4XS => {
            // Run r = j / 32 of 16 bytes: low nibbles its first 16 weights, high ones the rest.
            s.push(let_(&t("r"), Ty::I32, j() / int(32)));
            s.push(let_(&t("l"), Ty::I32, rem(j(), int(32))));
            let (r, l) = (|| var(&t("r")), || var(&t("l")));
            let packed = byte(base() + int(8) + r() * int(16) + rem(l(), int(16)));
            let index = mask_bits(shr(packed, select(lt(l(), int(16)), int(0), int(4))), 15);
            half(base()) * f32_of(iq4xs_run_scale(base(), r())) * f32_of(iq4_value(index))
        }
        other => panic!("{other} is not a block format"),
    };
    s.push(let_(out, Ty::F32, value));
    s
}

/// Whether `block_weights` decodes `format` (a 32-element block with one scale).
pub fn decodes_whole_blocks(format: DType) -> bool {
    matches!(
        format,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::IQ4NL
            | DType::MXFP4
            | DType::F8E4M3B32
            | DType::U4B32
            | DType::F4E2M1B32
    )
}

/// Statements declaring f32 locals `{prefix}e` for `e` in `elements` (of `0..32`): those
/// weights of the block at byte `base` of a 32-element format (see [`decodes_whole_blocks`]),
/// each computed as `dequant` computes it.
pub fn block_weights(format: DType, prefix: &str, base: Expr, elements: Range<usize>) -> Vec<Stmt> {
    assert!(
        decodes_whole_blocks(format),
        "{format} is not a 32-element block format"
    );
    let at = |offset: i64| var("blk_at") + int(offset);
    if format == DType::F8E4M3B32 {
        return fp8_block_weights(prefix, base, elements);
    }
    if format == DType::U4B32 {
        return u4_block_weights(prefix, base, None, elements);
    }
    if format == DType::F4E2M1B32 {
        return fp4_block_weights(prefix, base, elements);
    }
    let scale = match format {
        DType::MXFP4 => e8m0_half(byte(at(0))),
        _ => half(at(0)),
    };
    let mut s = vec![let_("blk_at", Ty::I32, base), let_("blk_d", Ty::F32, scale)];
    let (qs, offset, with_min, qh) = match format {
        DType::Q4_0 => (2, 8, false, None),
        DType::Q4_1 => (4, 0, true, None),
        DType::Q5_0 => (6, 16, false, Some(2)),
        DType::Q5_1 => (8, 0, true, Some(4)),
        DType::MXFP4 => (1, 0, false, None),
        _ => (2, 0, false, None),
    };
    if with_min {
        s.push(let_("blk_m", Ty::F32, half(at(2))));
    }
    if let Some(qh) = qh {
        // The 32 fifth bits, little-endian: bit e belongs to element e.
        s.push(let_(
            "blk_h0",
            Ty::I32,
            byte(at(qh)) + bin(BinOp::Shl, byte(at(qh + 1)), int(8)),
        ));
        s.push(let_(
            "blk_h1",
            Ty::I32,
            byte(at(qh + 2)) + bin(BinOp::Shl, byte(at(qh + 3)), int(8)),
        ));
    }
    let scaled = |q: Expr| {
        if format == DType::IQ4NL {
            return var("blk_d") * f32_of(iq4_value(q));
        }
        if format == DType::MXFP4 {
            return mxfp4_weight(q, var("blk_d"));
        }
        let v = var("blk_d") * f32_of(q - int(offset));
        match with_min {
            true => v + var("blk_m"),
            false => v,
        }
    };
    if format == DType::Q8_0 {
        for e in elements.map(|e| e as i64) {
            s.push(let_(
                &format!("{prefix}{e}"),
                Ty::F32,
                var("blk_d") * f32_of(s8(at(2 + e))),
            ));
        }
        return s;
    }
    for j in 0..16 {
        if !elements.contains(&(j as usize)) && !elements.contains(&(j as usize + 16)) {
            continue;
        }
        let b = format!("blk_b{j}");
        s.push(let_(&b, Ty::I32, byte(at(qs + j))));
        for (e, nibble) in [(j, mask_bits(var(&b), 15)), (j + 16, shr(var(&b), int(4)))] {
            if !elements.contains(&(e as usize)) {
                continue;
            }
            let q = match qh {
                Some(_) => {
                    let word = if e < 16 { "blk_h0" } else { "blk_h1" };
                    nibble + bin(BinOp::Shl, mask_bits(shr(var(word), int(e % 16)), 1), int(4))
                }
                None => nibble,
            };
            s.push(let_(&format!("{prefix}{e}"), Ty::F32, scaled(q)));
        }
    }
    s
}

/// [`block_weights`] of an FP8 block: its f32 scale, then each code one weight, read four bytes
/// a load (a block is 36 bytes, so every word of it is aligned) where a byte at a time would
/// take nine times the loads, the codes widened two a conversion; each code's value times the
/// scale.
fn fp8_block_weights(prefix: &str, base: Expr, elements: Range<usize>) -> Vec<Stmt> {
    let at = |offset: i64| var("blk_at") + int(offset);
    let bytes: Vec<String> = (0..4).map(|b| format!("blk_s{b}")).collect();
    let mut s = vec![let_("blk_at", Ty::I32, base), load_vec("w", at(0), &bytes)];
    s.push(let_("blk_d", Ty::F32, f32_of_bytes(bytes.iter().map(|b| var(b)))));
    for word in 0..8 {
        let codes = 4 * word..4 * word + 4;
        if !codes.clone().any(|e| elements.contains(&e)) {
            continue;
        }
        let values: Vec<String> = codes.clone().map(|e| format!("blk_c{e}")).collect();
        s.push(load_fp8_codes("w", at(4 + 4 * word as i64), &values));
        for e in codes.filter(|e| elements.contains(e)) {
            s.push(let_(
                &format!("{prefix}{e}"),
                Ty::F32,
                var(&format!("blk_c{e}")) * var("blk_d"),
            ));
        }
    }
    s
}

/// [`block_weights`] of a run of 32 4-bit levels (`quant::u4_blocks`; a block of 32, or run
/// `run` of a block of 128): each weight its level times the block's f32 scale plus its
/// offset.
fn u4_block_weights(prefix: &str, base: Expr, run: Option<Expr>, elements: Range<usize>) -> Vec<Stmt> {
    let words = [("s", "blk_d"), ("m", "blk_m")];
    nibble_block_weights(prefix, base, run, words, elements, |level, _| {
        var("blk_d") * f32_of(level) + var("blk_m")
    })
}

/// [`block_weights`] of a block of FP4 codes (`quant::fp4_blocks`): each weight its code's
/// value times its group's f32 scale (the first for elements `0..16`, the second for the rest).
fn fp4_block_weights(prefix: &str, base: Expr, elements: Range<usize>) -> Vec<Stmt> {
    let words = [("s", "blk_d0"), ("t", "blk_d1")];
    nibble_block_weights(prefix, base, None, words, elements, |code, high| {
        e2m1(code) * var(if high { "blk_d1" } else { "blk_d0" })
    })
}

/// The weights `elements` of a block whose first eight bytes are two f32s (declared as
/// `words`' names, read byte by byte into locals of their prefixes) and whose 32 4-bit values
/// follow in 16 bytes (or run `run`'s 16 bytes of them), four bytes a load (blocks of 24 or 72
/// bytes, so every word is aligned), each byte two weights, element `j`'s value (low nibble)
/// and element `j + 16`'s (high): each `weight(value, high)`.
fn nibble_block_weights(
    prefix: &str,
    base: Expr,
    run: Option<Expr>,
    words: [(&str, &str); 2],
    elements: Range<usize>,
    weight: impl Fn(Expr, bool) -> Expr,
) -> Vec<Stmt> {
    let at = |offset: i64| var("blk_at") + int(offset);
    let bytes_of = |name: &str| (0..4).map(|b| format!("blk_{name}{b}")).collect::<Vec<String>>();
    let (first, second) = (bytes_of(words[0].0), bytes_of(words[1].0));
    let mut s = vec![
        let_("blk_at", Ty::I32, base),
        load_vec("w", at(0), &first),
        load_vec("w", at(4), &second),
    ];
    // Where the run's values start: right after the two words in a block of 32.
    let runs = run.is_some();
    if let Some(run) = run {
        s.push(let_("blk_qs", Ty::I32, at(8) + run * int(16)));
    }
    let value_word = |word: i64| match runs {
        true => var("blk_qs") + int(4 * word),
        false => at(8 + 4 * word),
    };
    for ((_, name), bytes) in words.iter().zip([&first, &second]) {
        s.push(let_(name, Ty::F32, f32_of_bytes(bytes.iter().map(|b| var(b)))));
    }
    for word in 0..4 {
        let bytes = 4 * word..4 * word + 4;
        if !bytes
            .clone()
            .any(|j| elements.contains(&j) || elements.contains(&(j + 16)))
        {
            continue;
        }
        let names: Vec<String> = bytes.clone().map(|j| format!("blk_b{j}")).collect();
        s.push(load_vec("w", value_word(word as i64), &names));
        for (j, b) in bytes.zip(&names) {
            for (e, value, high) in [(j, mask_bits(var(b), 15), false), (j + 16, shr(var(b), int(4)), true)] {
                if elements.contains(&e) {
                    s.push(let_(&format!("{prefix}{e}"), Ty::F32, weight(value, high)));
                }
            }
        }
    }
    s
}

/// Statements declaring f32 locals `{prefix}e` for `e` in `elements` (of `0..32`): those
/// weights of sub-block `sub` (0..8) of the K-quant super-block at byte `base` (or run `sub`,
/// 0..4, of a block of 128 4-bit levels), each computed as `dequant` computes it (the same
/// operations in the same order), with the sub-block's scales decoded once.
pub fn k_sub_block_weights(format: DType, prefix: &str, base: Expr, sub: Expr, elements: Range<usize>) -> Vec<Stmt> {
    if format == DType::U4B128 {
        return u4_block_weights(prefix, base, Some(sub), elements);
    }
    let at = |offset: Expr| var("blk_at") + offset;
    let mut s = vec![let_("blk_at", Ty::I32, base), let_("q_sub", Ty::I32, sub)];
    let weight = |e: usize| format!("{prefix}{e}");
    match format {
        DType::Q4K | DType::Q5K => {
            // Sub-block s: chunk s / 2 of 32 bytes, low nibbles when s is even, high when odd.
            s.extend(scale_min_k4("q", at(int(4))));
            s.push(let_("blk_ds", Ty::F32, half(at(int(0))) * f32_of(var("q_sc"))));
            s.push(let_("blk_dm", Ty::F32, half(at(int(2))) * f32_of(var("q_m"))));
            s.push(let_("blk_shift", Ty::I32, mask_bits(var("q_sub"), 1) * int(4)));
            let qs = if format == DType::Q4K { 16 } else { 48 };
            s.push(let_("blk_qs", Ty::I32, at(int(qs)) + var("q_sub") / int(2) * int(32)));
            for e in elements.clone().map(|e| e as i64) {
                let mut q = mask_bits(shr(byte(var("blk_qs") + int(e)), var("blk_shift")), 15);
                if format == DType::Q5K {
                    let high = mask_bits(shr(byte(at(int(16 + e))), var("q_sub")), 1);
                    q = q + bin(BinOp::Shl, high, int(4));
                }
                s.push(let_(
                    &weight(e as usize),
                    Ty::F32,
                    var("blk_ds") * f32_of(q) - var("blk_dm"),
                ));
            }
        }
        DType::Q6K => {
            // Sub-block s: half h = s / 4, quarter g = s % 4 (see `dequant`); a scale per 16.
            s.push(let_("q_h", Ty::I32, var("q_sub") / int(4)));
            s.push(let_("q_g", Ty::I32, rem(var("q_sub"), int(4))));
            s.push(let_("blk_d", Ty::F32, half(at(int(208)))));
            let scale = |half_: i64| s8(at(int(192)) + var("q_h") * int(8) + int(half_) + var("q_g") * int(2));
            s.push(let_("blk_ds0", Ty::F32, var("blk_d") * f32_of(scale(0))));
            s.push(let_("blk_ds1", Ty::F32, var("blk_d") * f32_of(scale(1))));
            s.push(let_(
                "blk_ql",
                Ty::I32,
                at(var("q_h") * int(64) + mask_bits(var("q_g"), 1) * int(32)),
            ));
            s.push(let_("blk_nib", Ty::I32, select(lt(var("q_g"), int(2)), int(0), int(4))));
            s.push(let_("blk_qh", Ty::I32, at(int(128)) + var("q_h") * int(32)));
            for e in elements.clone().map(|e| e as i64) {
                let nib = mask_bits(shr(byte(var("blk_ql") + int(e)), var("blk_nib")), 15);
                let qh = mask_bits(shr(byte(var("blk_qh") + int(e)), var("q_g") * int(2)), 3);
                let q = nib + bin(BinOp::Shl, qh, int(4)) - int(32);
                let ds = if e < 16 { "blk_ds0" } else { "blk_ds1" };
                s.push(let_(&weight(e as usize), Ty::F32, var(ds) * f32_of(q)));
            }
        }
        DType::Q2K => {
            // Sub-block s: groups 2s and 2s + 1, bytes 32·(s / 4) + (0..32) of qs at bit 2·(s % 4).
            for (name, group) in [
                ("blk_sc0", var("q_sub") * int(2)),
                ("blk_sc1", var("q_sub") * int(2) + int(1)),
            ] {
                s.push(let_(name, Ty::I32, byte(at(group))));
            }
            s.push(let_("blk_d", Ty::F32, half(at(int(80)))));
            s.push(let_("blk_dmin", Ty::F32, half(at(int(82)))));
            for (i, sc) in ["blk_sc0", "blk_sc1"].into_iter().enumerate() {
                s.push(let_(
                    &format!("blk_ds{i}"),
                    Ty::F32,
                    var("blk_d") * f32_of(mask_bits(var(sc), 15)),
                ));
                s.push(let_(
                    &format!("blk_dm{i}"),
                    Ty::F32,
                    var("blk_dmin") * f32_of(shr(var(sc), int(4))),
                ));
            }
            s.push(let_("blk_qs", Ty::I32, at(int(16)) + var("q_sub") / int(4) * int(32)));
            s.push(let_("blk_shift", Ty::I32, rem(var("q_sub"), int(4)) * int(2)));
            for e in elements.clone().map(|e| e as i64) {
                let q = mask_bits(shr(byte(var("blk_qs") + int(e)), var("blk_shift")), 3);
                let half_ = if e < 16 { 0 } else { 1 };
                s.push(let_(
                    &weight(e as usize),
                    Ty::F32,
                    var(&format!("blk_ds{half_}")) * f32_of(q) - var(&format!("blk_dm{half_}")),
                ));
            }
        }
        DType::Q3K => {
            // Sub-block s: groups 2s and 2s + 1, qs bytes 32 + 32·(s / 4) + (0..32) at bit
            // 2·(s % 4), hmask bytes 0..32 at bit 4·(s / 4) + s % 4.
            s.push(let_("blk_d", Ty::F32, half(at(int(108)))));
            for (i, group) in [var("q_sub") * int(2), var("q_sub") * int(2) + int(1)]
                .into_iter()
                .enumerate()
            {
                let scale = q3k_group_scale(var("blk_at"), group);
                s.push(let_(&format!("blk_ds{i}"), Ty::F32, var("blk_d") * f32_of(scale)));
            }
            s.push(let_("blk_qs", Ty::I32, at(int(32)) + var("q_sub") / int(4) * int(32)));
            s.push(let_("blk_shift", Ty::I32, rem(var("q_sub"), int(4)) * int(2)));
            s.push(let_(
                "blk_bit",
                Ty::I32,
                var("q_sub") / int(4) * int(4) + rem(var("q_sub"), int(4)),
            ));
            for e in elements.clone().map(|e| e as i64) {
                let low = mask_bits(shr(byte(var("blk_qs") + int(e)), var("blk_shift")), 3);
                let high = mask_bits(shr(byte(at(int(e))), var("blk_bit")), 1);
                let q = low + high * int(4) - int(4);
                let ds = if e < 16 { "blk_ds0" } else { "blk_ds1" };
                s.push(let_(&weight(e as usize), Ty::F32, var(ds) * f32_of(q)));
            }
        }
        DType::IQ4XS => {
            // Sub-block s is run s: its scale once, then each byte's two table indices.
            s.push(let_(
                "blk_ds",
                Ty::F32,
                half(at(int(0))) * f32_of(iq4xs_run_scale(var("blk_at"), var("q_sub"))),
            ));
            s.push(let_("blk_qs", Ty::I32, at(int(8)) + var("q_sub") * int(16)));
            for j in 0..16 {
                if !elements.contains(&(j as usize)) && !elements.contains(&(j as usize + 16)) {
                    continue;
                }
                let b = format!("blk_b{j}");
                s.push(let_(&b, Ty::I32, byte(var("blk_qs") + int(j))));
                for (e, index) in [(j, mask_bits(var(&b), 15)), (j + 16, shr(var(&b), int(4)))] {
                    if !elements.contains(&(e as usize)) {
                        continue;
                    }
                    s.push(let_(
                        &weight(e as usize),
                        Ty::F32,
                        var("blk_ds") * f32_of(iq4_value(index)),
                    ));
                }
            }
        }
        other => panic!("{other} is not a K-quant"),
    }
    s
}

/// Statements declaring f32 locals `{prefix}e` for `e` in `elements` (of `0..32`): those
/// elements of run `run` in a stream of whole blocks of `format` from byte 0 (a 32-element
/// format's block `run`, or sub-block `run mod n` of super-block `run / n`, `n` its runs of 32), through
/// [`block_weights`] or [`k_sub_block_weights`]: scales decoded once for them all.
pub fn run_weights(format: DType, prefix: &str, run: Expr, elements: Range<usize>) -> Vec<Stmt> {
    let (block_elements, bytes) = block_layout(format).expect("a block format");
    match decodes_sub_blocks(format) {
        true => {
            let runs = int(block_elements / 32);
            let (base, sub) = (run.clone() / runs.clone() * int(bytes), rem(run, runs));
            k_sub_block_weights(format, prefix, base, sub, elements)
        }
        false => block_weights(format, prefix, run * int(bytes), elements),
    }
}

/// Whether `k_sub_block_weights` decodes `format` (a 256-element super-block of a K-quant or
/// IQ4_XS, or a block of 128 4-bit levels: runs of 32 under shared scales).
pub fn decodes_sub_blocks(format: DType) -> bool {
    matches!(
        format,
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::IQ4XS | DType::U4B128
    )
}

/// ggml's `get_scale_min_k4` for sub-block `{p}_sub`: sets `{p}_sc` and `{p}_m` (6-bit each).
fn scale_min_k4(p: &str, scales: Expr) -> Vec<Stmt> {
    let q = |i: Expr| byte(scales.clone() + i);
    let sub = format!("{p}_sub");
    let j = || var(&sub);
    let low = lt(j(), int(4));
    vec![
        let_(
            &format!("{p}_sc"),
            Ty::I32,
            select(
                low.clone(),
                mask_bits(q(j()), 63),
                mask_bits(q(j() + int(4)), 15) + bin(BinOp::Shl, shr(q(j() - int(4)), int(6)), int(4)),
            ),
        ),
        let_(
            &format!("{p}_m"),
            Ty::I32,
            select(
                low,
                mask_bits(q(j() + int(4)), 63),
                shr(q(j() + int(4)), int(4)) + bin(BinOp::Shl, shr(q(j()), int(6)), int(4)),
            ),
        ),
    ]
}

/// How a matmul's weights are stored: dense f32/bf16, or GGUF blocks (as raw bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    Dense(Ty),
    Blocks(DType),
}

impl WeightFormat {
    /// From an IR weight dtype.
    pub fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::Dense(Ty::F32)),
            DType::BF16 => Some(Self::Dense(Ty::Bf16)),
            DType::F16 => Some(Self::Dense(Ty::F16)),
            d if block_layout(d).is_some() => Some(Self::Blocks(d)),
            _ => None,
        }
    }

    /// Elements of the `w` buffer (of [`Self::buffer_ty`]) that `elements` weights take: the
    /// weights themselves, or the bytes of their blocks.
    pub fn buffer_len(self, elements: usize) -> usize {
        match self {
            Self::Dense(_) => elements,
            Self::Blocks(format) => {
                let (block_elements, block_bytes) = block_layout(format).expect("a block format");
                elements / block_elements as usize * block_bytes as usize
            }
        }
    }

    /// The element type of the `w` buffer.
    pub fn buffer_ty(self) -> Ty {
        match self {
            Self::Dense(ty) => ty,
            Self::Blocks(_) => Ty::U8,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Self::Dense(ty) => format!("{ty:?}"),
            Self::Blocks(d) => d.to_string(),
        }
    }

    /// Statements setting `out` to `W[r, i]` of a `k`-wide matrix in buffer `w`.
    pub fn element(self, out: &str, r: Expr, k: Expr, i: Expr) -> Vec<Stmt> {
        match self {
            Self::Dense(_) => vec![let_(out, Ty::F32, load("w", r * k + i))],
            Self::Blocks(format) => {
                let (be, bb) = block_layout(format).expect("a block format");
                dequant(format, out, r * (k / int(be)) * int(bb), i)
            }
        }
    }
}
